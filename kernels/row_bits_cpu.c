/* The rows of a bit-vector's set bits (mpickpt._row_bits_cpu): bit b of 64-bit word i is local
 * row 64 i + b (`mpickpt/track/bitvector.py`). A checkpoint of an incremental kind reads them
 * on the training thread, in its stall: torch's CPU path expands every non-zero word into 64
 * lanes (a 100+ MB temporary for 300k rows spread over 17M), where this walks the words once
 * and each set bit once (count trailing zeros, clear the lowest bit). `count` sizes the output,
 * `rows` fills it in ascending order; the words are never written (the caller clears them once
 * the rows are out). The GIL is released while either runs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int words_of(Py_buffer *wb, const char *name) {
    if (wb->len % 8) {
        PyErr_Format(PyExc_ValueError, "%s: the words are %zd bytes, not whole 64-bit words",
                     name, wb->len);
        return 0;
    }
    return 1;
}

static PyObject *count(PyObject *self, PyObject *args) {
    Py_buffer wb;
    if (!PyArg_ParseTuple(args, "y*", &wb)) return NULL;
    if (!words_of(&wb, "count")) { PyBuffer_Release(&wb); return NULL; }
    const uint64_t *w = (const uint64_t *)wb.buf;
    const Py_ssize_t n = wb.len / 8;
    long long total = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) total += __builtin_popcountll(w[i]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&wb);
    return PyLong_FromLongLong(total);
}

static PyObject *rows(PyObject *self, PyObject *args) {
    Py_buffer wb, ob;
    if (!PyArg_ParseTuple(args, "y*w*", &wb, &ob)) return NULL;
    PyObject *result = NULL;
    if (!words_of(&wb, "rows")) goto out;
    if (ob.len % 8) {
        PyErr_Format(PyExc_ValueError, "rows: out is %zd bytes, not whole int64 rows", ob.len);
        goto out;
    }
    const uint64_t *w = (const uint64_t *)wb.buf;
    int64_t *dst = (int64_t *)ob.buf;
    const Py_ssize_t n = wb.len / 8, cap = ob.len / 8;
    Py_ssize_t k = 0;
    int over = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !over; i++) {
        uint64_t x = w[i];
        while (x) {
            if (k == cap) { over = 1; break; }
            dst[k++] = (int64_t)i * 64 + __builtin_ctzll(x);
            x &= x - 1;
        }
    }
    Py_END_ALLOW_THREADS
    if (over)
        PyErr_Format(PyExc_ValueError, "rows: more set bits than out's %zd rows (the words "
                     "changed since they were counted?)", cap);
    else
        result = PyLong_FromSsize_t(k);
out:
    PyBuffer_Release(&wb); PyBuffer_Release(&ob);
    return result;
}

static PyMethodDef methods[] = {
    {"count", count, METH_VARARGS, "count(words): the number of set bits"},
    {"rows", rows, METH_VARARGS,
     "rows(words, out_int64 (written)): the positions of the set bits, ascending, into out; "
     "returns how many (ValueError when out is too short)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_row_bits_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__row_bits_cpu(void) { return PyModule_Create(&module); }
