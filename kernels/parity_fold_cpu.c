/* CPU fold of parity deltas (mpickpt._parity_cpu): parity[prow[i]] ^= coef[i] * delta[i] over
 * GF(2^8), bytewise, for n rows of W int32 words. Rows may repeat (deltas of several sources for
 * one stripe): the loop is sequential, so every delta lands. coef 1 is a plain XOR (r = 1, and
 * row 0 of the Cauchy matrix); coef 0 adds nothing. The GIL is released while it runs.
 *
 * xor_rows: the r = 1 decode of a rebuild, dest[i] = XOR of sources' row i, for strided rows
 * given by address (the caller checks every extent; see mpickpt.parity.xor_rows).
 * xor_rows_many: several such XORs in one call (a rebuild piece's slots and row tensors), in
 * blocks of rows across all of them (see xor_records). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int fold(uint8_t *parity, Py_ssize_t prows, Py_ssize_t w, const int64_t *prow,
                const uint8_t *coef, const uint8_t *delta, Py_ssize_t n, const uint8_t *mul,
                Py_ssize_t *bad) {
    const Py_ssize_t bytes = 4 * w;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t p = prow[i];
        if (p < 0 || p >= prows) { *bad = i; return -1; }
        uint8_t *dst = parity + p * bytes;
        const uint8_t *src = delta + i * bytes;
        const uint8_t c = coef[i];
        if (c == 1) {
            for (Py_ssize_t b = 0; b < bytes; b += 4) {
                uint32_t a, d;
                memcpy(&a, dst + b, 4);
                memcpy(&d, src + b, 4);
                a ^= d;
                memcpy(dst + b, &a, 4);
            }
        } else if (c != 0) {
            const uint8_t *row = mul + 256 * (Py_ssize_t)c;
            for (Py_ssize_t b = 0; b < bytes; b++) dst[b] ^= row[src[b]];
        }
    }
    return 0;
}

static PyObject *fold_rows(PyObject *self, PyObject *args) {
    Py_buffer pb, ib, cb, db, mb;
    Py_ssize_t w, n, bad = -1;
    if (!PyArg_ParseTuple(args, "w*ny*y*y*y*", &pb, &w, &ib, &cb, &db, &mb)) return NULL;
    PyObject *result = NULL;
    n = ib.len / 8;
    if (w <= 0 || pb.len % (4 * w) || cb.len != n || db.len != n * 4 * w || mb.len != 65536) {
        PyErr_Format(PyExc_ValueError,
                     "fold_rows: inconsistent buffers (width %zd, parity %zd bytes, %zd rows, "
                     "coef %zd bytes, delta %zd bytes, table %zd bytes)",
                     w, pb.len, n, cb.len, db.len, mb.len);
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fold((uint8_t *)pb.buf, pb.len / (4 * w), w, (const int64_t *)ib.buf,
              (const uint8_t *)cb.buf, (const uint8_t *)db.buf, n, (const uint8_t *)mb.buf, &bad);
    Py_END_ALLOW_THREADS
    if (rc) {
        PyErr_Format(PyExc_IndexError, "fold_rows: parity row %lld of delta %zd is outside the "
                     "%zd parity rows", (long long)((const int64_t *)ib.buf)[bad], bad,
                     pb.len / (4 * w));
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&pb); PyBuffer_Release(&ib); PyBuffer_Release(&cb);
    PyBuffer_Release(&db); PyBuffer_Release(&mb);
    return result;
}

typedef struct { const uint8_t *base; int64_t stride, count; } source_t;

/* Each row's XOR is formed in `acc`, XOR_BLOCK bytes at a time, and stored once: every byte of
 * dest is written only with its final value, so a thread reading dest meanwhile (a rebuild's
 * lookup reading rows a sweep beside it rewrites with the same values) never sees a partial XOR. */
#define XOR_BLOCK 4096

static inline uint64_t load64(const uint8_t *p) { uint64_t x; memcpy(&x, p, 8); return x; }
static inline uint32_t load32(const uint8_t *p) { uint32_t x; memcpy(&x, p, 4); return x; }

/* Rows [0, n) of a record whose every source has them, `width` a multiple of 4 bytes (int32
 * words): each word's XOR is formed in a register and stored once. A rebuild's rows are narrow
 * (a 64-byte row of weights, a 4-byte rowwise Adagrad state), so the per-row work of the general
 * loop below (its source scan, the staging through acc) cost more than the bytes: ~35 ns a row. */
static void xor_full_rows(uint8_t *dest, int64_t stride, int64_t n, int64_t width,
                          const source_t *src, int64_t m) {
    if (m == 3) {  /* r = 1 with k = 3, the common group: the sources unrolled */
        const uint8_t *a0 = src[0].base, *b0 = src[1].base, *c0 = src[2].base;
        const int64_t sa = src[0].stride, sb = src[1].stride, sc = src[2].stride;
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *a = a0 + i * sa, *b = b0 + i * sb, *c = c0 + i * sc;
            uint8_t *d = dest + i * stride;
            int64_t o = 0;
            for (; o + 8 <= width; o += 8) {
                uint64_t x = load64(a + o) ^ load64(b + o) ^ load64(c + o);
                memcpy(d + o, &x, 8);
            }
            if (o < width) {
                uint32_t x = load32(a + o) ^ load32(b + o) ^ load32(c + o);
                memcpy(d + o, &x, 4);
            }
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        uint8_t *d = dest + i * stride;
        int64_t o = 0;
        for (; o + 8 <= width; o += 8) {
            uint64_t x = 0;
            for (int64_t s = 0; s < m; s++) x ^= load64(src[s].base + i * src[s].stride + o);
            memcpy(d + o, &x, 8);
        }
        if (o < width) {
            uint32_t x = 0;
            for (int64_t s = 0; s < m; s++) x ^= load32(src[s].base + i * src[s].stride + o);
            memcpy(d + o, &x, 4);
        }
    }
}

static void xor_strided(uint8_t *dest, int64_t stride, int64_t n, int64_t width,
                        const source_t *src, int64_t m) {
    const uint8_t *p[256];
    uint64_t acc[XOR_BLOCK / 8];
    uint8_t *a8 = (uint8_t *)acc;
    int64_t full = m > 0 && width % 4 == 0 && width <= XOR_BLOCK ? n : 0;
    for (int64_t s = 0; s < m; s++)
        if (src[s].count < full) full = src[s].count;
    if (full > 0) xor_full_rows(dest, stride, full, width, src, m);
    for (int64_t i = full > 0 ? full : 0; i < n; i++) {
        uint8_t *d = dest + i * stride;
        int64_t k = 0;
        for (int64_t s = 0; s < m; s++)
            if (i < src[s].count) p[k++] = src[s].base + i * src[s].stride;
        if (k == 0) { memset(d, 0, (size_t)width); continue; }
        for (int64_t b0 = 0; b0 < width; b0 += XOR_BLOCK) {
            int64_t w = width - b0 < XOR_BLOCK ? width - b0 : XOR_BLOCK;
            memcpy(a8, p[0] + b0, (size_t)w);
            for (int64_t s = 1; s < k; s++) {
                const uint8_t *q = p[s] + b0;
                int64_t b = 0;
                for (; b + 8 <= w; b += 8) {
                    uint64_t x;
                    memcpy(&x, q + b, 8);
                    acc[b / 8] ^= x;
                }
                for (; b < w; b++) a8[b] ^= q[b];
            }
            memcpy(d + b0, a8, (size_t)w);
        }
    }
}

/* m (address, stride, count) int64 triples into sources. */
static void load_sources(const int64_t *t, int64_t m, source_t *src) {
    for (int64_t s = 0; s < m; s++) {
        src[s].base = (const uint8_t *)(uintptr_t)t[3 * s];
        src[s].stride = t[3 * s + 1];
        src[s].count = t[3 * s + 2];
    }
}

static PyObject *xor_rows(PyObject *self, PyObject *args) {
    unsigned long long dest;
    long long stride, n, width;
    Py_buffer sb;
    if (!PyArg_ParseTuple(args, "KLLLy*", &dest, &stride, &n, &width, &sb)) return NULL;
    const int64_t m = sb.len / (3 * 8);
    if (sb.len != m * 3 * 8 || n < 0 || width <= 0 || m > 256) {
        PyErr_Format(PyExc_ValueError, "xor_rows: sources must be (address, stride, count) int64 "
                     "triples (at most 256), got %zd bytes; rows %lld, width %lld",
                     sb.len, n, width);
        PyBuffer_Release(&sb);
        return NULL;
    }
    source_t src[256];
    load_sources((const int64_t *)sb.buf, m, src);
    Py_BEGIN_ALLOW_THREADS
    xor_strided((uint8_t *)(uintptr_t)dest, stride, n, width, src, m);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&sb);
    Py_RETURN_NONE;
}

/* Records of int64: dest, dest stride, rows >= 0, width in bytes > 0, 0 <= m <= 256, then m
 * (address, stride, count) triples. Returns the number of records, or -1 (with *bad the word
 * where the first bad one starts) when a record breaks these rules or does not fit the buffer. */
static int64_t check_records(const int64_t *t, int64_t words, int64_t *bad) {
    int64_t at = 0, count = 0;
    while (at < words) {
        if (at + 5 > words || t[at + 2] < 0 || t[at + 3] <= 0 || t[at + 4] < 0 || t[at + 4] > 256 ||
            at + 5 + 3 * t[at + 4] > words) { *bad = at; return -1; }
        at += 5 + 3 * t[at + 4];
        count++;
    }
    return count;
}

/* The records in blocks of ROW_BLOCK rows: rows r0 .. r0 + ROW_BLOCK - 1 of every record, then
 * the next block. A rebuild piece's records are its slots and row tensors over the same periods,
 * whose rows interleave in memory (slot o of a period is row o of its k); record by record,
 * each pass fetched every cache line of the others' rows too and the next pass fetched them
 * again from memory. A block of every record stays in cache: each line comes in once. */
#define ROW_BLOCK 32
static void xor_records(const int64_t *t, int64_t words) {
    source_t src[256];
    int64_t most = 0;
    for (int64_t at = 0; at < words; at += 5 + 3 * t[at + 4])
        if (t[at + 2] > most) most = t[at + 2];
    for (int64_t r0 = 0; r0 < most; r0 += ROW_BLOCK) {
        for (int64_t at = 0; at < words; at += 5 + 3 * t[at + 4]) {
            const int64_t rows = t[at + 2], m = t[at + 4];
            if (r0 >= rows) continue;
            const int64_t n = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
            load_sources(t + at + 5, m, src);
            for (int64_t s = 0; s < m; s++) {  /* a source with no row left stays put */
                if (src[s].count > r0) src[s].base += r0 * src[s].stride;
                src[s].count = src[s].count > r0 ? src[s].count - r0 : 0;
            }
            xor_strided((uint8_t *)(uintptr_t)t[at] + r0 * t[at + 1], t[at + 1], n, t[at + 3],
                        src, m);
        }
    }
}

static PyObject *xor_rows_many(PyObject *self, PyObject *args) {
    const char *buf;  /* read-only bytes: the records cannot change between check and use */
    Py_ssize_t len;
    if (!PyArg_ParseTuple(args, "y#", &buf, &len)) return NULL;
    const int64_t words = len / 8;
    int64_t bad = 0;
    if (len % 8 || check_records((const int64_t *)buf, words, &bad) < 0) {
        PyErr_Format(PyExc_ValueError, "xor_rows_many: records must be int64 (dest, stride, rows, "
                     "width > 0, m <= 256, m source triples), record at word %lld of %lld is not",
                     (long long)bad, (long long)words);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    xor_records((const int64_t *)buf, words);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"xor_rows_many", xor_rows_many, METH_VARARGS,
     "xor_rows_many(records_int64): xor_rows for each record (dest, dest_stride, rows, width, m, "
     "then m source triples), in one call without the GIL, in blocks of rows across the records "
     "(a record may not read another's destination)"},
    {"xor_rows", xor_rows, METH_VARARGS,
     "xor_rows(dest_address, dest_stride, rows, width, sources_int64_triples): dest row i = XOR "
     "of row i of the sources (address, stride, count) that have more than i rows; bytes"},
    {"fold_rows", fold_rows, METH_VARARGS,
     "fold_rows(parity, width, prow_int64, coef_uint8, delta_int32, mul_256x256): "
     "parity[prow[i]] ^= coef[i] * delta[i] over GF(2^8), rows may repeat"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_parity_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__parity_cpu(void) { return PyModule_Create(&module); }
