/* CPU kernel of mpickpt's range search for per-row uniform quantization (mpickpt._quant_cpu).
 *
 * The same algorithm as mpickpt/quant/search.py (its docstring is the specification) and as the
 * CUDA kernel in kernels/quant_rows.cu: per row, Check-N-Run's greedy walk over [x_min, x_max]
 * (mode 0), optionally with a least-squares polish of the candidate each step takes and `rounds` LS
 * rounds from the best (mode 1). Every candidate's parameters are rounded to float16 before evaluation; a row
 * keeps the lowest loss seen. One pass over the row per candidate accumulates the loss and the sums
 * the polish needs (in double). The call releases the GIL, so Python threads can split the rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* float -> nearest float16 (ties to even) -> float, including subnormals and overflow to inf. */
static float round_fp16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint32_t sign = u & 0x80000000u, a = u & 0x7fffffffu;
    float out;
    if (a >= 0x7f800000u) return v;                 /* inf, nan */
    if (a >= 0x477ff000u) {                         /* rounds to >= 65520: inf */
        uint32_t r = sign | 0x7f800000u;
        memcpy(&out, &r, 4);
        return out;
    }
    if (a < 0x38800000u) {                          /* below 2^-14: subnormal grid 2^-24 */
        float f;
        memcpy(&f, &a, 4);
        float q = nearbyintf(f * 16777216.0f) / 16777216.0f;
        return sign ? -q : q;
    }
    uint32_t lsb = (a >> 13) & 1u;                  /* keep 10 mantissa bits, ties to even */
    a = (a + 0x0fffu + lsb) & ~0x1fffu;
    a |= sign;
    memcpy(&out, &a, 4);
    return out;
}

typedef struct {
    double loss, sc, scc, sxc; /* sxc: sum of c * (x - mean), so the polish does not cancel */
} Eval;

typedef struct {
    const float *x;
    int d;
    float levels;
    float mean;
    double sx, sxx; /* of x - mean */
} Row;

/* Loss of (s, o) and the code sums, in one pass, eight lanes at a time with GCC/Clang vector
 * extensions (no reassociated sums; ISO C: no contraction into FMAs, so every build agrees).
 * Codes are clamped first, then rounded to nearest-even by adding and subtracting 1.5 * 2^23.
 * On x86-64 an AVX2 clone is chosen at run time where the CPU has it. */
typedef float v8f __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));
static const float MAGIC = 12582912.0f;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__INTEL_COMPILER)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

static inline float code_of(float xv, float inv, float noi, float top) {
    float v = xv * inv + noi;
    v = v > 0.0f ? v : 0.0f;
    v = v < top ? v : top;
    return (v + MAGIC) - MAGIC;
}

CLONES static Eval evaluate(const Row *r, float s, float o) {
    float inv = s > 0.0f ? 1.0f / s : 0.0f;
    float noi = -o * inv, top = r->levels;
    v8f vinv = {0}, vnoi = {0}, vtop = {0}, vs = {0}, vo = {0}, zero = {0}, magic = {0}, vm = {0};
    vinv += inv; vnoi += noi; vtop += top; vs += s; vo += o; magic += MAGIC; vm += r->mean;
    v8f al = zero, ac = zero, acc = zero, axc = zero;
    const float *x = r->x;
    int j = 0;
    for (; j + 8 <= r->d; j += 8) {
        v8f xv;
        memcpy(&xv, x + j, sizeof xv);
        v8f v = xv * vinv + vnoi;
        v8i pos = v > zero;
        v = (v8f)((v8i)v & pos);
        v8i below = v < vtop;
        v = (v8f)(((v8i)v & below) | ((v8i)vtop & ~below));
        v8f c = (v + magic) - magic;
        v8f err = c * vs + vo - xv;
        al += err * err;
        ac += c;
        acc += c * c;
        axc += c * (xv - vm);
    }
    Eval e = {0.0, 0.0, 0.0, 0.0};
    for (int k = 0; k < 8; k++) {
        e.loss += al[k];
        e.sc += ac[k];
        e.scc += acc[k];
        e.sxc += axc[k];
    }
    for (; j < r->d; j++) {
        float c = code_of(x[j], inv, noi, top);
        float err = c * s + o - x[j];
        e.loss += err * err;
        e.sc += c;
        e.scc += c * c;
        e.sxc += c * (x[j] - r->mean);
    }
    return e;
}

/* Least-squares (s, o) for the codes behind `e`, rounded to float16, and their loss (closed form). */
static double polish(const Row *r, const Eval *e, float *ps, float *po) {
    double d = r->d;
    double var = e->scc - e->sc * e->sc / d, cov = e->sxc - e->sc * r->sx / d;
    /* in coordinates centred on the row mean: x' = x - mean, o' = o - mean */
    double s = var > 0.0 ? cov / var : 0.0;
    if (s < 0.0) s = 0.0;
    *ps = round_fp16((float)s);
    *po = round_fp16((float)(r->mean + (r->sx - s * e->sc) / d));
    double S = *ps, O = (double)*po - r->mean;
    double loss = r->sxx - 2 * O * r->sx - 2 * S * e->sxc + d * O * O + 2 * S * O * e->sc
                  + S * S * e->scc;
    return loss > 0.0 ? loss : 0.0;
}

typedef struct {
    double loss;
    float s, o;
} Best;

static void offer(Best *b, double loss, float s, float o) {
    if (loss < b->loss) {
        b->loss = loss;
        b->s = s;
        b->o = o;
    }
}

static void search_row(const float *x, int d, int bits, int refine, int steps, int bins,
                       int rounds, float *scale, float *offset) {
    Row r = {x, d, (float)((1 << bits) - 1), 0.0f, 0.0, 0.0};
    float lo = x[0], hi = x[0];
    double sum = 0.0;
    for (int j = 0; j < d; j++) {
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
        sum += x[j];
    }
    r.mean = (float)(sum / d);
    for (int j = 0; j < d; j++) {
        double xc = (double)x[j] - r.mean;
        r.sx += xc;
        r.sxx += xc * xc;
    }
    float step = (hi - lo) / (float)bins;
    Best b;
    b.s = round_fp16((hi - lo) / r.levels);
    b.o = round_fp16(lo);
    b.loss = evaluate(&r, b.s, b.o).loss;
    Best start = b;
    for (int k = 0; k < steps; k++) {
        Eval walk[2];
        for (int side = 0; side < 2; side++) {
            float nlo = side == 0 ? lo + step : lo, nhi = side == 0 ? hi : hi - step;
            float s = round_fp16((nhi - nlo) / r.levels), o = round_fp16(nlo);
            walk[side] = evaluate(&r, s, o);
            offer(&b, walk[side].loss, s, o);
        }
        int up = walk[0].loss < walk[1].loss;
        if (refine) { /* polish the candidate the walk takes */
            float ps, po;
            double pl = polish(&r, &walk[up ? 0 : 1], &ps, &po);
            offer(&b, pl, ps, po);
        }
        if (up) lo += step;
        else hi -= step;
    }
    for (int k = 0; refine && k < rounds; k++) {
        Eval e = evaluate(&r, b.s, b.o);
        float ps, po;
        double pl = polish(&r, &e, &ps, &po);
        offer(&b, pl, ps, po);
    }
    /* A polished candidate's loss is a closed form; measure the winner directly so a rounding
     * error there can never make a row worse than [min, max]. */
    if (refine && (b.s != start.s || b.o != start.o) && evaluate(&r, b.s, b.o).loss > start.loss)
        b = start;
    *scale = b.s;
    *offset = b.o;
}

/* search_rows(x: float32 buffer (n*d), n, d, bits, refine, steps, bins, rounds,
 *             scale_out: float32 buffer (n), offset_out: float32 buffer (n)) */
static PyObject *search_rows(PyObject *self, PyObject *args) {
    Py_buffer xb, sb, ob;
    Py_ssize_t n;
    int d, bits, refine, steps, bins, rounds;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*niiiiiiw*w*", &xb, &n, &d, &bits, &refine, &steps, &bins,
                          &rounds, &sb, &ob))
        return NULL;
    PyObject *result = NULL;
    if (xb.len < (Py_ssize_t)(n * d * sizeof(float)) || sb.len < (Py_ssize_t)(n * sizeof(float))
        || ob.len < (Py_ssize_t)(n * sizeof(float)) || d < 1 || bins < 1) {
        PyErr_SetString(PyExc_ValueError, "search_rows: buffer sizes do not match n and d");
    } else {
        const float *x = (const float *)xb.buf;
        float *scale = (float *)sb.buf, *offset = (float *)ob.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            search_row(x + i * d, d, bits, refine, steps, bins, rounds, scale + i, offset + i);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&xb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ob);
    return result;
}

/* Codes of one row for (s, o), packed little-endian into ceil(d * bits / 8) bytes: the same
 * arithmetic as evaluate() and mpickpt.quant.search.encode_codes. */
static void encode_row(const float *x, int d, int bits, float s, float o, uint8_t *out) {
    float inv = s > 0.0f ? 1.0f / s : 0.0f;
    float noi = -o * inv, top = (float)((1 << bits) - 1);
    uint64_t acc = 0;
    int held = 0;
    for (int j = 0; j < d; j++) {
        acc |= (uint64_t)code_of(x[j], inv, noi, top) << held;
        held += bits;
        while (held >= 8) {
            *out++ = (uint8_t)(acc & 0xffu);
            acc >>= 8;
            held -= 8;
        }
    }
    if (held > 0) *out = (uint8_t)(acc & 0xffu);
}

/* encode_rows(x: float32 buffer (n*d), n, d, bits, scale: float32 (n), offset: float32 (n),
 *             out: uint8 buffer (n * ceil(d*bits/8))) */
static PyObject *encode_rows(PyObject *self, PyObject *args) {
    Py_buffer xb, sb, ob, cb;
    Py_ssize_t n;
    int d, bits;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*niiy*y*w*", &xb, &n, &d, &bits, &sb, &ob, &cb)) return NULL;
    Py_ssize_t row_bytes = ((Py_ssize_t)d * bits + 7) / 8;
    PyObject *result = NULL;
    if (d < 1 || bits < 1 || bits > 8 || xb.len < (Py_ssize_t)(n * d * sizeof(float))
        || sb.len < (Py_ssize_t)(n * sizeof(float)) || ob.len < (Py_ssize_t)(n * sizeof(float))
        || cb.len < n * row_bytes) {
        PyErr_SetString(PyExc_ValueError, "encode_rows: buffer sizes do not match n, d and bits");
    } else {
        const float *x = (const float *)xb.buf, *scale = (const float *)sb.buf,
                    *offset = (const float *)ob.buf;
        uint8_t *codes = (uint8_t *)cb.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            encode_row(x + i * d, d, bits, scale[i], offset[i], codes + i * row_bytes);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&xb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&cb);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_rows", encode_rows, METH_VARARGS,
     "Nearest codes of every row for float32 scale/offset, packed little-endian per row."},
    {"search_rows", search_rows, METH_VARARGS,
     "Per-row float16 scale and offset by the greedy walk (refine=0) or the refined search."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_quant_cpu",
                                    "CPU kernel of mpickpt's quantization range search.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__quant_cpu(void) { return PyModule_Create(&module); }
