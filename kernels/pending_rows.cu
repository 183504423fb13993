// Copy-on-update snapshots of CUDA-resident rows (mpickpt/engine/pending_rows.py): rows still
// pending for a snapshot are copied from the device tables straight into the page-locked, mapped
// host staging area (writes over PCIe from the kernel: no device-side copy, no host round trip)
// before their first update, and in chunks by the background copier.
//
//   copy_listed_*: rows[i] of a step's update, where pending[rows[i]]: dst[row] = src[row];
//                  `hooked` counts the pending ones (one atomicAdd per copied row).
//   copy_range_*:  rows first .. first + n - 1, where pending[row]: dst[row] = src[row].
//
// One thread per word of a row; the word is the widest of 16, 8, 4, 2 or 1 bytes that divides
// the row and both base addresses (the wrapper picks it). Neither kernel clears `pending`: the
// wrapper zeroes it after every source array's kernel ran (a row's words are read by several
// threads, which must all see it pending). src and dst rows are `words` words long and
// contiguous; dst is a host pointer the device can use (cudaHostRegisterMapped).

template <typename W>
__device__ __forceinline__ void copy_listed(const W* __restrict__ src, W* __restrict__ dst,
                                            const unsigned char* __restrict__ pending,
                                            const long long* __restrict__ rows, long long n,
                                            int words, unsigned long long* hooked) {
    long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (tid >= n * words) return;
    long long i = tid / words;
    int w = (int)(tid - i * words);
    long long row = rows[i];
    if (!pending[row]) return;
    dst[row * words + w] = src[row * words + w];
    if (w == 0 && hooked != nullptr) atomicAdd(hooked, 1ULL);
}

template <typename W>
__device__ __forceinline__ void copy_range(const W* __restrict__ src, W* __restrict__ dst,
                                           const unsigned char* __restrict__ pending,
                                           long long first, long long n, int words) {
    long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (tid >= n * words) return;
    long long i = tid / words;
    long long row = first + i;
    if (!pending[row]) return;
    long long at = row * words + (tid - i * words);
    dst[at] = src[at];
}

#define PENDING_ROWS_KERNELS(NAME, W)                                                          \
    extern "C" __global__ void copy_listed_##NAME(const W* src, W* dst,                        \
                                                  const unsigned char* pending,                \
                                                  const long long* rows, long long n,          \
                                                  int words, unsigned long long* hooked) {     \
        copy_listed<W>(src, dst, pending, rows, n, words, hooked);                             \
    }                                                                                          \
    extern "C" __global__ void copy_range_##NAME(const W* src, W* dst,                         \
                                                 const unsigned char* pending,                 \
                                                 long long first, long long n, int words) {    \
        copy_range<W>(src, dst, pending, first, n, words);                                     \
    }

PENDING_ROWS_KERNELS(w16, uint4)
PENDING_ROWS_KERNELS(w8, unsigned long long)
PENDING_ROWS_KERNELS(w4, unsigned int)
PENDING_ROWS_KERNELS(w2, unsigned short)
PENDING_ROWS_KERNELS(w1, unsigned char)
