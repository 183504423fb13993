/* CPU fold of parity deltas (mpickpt._parity_cpu): parity[prow[i]] ^= coef[i] * delta[i] over
 * GF(2^8), bytewise, for n rows of W int32 words. Rows may repeat (deltas of several sources for
 * one stripe): the loop is sequential, so every delta lands. coef 1 is a plain XOR (r = 1, and
 * row 0 of the Cauchy matrix); coef 0 adds nothing. The GIL is released while it runs. */
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

static PyMethodDef methods[] = {
    {"fold_rows", fold_rows, METH_VARARGS,
     "fold_rows(parity, width, prow_int64, coef_uint8, delta_int32, mul_256x256): "
     "parity[prow[i]] ^= coef[i] * delta[i] over GF(2^8), rows may repeat"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_parity_cpu", NULL, -1, methods};

PyMODINIT_FUNC PyInit__parity_cpu(void) { return PyModule_Create(&module); }
