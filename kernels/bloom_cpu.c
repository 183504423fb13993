/* IncrCP's key tests for its extractor (mpickpt._bloom_cpu).
 * Stage 2's Bloom filter bits, the same filter as mpickpt.incrcp.bloom's numpy path: key j's
 * positions are (h1[j] + i * h2[j]) mod num_bits for i < num_hashes (uint64 arithmetic,
 * wrapping), and position p is bit p & 7 of byte p >> 3. count_present stops at a key's first
 * clear bit, where numpy computes every position of every key.
 * Stage 3's exact test, members: which of a chunk's ascending keys are among the new ascending
 * keys, each key of the shorter side found by galloping through the longer from the last one's
 * place (numpy's searchsorted is a binary search of the new keys per chunk key). It refuses keys
 * that are not ascending instead of answering wrongly (the new keys' order once checked by the
 * caller is taken on trust).
 * The GIL is released while they run. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static Py_ssize_t count(const uint8_t *bits, uint64_t nbits, Py_ssize_t k, const uint64_t *h1,
                        const uint64_t *h2, Py_ssize_t n) {
    Py_ssize_t found = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        const uint64_t a = h1[j], b = h2[j];
        Py_ssize_t i = 0;
        for (; i < k; i++) {
            const uint64_t p = (a + (uint64_t)i * b) % nbits;
            if (!((bits[p >> 3] >> (p & 7)) & 1)) break;
        }
        found += (i == k);
    }
    return found;
}

static void set(uint8_t *bits, uint64_t nbits, Py_ssize_t k, const uint64_t *h1,
                const uint64_t *h2, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        const uint64_t a = h1[j], b = h2[j];
        for (Py_ssize_t i = 0; i < k; i++) {
            const uint64_t p = (a + (uint64_t)i * b) % nbits;
            bits[p >> 3] |= (uint8_t)(1u << (p & 7));
        }
    }
}

/* Checks shared by both calls: ValueError naming the call and the sizes unless consistent. */
static int consistent(const char *name, Py_ssize_t bits_len, Py_ssize_t nbits, Py_ssize_t k,
                      Py_ssize_t h1_len, Py_ssize_t h2_len) {
    if (nbits <= 0 || k <= 0 || bits_len * 8 < nbits || h1_len % 8 || h1_len != h2_len) {
        PyErr_Format(PyExc_ValueError,
                     "%s: inconsistent arguments (%zd bits in %zd bytes, %zd hashes, hash "
                     "buffers of %zd and %zd bytes, expected equal multiples of 8)",
                     name, nbits, bits_len, k, h1_len, h2_len);
        return 0;
    }
    return 1;
}

static PyObject *count_present(PyObject *self, PyObject *args) {
    Py_buffer bb, ab, cb;
    Py_ssize_t nbits, k, found = 0;
    if (!PyArg_ParseTuple(args, "y*nny*y*", &bb, &nbits, &k, &ab, &cb)) return NULL;
    PyObject *result = NULL;
    if (consistent("count_present", bb.len, nbits, k, ab.len, cb.len)) {
        Py_BEGIN_ALLOW_THREADS
        found = count((const uint8_t *)bb.buf, (uint64_t)nbits, k, (const uint64_t *)ab.buf,
                      (const uint64_t *)cb.buf, ab.len / 8);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(found);
    }
    PyBuffer_Release(&bb); PyBuffer_Release(&ab); PyBuffer_Release(&cb);
    return result;
}

static PyObject *set_bits(PyObject *self, PyObject *args) {
    Py_buffer bb, ab, cb;
    Py_ssize_t nbits, k;
    if (!PyArg_ParseTuple(args, "w*nny*y*", &bb, &nbits, &k, &ab, &cb)) return NULL;
    PyObject *result = NULL;
    if (consistent("set_bits", bb.len, nbits, k, ab.len, cb.len)) {
        Py_BEGIN_ALLOW_THREADS
        set((uint8_t *)bb.buf, (uint64_t)nbits, k, (const uint64_t *)ab.buf,
            (const uint64_t *)cb.buf, ab.len / 8);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&bb); PyBuffer_Release(&ab); PyBuffer_Release(&cb);
    return result;
}

/* The first position in a[lo..n) whose key is >= key (n if none): a galloping search from lo,
 * doubling its stride until it passes key, then a binary search of the last stride. */
static Py_ssize_t gallop(const int64_t *a, Py_ssize_t lo, Py_ssize_t n, int64_t key) {
    Py_ssize_t hi = lo, stride = 1;
    while (hi < n && a[hi] < key) {
        lo = hi + 1;
        hi = lo + stride;
        stride <<= 1;
    }
    if (hi > n) hi = n;
    while (lo < hi) {
        const Py_ssize_t mid = lo + (hi - lo) / 2;
        if (a[mid] < key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* out[i] = whether a[i] is among k[0..m), both strictly ascending; returns -1, or the position
 * in `a` (kind 0) or `k` (kind 1) of the first key that is not above the one before it (`k` is
 * checked only where `check_k`: a caller that checked it once may test many chunks against it).
 * The shorter side is walked and each of its keys found by galloping through the longer from
 * the last one's place: O(shorter * log(longer / shorter)) after the order checks. */
static Py_ssize_t merge(const int64_t *a, Py_ssize_t n, const int64_t *k, Py_ssize_t m,
                        uint8_t *out, int check_k, int *kind) {
    for (Py_ssize_t i = 1; i < n; i++)
        if (a[i] <= a[i - 1]) { *kind = 0; return i; }
    for (Py_ssize_t j = 1; check_k && j < m; j++)
        if (k[j] <= k[j - 1]) { *kind = 1; return j; }
    memset(out, 0, (size_t)n);
    Py_ssize_t at = 0;
    if (m <= n) {
        for (Py_ssize_t j = 0; j < m && at < n; j++) {
            at = gallop(a, at, n, k[j]);
            if (at < n && a[at] == k[j]) out[at++] = 1;
        }
    } else {
        for (Py_ssize_t i = 0; i < n && at < m; i++) {
            at = gallop(k, at, m, a[i]);
            if (at < m && k[at] == a[i]) { out[i] = 1; at++; }
        }
    }
    return -1;
}

static PyObject *members(PyObject *self, PyObject *args) {
    Py_buffer ab, kb, ob;
    int check_new = 1;
    if (!PyArg_ParseTuple(args, "y*y*w*|p", &ab, &kb, &ob, &check_new)) return NULL;
    PyObject *result = NULL;
    if (ab.len % 8 || kb.len % 8 || ob.len != ab.len / 8) {
        PyErr_Format(PyExc_ValueError, "members: inconsistent buffers (keys %zd bytes, new keys "
                     "%zd bytes, out %zd bytes; expected int64 keys and one byte per key)",
                     ab.len, kb.len, ob.len);
    } else {
        Py_ssize_t bad;
        int kind = 0;
        Py_BEGIN_ALLOW_THREADS
        bad = merge((const int64_t *)ab.buf, ab.len / 8, (const int64_t *)kb.buf, kb.len / 8,
                    (uint8_t *)ob.buf, check_new, &kind);
        Py_END_ALLOW_THREADS
        if (bad >= 0)
            PyErr_Format(PyExc_ValueError, "members: %s are not strictly ascending at position "
                         "%zd", kind ? "the new keys" : "the keys", bad);
        else {
            result = Py_None;
            Py_INCREF(result);
        }
    }
    PyBuffer_Release(&ab); PyBuffer_Release(&kb); PyBuffer_Release(&ob);
    return result;
}

static PyMethodDef methods[] = {
    {"count_present", count_present, METH_VARARGS,
     "count_present(bits_uint8, num_bits, num_hashes, h1_uint64, h2_uint64): how many keys "
     "have every one of their positions set"},
    {"set_bits", set_bits, METH_VARARGS,
     "set_bits(bits_uint8 (written), num_bits, num_hashes, h1_uint64, h2_uint64): set every "
     "position of every key"},
    {"members", members, METH_VARARGS,
     "members(keys_int64, new_keys_int64, out_uint8 (written), check_new=True): out[i] = "
     "keys[i] is among the new keys, both strictly ascending (ValueError otherwise; the new "
     "keys' order is taken on trust where check_new is false)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bloom_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__bloom_cpu(void) { return PyModule_Create(&module); }
