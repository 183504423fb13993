/* Row gathers and scatters for the checkpoint writers, IncrCP's extractor and the restore of
 * incremental chains (mpickpt._rows_cpu): gather sets out[i] = src[index[i]], scatter sets
 * out[index[i]] = src[i] (the last of repeated indices wins, as in numpy), for C-contiguous
 * arrays whose rows are row_bytes bytes each, one memcpy per row.
 * numpy's fancy indexing walks every element of a row through its generic inner loop, which costs
 * 10-35x a memcpy of the same bytes for rows of 16 floats; this is a memcpy per row. Every index is
 * checked against the picked array's row count (IndexError naming the first bad one and its
 * position): a scatter checks them all before it writes anything. The GIL is released while it
 * copies, so each index is read once, checked and used as read: an index array that another
 * thread changes meanwhile can stop the copy but never make it reach outside the arrays. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define AHEAD 8 /* rows prefetched ahead of the copy */

/* Copies rows until an index outside [0, rows) and returns its position, or -1 when all were
 * copied. Inlined into `gather_rows` once per row size it names, so that rows of 4 and 8 bytes
 * (optimizer state, keys) are copied by one load and store each, not a call to memcpy. */
static inline __attribute__((always_inline)) Py_ssize_t gather_sized(
        char *out, const char *src, const int64_t *index, Py_ssize_t n, int64_t rows,
        size_t row_bytes) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t at = index[i];
        if ((uint64_t)at >= (uint64_t)rows) return i;
        if (i + AHEAD < n) __builtin_prefetch(src + (size_t)index[i + AHEAD] * row_bytes);
        memcpy(out + (size_t)i * row_bytes, src + (size_t)at * row_bytes, row_bytes);
    }
    return -1;
}

static Py_ssize_t gather_rows(char *out, const char *src, const int64_t *index, Py_ssize_t n,
                              int64_t rows, size_t row_bytes) {
    switch (row_bytes) {
    case 4: return gather_sized(out, src, index, n, rows, 4);
    case 8: return gather_sized(out, src, index, n, rows, 8);
    default: return gather_sized(out, src, index, n, rows, row_bytes);
    }
}

static inline __attribute__((always_inline)) Py_ssize_t scatter_sized(
        char *out, const char *src, const int64_t *index, Py_ssize_t n, int64_t rows,
        size_t row_bytes) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t at = index[i];
        if ((uint64_t)at >= (uint64_t)rows) return i;
        if (i + AHEAD < n) __builtin_prefetch(out + (size_t)index[i + AHEAD] * row_bytes, 1);
        memcpy(out + (size_t)at * row_bytes, src + (size_t)i * row_bytes, row_bytes);
    }
    return -1;
}

static Py_ssize_t scatter_rows(char *out, const char *src, const int64_t *index, Py_ssize_t n,
                               int64_t rows, size_t row_bytes) {
    switch (row_bytes) {
    case 4: return scatter_sized(out, src, index, n, rows, 4);
    case 8: return scatter_sized(out, src, index, n, rows, 8);
    default: return scatter_sized(out, src, index, n, rows, row_bytes);
    }
}

/* The position of the first index outside [0, rows), or -1. */
static Py_ssize_t first_bad(const int64_t *index, Py_ssize_t n, int64_t rows) {
    for (Py_ssize_t i = 0; i < n; i++)
        if ((uint64_t)index[i] >= (uint64_t)rows) return i;
    return -1;
}

/* gather (scatter = 0) or scatter: `index` picks rows of `src` (gather) or of `out` (scatter);
 * the other side has one row per index. */
static PyObject *run(PyObject *args, const char *name, int scatter) {
    Py_buffer sb, ib, ob;
    Py_ssize_t row_bytes;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &sb, &ib, &ob, &row_bytes)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = ib.len / 8;
    const Py_ssize_t dense = scatter ? sb.len : ob.len, picked = scatter ? ob.len : sb.len;
    if (row_bytes <= 0 || row_bytes > PY_SSIZE_T_MAX / (n > 0 ? n : 1) || picked % row_bytes ||
        ib.len % 8 || dense != n * row_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "%s: inconsistent buffers (source %zd bytes, index %zd bytes, out %zd "
                     "bytes, rows of %zd bytes; expected whole rows, 8-byte indices and one "
                     "%s row per index)", name, sb.len, ib.len, ob.len, row_bytes,
                     scatter ? "source" : "out");
    } else {
        const int64_t rows = (int64_t)(picked / row_bytes);
        const int64_t *index = (const int64_t *)ib.buf;
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        if (scatter) {
            bad = first_bad(index, n, rows);
            if (bad < 0)
                bad = scatter_rows((char *)ob.buf, (const char *)sb.buf, index, n, rows,
                                   (size_t)row_bytes);
        } else {
            bad = gather_rows((char *)ob.buf, (const char *)sb.buf, index, n, rows,
                              (size_t)row_bytes);
        }
        Py_END_ALLOW_THREADS
        if (bad >= 0) {
            PyErr_Format(PyExc_IndexError, "%s: row index %lld at position %zd is outside the "
                         "%s's %lld rows", name, (long long)index[bad], bad,
                         scatter ? "destination" : "source", (long long)rows);
        } else {
            result = Py_None;
            Py_INCREF(result);
        }
    }
    PyBuffer_Release(&sb); PyBuffer_Release(&ib); PyBuffer_Release(&ob);
    return result;
}

static PyObject *gather(PyObject *self, PyObject *args) { return run(args, "gather", 0); }

static PyObject *scatter(PyObject *self, PyObject *args) { return run(args, "scatter", 1); }

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(source, index_int64, out (written), row_bytes): out row i = source row index[i]"},
    {"scatter", scatter, METH_VARARGS,
     "scatter(source, index_int64, out (written), row_bytes): out row index[i] = source row i"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rows_cpu(void) { return PyModule_Create(&module); }
