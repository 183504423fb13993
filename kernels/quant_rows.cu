// Per-row range search of the uniform quantization codecs: the CUDA twin of
// kernels/quant_rows_cpu.c (mpickpt._quant_cpu), same algorithm and, by construction, the same
// float16 (scale, offset) for every row. mpickpt/quant/search.py's docstring is the specification.
//
// Per row: Check-N-Run's greedy walk over [x_min, x_max] with step (max - min) / bins for `steps`
// steps, evaluating both candidates (lo + step, hi) and (lo, hi - step) at each step; with
// `refine`, a least-squares polish of both candidates and `rounds` LS rounds from the
// best. Every candidate is rounded to float16 before it is evaluated; a row keeps the lowest loss.
//
// Bit-for-bit parity with the CPU kernel:
// - GROUP = 8 threads per row; thread t of the group owns lane t of the CPU kernel's 8-lane
//   accumulators (elements j = t, t + 8, ... below floor(d / 8) * 8, summed in that order in
//   float), the lanes are summed into double in lane order, then the tail elements one by one in
//   double, exactly as the CPU kernel does. Every thread of a group ends with the same values and
//   takes the same branches.
// - No FMA contraction: every product feeding a sum is an explicit __fmul_rn/__dmul_rn followed by
//   __fadd_rn/__dadd_rn (the CPU kernel is ISO C, which does not contract), divisions are the
//   correctly rounded __fdiv_rn/__ddiv_rn, and codes are rounded half to even (rintf).
// - float16 rounding is cvt.rn.f16.f32 (what __float2half_rn compiles to: nearest, ties to even,
//   subnormals kept, overflow to inf), written as inline PTX so NVRTC needs no cuda_fp16.h.
//
// Loaded with cupy.RawModule by mpickpt/quant/cuda_kernels.py; launch with blockDim.x a multiple
// of 32 and n * GROUP threads in all.

#define GROUP 8  // threads per row; divides LANES
#define LANES 8  // the CPU kernel's vector width

struct Eval {
    double loss, sc, scc, sxc;  // sxc: sum of c * (x - mean)
};

struct Row {
    const float* x;
    int d;
    float levels;
    float mean;
    double sx, sxx;  // of x - mean
};

struct Best {
    double loss;
    float s, o;
};

// float -> nearest float16 (ties to even) -> float.
__device__ __forceinline__ float round_fp16(float v) {
    unsigned short h;
    float out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(h));
    return out;
}

__device__ __forceinline__ float code_of(float xv, float inv, float noi, float top) {
    float v = __fadd_rn(__fmul_rn(xv, inv), noi);
    v = v > 0.0f ? v : 0.0f;
    v = v < top ? v : top;
    return rintf(v);
}

// Lane k of the CPU kernel's accumulators: slot k / G of thread k % G of the group.
template <int G>
__device__ __forceinline__ float lane_value(const float* acc, int k, unsigned mask) {
    if (G == 1) return acc[k];
    return __shfl_sync(mask, acc[k / G], k % G, G);
}

// Loss of (s, o) and the code sums, in one pass (the CPU kernel's evaluate()).
template <int G>
__device__ Eval evaluate(const Row& r, float s, float o, int t, unsigned mask) {
    constexpr int SLOTS = LANES / G;
    float inv = s > 0.0f ? __fdiv_rn(1.0f, s) : 0.0f;
    float noi = __fmul_rn(-o, inv), top = r.levels;
    float al[SLOTS], ac[SLOTS], acc[SLOTS], axc[SLOTS];
#pragma unroll
    for (int q = 0; q < SLOTS; q++) {
        al[q] = 0.0f;
        ac[q] = 0.0f;
        acc[q] = 0.0f;
        axc[q] = 0.0f;
    }
    const float* x = r.x;
    int j = 0;
    for (; j + LANES <= r.d; j += LANES) {
#pragma unroll
        for (int q = 0; q < SLOTS; q++) {
            float xv = x[j + t + q * G];
            float c = code_of(xv, inv, noi, top);
            float err = __fsub_rn(__fadd_rn(__fmul_rn(c, s), o), xv);
            al[q] = __fadd_rn(al[q], __fmul_rn(err, err));
            ac[q] = __fadd_rn(ac[q], c);
            acc[q] = __fadd_rn(acc[q], __fmul_rn(c, c));
            axc[q] = __fadd_rn(axc[q], __fmul_rn(c, __fsub_rn(xv, r.mean)));
        }
    }
    Eval e = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
    for (int k = 0; k < LANES; k++) {
        e.loss = __dadd_rn(e.loss, (double)lane_value<G>(al, k, mask));
        e.sc = __dadd_rn(e.sc, (double)lane_value<G>(ac, k, mask));
        e.scc = __dadd_rn(e.scc, (double)lane_value<G>(acc, k, mask));
        e.sxc = __dadd_rn(e.sxc, (double)lane_value<G>(axc, k, mask));
    }
    for (; j < r.d; j++) {  // tail: every thread of the group, in the same order
        float xv = x[j];
        float c = code_of(xv, inv, noi, top);
        float err = __fsub_rn(__fadd_rn(__fmul_rn(c, s), o), xv);
        e.loss = __dadd_rn(e.loss, (double)__fmul_rn(err, err));
        e.sc = __dadd_rn(e.sc, (double)c);
        e.scc = __dadd_rn(e.scc, (double)__fmul_rn(c, c));
        e.sxc = __dadd_rn(e.sxc, (double)__fmul_rn(c, __fsub_rn(xv, r.mean)));
    }
    return e;
}

// Least-squares (s, o) for the codes behind `e`, rounded to float16, and their loss (closed form),
// in the CPU kernel's order of operations.
__device__ double polish(const Row& r, const Eval& e, float* ps, float* po) {
    double d = (double)r.d, mean = (double)r.mean, inv = __ddiv_rn(1.0, d);
    double var = __dsub_rn(e.scc, __dmul_rn(__dmul_rn(e.sc, e.sc), inv));
    double cov = __dsub_rn(e.sxc, __dmul_rn(__dmul_rn(e.sc, r.sx), inv));
    // in coordinates centred on the row mean: x' = x - mean, o' = o - mean
    double s = var > 0.0 ? __ddiv_rn(cov, var) : 0.0;
    if (s < 0.0) s = 0.0;
    *ps = round_fp16(__double2float_rn(s));
    *po = round_fp16(
        __double2float_rn(__dadd_rn(mean, __dmul_rn(__dsub_rn(r.sx, __dmul_rn(s, e.sc)), inv))));
    double S = (double)*ps, O = __dsub_rn((double)*po, mean);
    double loss = r.sxx;
    loss = __dsub_rn(loss, __dmul_rn(__dmul_rn(2.0, O), r.sx));
    loss = __dsub_rn(loss, __dmul_rn(__dmul_rn(2.0, S), e.sxc));
    loss = __dadd_rn(loss, __dmul_rn(__dmul_rn(d, O), O));
    loss = __dadd_rn(loss, __dmul_rn(__dmul_rn(__dmul_rn(2.0, S), O), e.sc));
    loss = __dadd_rn(loss, __dmul_rn(__dmul_rn(S, S), e.scc));
    return loss > 0.0 ? loss : 0.0;
}

__device__ __forceinline__ void offer(Best* b, double loss, float s, float o) {
    if (loss < b->loss) {
        b->loss = loss;
        b->s = s;
        b->o = o;
    }
}

// One row by the G threads of a group (t: 0..G-1; mask: the group's lanes of the warp).
template <int G>
__device__ void search_row(const float* x, int d, int bits, int refine, int steps, int bins,
                           int rounds, int t, unsigned mask, float* scale, float* offset) {
    Row r;
    r.x = x;
    r.d = d;
    r.levels = (float)((1 << bits) - 1);
    r.sx = 0.0;
    r.sxx = 0.0;
    float lo = x[0], hi = x[0];
    double sum = 0.0;
    for (int j = 0; j < d; j++) {  // sequential double sums, as on the CPU (every thread)
        float xv = x[j];
        lo = xv < lo ? xv : lo;
        hi = xv > hi ? xv : hi;
        sum = __dadd_rn(sum, (double)xv);
    }
    r.mean = __double2float_rn(__ddiv_rn(sum, (double)d));
    for (int j = 0; j < d; j++) {
        double xc = __dsub_rn((double)x[j], (double)r.mean);
        r.sx = __dadd_rn(r.sx, xc);
        r.sxx = __dadd_rn(r.sxx, __dmul_rn(xc, xc));
    }
    float step = __fdiv_rn(__fsub_rn(hi, lo), (float)bins);
    Best b;
    b.s = round_fp16(__fdiv_rn(__fsub_rn(hi, lo), r.levels));
    b.o = round_fp16(lo);
    b.loss = evaluate<G>(r, b.s, b.o, t, mask).loss;
    Best start = b;
    for (int k = 0; k < steps; k++) {
        float s0 = round_fp16(__fdiv_rn(__fsub_rn(hi, __fadd_rn(lo, step)), r.levels));
        float o0 = round_fp16(__fadd_rn(lo, step));
        Eval up_e = evaluate<G>(r, s0, o0, t, mask);
        offer(&b, up_e.loss, s0, o0);
        float s1 = round_fp16(__fdiv_rn(__fsub_rn(__fsub_rn(hi, step), lo), r.levels));
        float o1 = round_fp16(lo);
        Eval down_e = evaluate<G>(r, s1, o1, t, mask);
        offer(&b, down_e.loss, s1, o1);
        bool up = up_e.loss < down_e.loss;
        if (refine) {  // polish both moves, up first
            float ps, po;
            double pl = polish(r, up_e, &ps, &po);
            offer(&b, pl, ps, po);
            pl = polish(r, down_e, &ps, &po);
            offer(&b, pl, ps, po);
        }
        if (up) lo = __fadd_rn(lo, step);
        else hi = __fsub_rn(hi, step);
    }
    for (int k = 0; refine && k < rounds; k++) {
        Eval e = evaluate<G>(r, b.s, b.o, t, mask);
        float ps, po;
        double pl = polish(r, e, &ps, &po);
        offer(&b, pl, ps, po);
    }
    // A polished candidate's loss is a closed form; measure the winner directly so a rounding
    // error there can never make a row worse than [min, max].
    if (refine && (b.s != start.s || b.o != start.o)
        && evaluate<G>(r, b.s, b.o, t, mask).loss > start.loss)
        b = start;
    if (t == 0) {
        *scale = b.s;
        *offset = b.o;
    }
}

// search_rows(x: float32 (n, d) row-major, n, d >= 1, bits, refine, steps, bins >= 1, rounds,
//             scale: float32 (n), offset: float32 (n)); n * GROUP threads, blockDim.x % 32 == 0.
extern "C" __global__ void search_rows(const float* x, long long n, int d, int bits, int refine,
                                       int steps, int bins, int rounds, float* scale,
                                       float* offset) {
    long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long row = tid / GROUP;
    if (row >= n) return;  // whole groups: every thread of a group has the same row
    int t = (int)(tid % GROUP);
    unsigned lane = threadIdx.x & 31u;
    unsigned mask = ((1u << GROUP) - 1u) << (lane & ~(unsigned)(GROUP - 1));
    search_row<GROUP>(x + row * d, d, bits, refine, steps, bins, rounds, t, mask, scale + row,
                      offset + row);
}
