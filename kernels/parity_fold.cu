// Fold of parity differences (ECRM difference propagation) on the GPU:
//   parity[prow[i], w] ^= coef[i] * delta[i, w]   (bytewise product in GF(2^8), poly 0x11d)
// One thread per 32-bit word. atomicXor makes repeated parity rows in one launch safe (deltas
// of one stripe from several data members). coef 1 (all of r = 1, and row 0 of the Cauchy
// matrix) is a plain XOR. Loaded with cupy.RawModule by mpickpt/parity/cuda_kernels.py; the CPU
// path is mpickpt/parity/stripe_code.py (StripeCode.fold), and the two are compared in
// tests/test_parity_cuda.py.

__device__ __forceinline__ unsigned int gf_mul_word(unsigned int v, unsigned int c,
                                                    const unsigned char* gexp,
                                                    const int* glog) {
    unsigned int out = 0u;
    int lc = glog[c];
#pragma unroll
    for (int b = 0; b < 4; b++) {
        unsigned int x = (v >> (8 * b)) & 0xffu;
        unsigned int y = x ? (unsigned int)gexp[glog[x] + lc] : 0u;
        out |= y << (8 * b);
    }
    return out;
}

// parity: (rows, words) int32; prow: (n) int64; coef: (n) uint8; delta: (n, words) int32;
// gexp: 512 uint8 (exp table, doubled); glog: 256 int32.
extern "C" __global__ void fold_rows(unsigned int* parity, const long long* prow,
                                     const unsigned char* coef, const unsigned int* delta,
                                     long long n, int words, const unsigned char* gexp,
                                     const int* glog) {
    long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (tid >= n * words) return;
    long long i = tid / words;
    int w = (int)(tid % words);
    unsigned int c = coef[i];
    if (c == 0u) return;
    unsigned int v = delta[tid];
    if (c != 1u) v = gf_mul_word(v, c, gexp, glog);
    atomicXor(parity + prow[i] * words + w, v);
}
