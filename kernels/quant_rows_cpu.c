/* CPU kernel of mpickpt's range search for per-row uniform quantization (mpickpt._quant_cpu).
 *
 * The same algorithm as mpickpt/quant/search.py (its docstring is the specification) and as the
 * CUDA kernel in kernels/quant_rows.cu: per row, Check-N-Run's greedy walk over [x_min, x_max]
 * (mode 0), optionally with a least-squares polish of both candidates of each step and `rounds` LS
 * rounds from the best (mode 1). Every candidate's parameters are rounded to float16 before evaluation; a row
 * keeps the lowest loss seen. One pass over the row per candidate accumulates the loss and the sums
 * the polish needs (in double); the walk's two moves share one pass (evaluate2), with the same
 * arithmetic per candidate. The same call can pack each row's codes right after its search, while
 * the row is in cache, and flags rows float16 parameters cannot cover (NaN, inf, |x| > 65504). The
 * call releases the GIL, so Python threads can split the rows. `decode_rows` is the way back:
 * packed codes to o + s*c in one pass, into the caller's buffer (a restore's destination).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* float -> nearest float16 (ties to even) -> float, including subnormals and overflow to inf. */
static inline float round_fp16(float v) {
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

/* One candidate's broadcast parameters and its four lane accumulators. */
typedef struct {
    float s, o, inv, noi;
    v8f vs, vo, vinv, vnoi;
    v8f al, ac, acc, axc;
} Cand;

static inline void cand_init(Cand *c, float s, float o) {
    v8f zero = {0};
    c->s = s;
    c->o = o;
    c->inv = s > 0.0f ? 1.0f / s : 0.0f;
    c->noi = -o * c->inv;
    c->vs = zero + s;
    c->vo = zero + o;
    c->vinv = zero + c->inv;
    c->vnoi = zero + c->noi;
    c->al = c->ac = c->acc = c->axc = zero;
}

/* Nearest codes of eight elements for (inv, noi): clamped to [0, top], rounded to nearest-even.
 * The one vector form of code_of(), shared by the search and the packing. */
static inline __attribute__((always_inline)) v8f codes8(v8f xv, v8f vinv, v8f vnoi, v8f vtop) {
    v8f zero = {0}, magic = zero + MAGIC;
    v8f v = xv * vinv + vnoi;
    v8i pos = v > zero;
    v = (v8f)((v8i)v & pos);
    v8i below = v < vtop;
    v = (v8f)(((v8i)v & below) | ((v8i)vtop & ~below));
    return (v + magic) - magic;
}

/* Eight elements xv (xm = xv - mean) into the candidate's lane accumulators. */
static inline __attribute__((always_inline)) void cand_lanes(Cand *c, v8f xv, v8f xm, v8f vtop) {
    v8f q = codes8(xv, c->vinv, c->vnoi, vtop);
    v8f err = q * c->vs + c->vo - xv;
    c->al += err * err;
    c->ac += q;
    c->acc += q * q;
    c->axc += q * xm;
}

/* The lanes summed in order in double, then the elements past the last full group of eight. */
static inline Eval cand_finish(const Cand *c, const Row *r, int j) {
    /* the four sums side by side in one double vector: lane by lane, the same additions in the
     * same order as four scalar sums */
    Eval e = {0.0, 0.0, 0.0, 0.0};
    for (int k = 0; k < 8; k++) {
        e.loss += c->al[k];
        e.sc += c->ac[k];
        e.scc += c->acc[k];
        e.sxc += c->axc[k];
    }
    for (; j < r->d; j++) {
        float q = code_of(r->x[j], c->inv, c->noi, r->levels);
        float err = q * c->s + c->o - r->x[j];
        e.loss += err * err;
        e.sc += q;
        e.scc += q * q;
        e.sxc += q * (r->x[j] - r->mean);
    }
    return e;
}

/* One pass over the row for the n candidates `c` (n is a constant where this is inlined). */
static inline __attribute__((always_inline)) void pass(const Row *r, Cand *c, int n, Eval *e) {
    v8f zero = {0}, vtop = zero + r->levels, vm = zero + r->mean;
    int j = 0;
    for (; j + 8 <= r->d; j += 8) {
        v8f xv;
        memcpy(&xv, r->x + j, sizeof xv);
        v8f xm = xv - vm;
        for (int i = 0; i < n; i++) cand_lanes(&c[i], xv, xm, vtop);
    }
    for (int i = 0; i < n; i++) e[i] = cand_finish(&c[i], r, j);
}

static inline __attribute__((always_inline)) Eval evaluate(const Row *r, float s, float o) {
    Cand c;
    Eval e;
    cand_init(&c, s, o);
    pass(r, &c, 1, &e);
    return e;
}

/* Two candidates in one pass over the row (the walk's two moves): the same arithmetic per
 * candidate as evaluate(), so the same results, with twice the independent work per load. */
static inline __attribute__((always_inline)) void evaluate2(const Row *r, float s0, float o0,
                                                           float s1, float o1, Eval *e) {
    Cand c[2];
    cand_init(&c[0], s0, o0);
    cand_init(&c[1], s1, o1);
    pass(r, c, 2, e);
}

/* Least-squares (s, o) for the codes behind `e`, rounded to float16, and their loss (closed form). */
static inline double polish(const Row *r, const Eval *e, float *ps, float *po) {
    double d = r->d, inv = 1.0 / d; /* products, not three divisions (exact where d is 2^n) */
    double var = e->scc - e->sc * e->sc * inv, cov = e->sxc - e->sc * r->sx * inv;
    /* in coordinates centred on the row mean: x' = x - mean, o' = o - mean */
    double s = var > 0.0 ? cov / var : 0.0;
    if (s < 0.0) s = 0.0;
    *ps = round_fp16((float)s);
    *po = round_fp16((float)(r->mean + (r->sx - s * e->sc) * inv));
    double S = *ps, O = (double)*po - r->mean;
    double loss = r->sxx - 2 * O * r->sx - 2 * S * e->sxc + d * O * O + 2 * S * O * e->sc
                  + S * S * e->scc;
    return loss > 0.0 ? loss : 0.0;
}

typedef struct {
    double loss;
    float s, o;
} Best;

/* Branch-free (whether a candidate wins is data, not pattern): selects, not jumps. */
static inline void offer(Best *b, double loss, float s, float o) {
    int win = loss < b->loss;
    b->loss = win ? loss : b->loss;
    b->s = win ? s : b->s;
    b->o = win ? o : b->o;
}

#define FP16_MAX 65504.0f

/* Search one row; returns 1 (and sets scale/offset to 0) when the row holds a value float16
 * parameters cannot cover (NaN, inf or |x| > 65504), else 0. Inlined into search_block, so the
 * whole search is compiled once per target of CLONES. */
static inline __attribute__((always_inline)) int search_row(const float *x, int d, int bits,
                                                            int refine, int steps, int bins,
                                                            int rounds, float *scale,
                                                            float *offset) {
    Row r = {x, d, (float)((1 << bits) - 1), 0.0f, 0.0, 0.0};
    float lo = x[0], hi = x[0];
    double sum = 0.0;
    int bad = 0;
    for (int j = 0; j < d; j++) {
        bad |= !(fabsf(x[j]) <= FP16_MAX);
        lo = x[j] < lo ? x[j] : lo;
        hi = x[j] > hi ? x[j] : hi;
        sum += x[j];
    }
    if (bad) {
        *scale = *offset = 0.0f;
        return 1;
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
        float s0 = round_fp16((hi - (lo + step)) / r.levels), o0 = round_fp16(lo + step);
        float s1 = round_fp16(((hi - step) - lo) / r.levels), o1 = round_fp16(lo);
        evaluate2(&r, s0, o0, s1, o1, walk);
        offer(&b, walk[0].loss, s0, o0);
        offer(&b, walk[1].loss, s1, o1);
        int up = walk[0].loss < walk[1].loss;
        if (refine) { /* polish both moves, up first (closed forms, no extra pass) */
            float ps, po;
            double pl = polish(&r, &walk[0], &ps, &po);
            offer(&b, pl, ps, po);
            pl = polish(&r, &walk[1], &ps, &po);
            offer(&b, pl, ps, po);
        }
        lo = up ? lo + step : lo; /* selects: the direction is data, not a pattern */
        hi = up ? hi : hi - step;
    }
    Best measured = start; /* the last candidate whose loss was measured by a pass */
    for (int k = 0; refine && k < rounds; k++) {
        /* a round whose polish did not win left the best as it was: every later round would
         * repeat it exactly */
        if (k > 0 && b.s == measured.s && b.o == measured.o) break;
        Eval e = evaluate(&r, b.s, b.o);
        measured = (Best){e.loss, b.s, b.o};
        float ps, po;
        double pl = polish(&r, &e, &ps, &po);
        offer(&b, pl, ps, po);
    }
    /* A polished candidate's loss is a closed form; measure the winner directly so a rounding
     * error there can never make a row worse than [min, max] (no pass when it was just measured). */
    if (refine && (b.s != start.s || b.o != start.o)) {
        double loss = (b.s == measured.s && b.o == measured.o) ? measured.loss
                                                                : evaluate(&r, b.s, b.o).loss;
        if (loss > start.loss) b = start;
    }
    *scale = b.s;
    *offset = b.o;
    return 0;
}

/* Codes of one row for (s, o), packed little-endian into ceil(d * bits / 8) bytes: the same
 * arithmetic as evaluate() and mpickpt.quant.search.encode_codes. */
CLONES static void encode_row(const float *x, int d, int bits, float s, float o, uint8_t *out) {
    float inv = s > 0.0f ? 1.0f / s : 0.0f;
    float noi = -o * inv, top = (float)((1 << bits) - 1);
    v8f zero = {0}, vinv = zero + inv, vnoi = zero + noi, vtop = zero + top;
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
    v8i shifts = {0, bits, 2 * bits, 3 * bits, 4 * bits, 5 * bits, 6 * bits, 7 * bits};
#endif
    int j = 0;
    for (; j + 8 <= d; j += 8, out += bits) { /* eight codes fill exactly `bits` bytes */
        v8f xv;
        memcpy(&xv, x + j, sizeof xv);
        v8i c = __builtin_convertvector(codes8(xv, vinv, vnoi, vtop), v8i);
        uint64_t w = 0;
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
        if (bits <= 4) { /* 8 codes fit 32 bits: shift each lane into place, OR across lanes */
            v8i t = c << shifts;
            t |= __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3);
            t |= __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5);
            t |= __builtin_shufflevector(t, t, 1, 0, 3, 2, 5, 4, 7, 6);
            w = (uint32_t)t[0];
        } else
#endif
            for (int k = 0; k < 8; k++) w |= (uint64_t)c[k] << (k * bits);
        for (int b = 0; b < bits; b++) out[b] = (uint8_t)(w >> (8 * b));
    }
    uint64_t acc = 0;
    int held = 0;
    for (; j < d; j++) {
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

/* Search rows [0, n) and, where `codes` is given, pack each row's codes right after its search
 * (the row is still in cache). Returns the first row float16 parameters cannot cover, or -1; its
 * scale and offset are set to 0 and the other rows are still done. */
CLONES static Py_ssize_t search_block(const float *x, Py_ssize_t n, int d, int bits, int refine,
                                     int steps, int bins, int rounds, float *scale, float *offset,
                                     uint8_t *codes) {
    Py_ssize_t first_bad = -1, row_bytes = ((Py_ssize_t)d * bits + 7) / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (search_row(x + i * d, d, bits, refine, steps, bins, rounds, scale + i, offset + i)
            && first_bad < 0)
            first_bad = i;
        if (codes) encode_row(x + i * d, d, bits, scale[i], offset[i], codes + i * row_bytes);
    }
    return first_bad;
}

/* search_rows(x: float32 buffer (n*d), n, d, bits, refine, steps, bins, rounds,
 *             scale_out: float32 buffer (n), offset_out: float32 buffer (n)[, codes_out: uint8
 *             buffer (n * ceil(d*bits/8))]) -> first row out of float16's range, or -1 */
static PyObject *search_rows(PyObject *self, PyObject *args) {
    Py_buffer xb, sb, ob, cb = {0};
    Py_ssize_t n;
    int d, bits, refine, steps, bins, rounds;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*niiiiiiw*w*|w*", &xb, &n, &d, &bits, &refine, &steps, &bins,
                          &rounds, &sb, &ob, &cb))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t row_bytes = ((Py_ssize_t)d * bits + 7) / 8;
    if (xb.len < (Py_ssize_t)(n * d * sizeof(float)) || sb.len < (Py_ssize_t)(n * sizeof(float))
        || ob.len < (Py_ssize_t)(n * sizeof(float)) || d < 1 || bins < 1 || bits < 1 || bits > 8
        || (cb.buf && cb.len < n * row_bytes)) {
        PyErr_SetString(PyExc_ValueError, "search_rows: buffer sizes do not match n, d and bits");
    } else {
        const float *x = (const float *)xb.buf;
        float *scale = (float *)sb.buf, *offset = (float *)ob.buf;
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = search_block(x, n, d, bits, refine, steps, bins, rounds, scale, offset,
                           (uint8_t *)cb.buf);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&xb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ob);
    if (cb.buf) PyBuffer_Release(&cb);
    return result;
}

/* Rows o + s*c of one row's packed codes (code j at bit j*bits of the row's little-endian
 * bytes, as encode_row packs them): the product rounded to float, then the sum, as
 * mpickpt.quant.search.decode_codes computes them in numpy (ISO C: no FMA contraction). */
CLONES static void decode_row(const uint8_t *in, int d, int bits, float s, float o, float *out) {
    const uint64_t mask = (1u << bits) - 1u;
    int row_bytes = (d * bits + 7) / 8, j = 0, at = 0;
    for (; j < d; j += 8, at += bits) { /* eight codes fill exactly `bits` bytes */
        int nb = row_bytes - at < bits ? row_bytes - at : bits, take = d - j < 8 ? d - j : 8;
        uint64_t w = 0;
        for (int b = 0; b < nb; b++) w |= (uint64_t)in[at + b] << (8 * b);
        for (int k = 0; k < take; k++) out[j + k] = (float)((w >> (k * bits)) & mask) * s + o;
    }
}

/* encode_rows(x: float32 buffer (n*d), n, d, bits, scale: float32 (n), offset: float32 (n),
 *             out: uint8 buffer (n * ceil(d*bits/8)))
 * decode_rows(codes: uint8 buffer (n * ceil(d*bits/8)), n, d, bits, scale, offset,
 *             out: float32 buffer (n*d)) */
static PyObject *convert_rows(PyObject *args, int decode) {
    Py_buffer ib, sb, ob, xb;
    Py_ssize_t n;
    int d, bits;
    if (!PyArg_ParseTuple(args, "y*niiy*y*w*", &ib, &n, &d, &bits, &sb, &ob, &xb)) return NULL;
    Py_ssize_t row_bytes = ((Py_ssize_t)d * bits + 7) / 8;
    Py_ssize_t floats = n * d * (Py_ssize_t)sizeof(float), codes = n * row_bytes;
    PyObject *result = NULL;
    if (d < 1 || bits < 1 || bits > 8 || n < 0 || ib.len < (decode ? codes : floats)
        || sb.len < (Py_ssize_t)(n * sizeof(float)) || ob.len < (Py_ssize_t)(n * sizeof(float))
        || xb.len < (decode ? floats : codes)) {
        PyErr_Format(PyExc_ValueError, "%s: buffer sizes do not match n, d and bits",
                     decode ? "decode_rows" : "encode_rows");
    } else {
        const float *scale = (const float *)sb.buf, *offset = (const float *)ob.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            if (decode)
                decode_row((const uint8_t *)ib.buf + i * row_bytes, d, bits, scale[i],
                           offset[i], (float *)xb.buf + i * d);
            else
                encode_row((const float *)ib.buf + i * d, d, bits, scale[i], offset[i],
                           (uint8_t *)xb.buf + i * row_bytes);
        }
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&ib);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&xb);
    return result;
}

static PyObject *encode_rows(PyObject *self, PyObject *args) {
    (void)self;
    return convert_rows(args, 0);
}

static PyObject *decode_rows(PyObject *self, PyObject *args) {
    (void)self;
    return convert_rows(args, 1);
}

static PyMethodDef methods[] = {
    {"encode_rows", encode_rows, METH_VARARGS,
     "Nearest codes of every row for float32 scale/offset, packed little-endian per row."},
    {"decode_rows", decode_rows, METH_VARARGS,
     "Rows offset + scale * code of packed codes, into a float32 buffer (no FMA: numpy's values)."},
    {"search_rows", search_rows, METH_VARARGS,
     "Per-row float16 scale and offset by the greedy walk (refine=0) or the refined search, and "
     "optionally the packed codes; returns the first row out of float16's range, or -1."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_quant_cpu",
                                    "CPU kernels of mpickpt's quantization: range search, encode, decode.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__quant_cpu(void) { return PyModule_Create(&module); }
