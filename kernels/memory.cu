// Memory pattern kernels for fleethealth.kernels.memory (compiled by CuPy RawModule, NVRTC).
// A pattern gives every 64-bit word i its expected value; fh_fill writes it, fh_check reads every
// word back, records mismatches (index and observed value, first max_err of them) and can then
// overwrite the word with a second pattern (the moving-inversions step), ascending or descending.
// Pattern kinds, shared with the NumPy path in memory.py:
//   0 constant p | 1 walking one 1 << ((i + p) mod 64) | 2 walking zero, its complement
//   3 checkerboard p / ~p on even / odd words | 4 address in address: byte offset 8i xor p

extern "C" {

__device__ __forceinline__ unsigned long long fh_expected(unsigned long long i, int kind,
                                                          unsigned long long p) {
    switch (kind) {
    case 0: return p;
    case 1: return 1ULL << ((i + p) & 63ULL);
    case 2: return ~(1ULL << ((i + p) & 63ULL));
    case 3: return (i & 1ULL) ? ~p : p;
    default: return (i * 8ULL) ^ p;
    }
}

__global__ void fh_fill(unsigned long long* buf, unsigned long long n, int kind, unsigned long long p) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        buf[i] = fh_expected(i, kind, p);
    }
}

__global__ void fh_check(unsigned long long* buf, unsigned long long n, int kind, unsigned long long p,
                         int rewrite, int wkind, unsigned long long wp, int descending,
                         unsigned long long* err_count, unsigned long long* err_index,
                         unsigned long long* err_observed, unsigned long long max_err) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride) {
        const unsigned long long i = descending ? n - 1ULL - t : t;
        const unsigned long long got = ((volatile unsigned long long*)buf)[i];
        if (got != fh_expected(i, kind, p)) {
            const unsigned long long slot = atomicAdd(err_count, 1ULL);
            if (slot < max_err) {
                err_index[slot] = i;
                err_observed[slot] = got;
            }
        }
        if (rewrite) {
            buf[i] = fh_expected(i, wkind, wp);
        }
    }
}

}  // extern "C"
