// Row tracking for incremental checkpoints (Check-N-Run section 4.1).
// One bit per local embedding row, packed in 64-bit words.
//   mark_rows:     for each received row index, atomicOr its bit into the word array.
//   count_words:   per-word population count (input of an exclusive prefix sum).
//   extract_rows:  after the prefix sum, each word writes the indices of its set bits in order.
// Loaded with cupy.RawModule by mpickpt/track/cuda_kernels.py; the CPU reference is
// mpickpt/track/bitvector.py.

extern "C" __global__ void mark_rows(unsigned long long* words, const long long* rows, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        long long r = rows[i];
        atomicOr(&words[r >> 6], 1ULL << (r & 63));
    }
}

extern "C" __global__ void count_words(const unsigned long long* words, long long* counts,
                                       long long num_words) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < num_words) {
        counts[i] = __popcll(words[i]);
    }
}

extern "C" __global__ void extract_rows(const unsigned long long* words, const long long* offsets,
                                        long long* rows, long long num_words) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= num_words) {
        return;
    }
    unsigned long long w = words[i];
    long long out = offsets[i];
    while (w) {
        int bit = __ffsll((long long)w) - 1;
        rows[out++] = i * 64 + bit;
        w &= w - 1;
    }
}
