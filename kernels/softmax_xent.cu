// Fused softmax cross-entropy, forward (one block per row) and backward, for gpu.py.
// Compiled by NVRTC at run time: no #include; builtin math only.
// Reductions use a fixed-order shared-memory tree, so every run gives the same bits.

#define BLOCK 256  // threads per block: gpu.BLOCK launches exactly this many (a power of two)

__device__ __forceinline__ float k_exp(float x) { return expf(x); }
__device__ __forceinline__ double k_exp(double x) { return exp(x); }
__device__ __forceinline__ float k_log(float x) { return logf(x); }
__device__ __forceinline__ double k_log(double x) { return log(x); }
__device__ __forceinline__ float neg_inf(float) { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ double neg_inf(double) {
  return -__longlong_as_double(0x7ff0000000000000LL);
}
__device__ __forceinline__ float quiet_nan(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double quiet_nan(double) {
  return __longlong_as_double(0x7ff8000000000000LL);
}

// The sum (or max) of v over the block; buf holds BLOCK values and is free again on return.
template <typename T, bool MAX>
__device__ T block_reduce(T v, T* buf) {
  buf[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const T a = buf[threadIdx.x], b = buf[threadIdx.x + s];
      buf[threadIdx.x] = MAX ? (b > a ? b : a) : a + b;
    }
    __syncthreads();
  }
  const T r = buf[0];
  __syncthreads();
  return r;
}

// Per row: loss[r] = log(sum exp(row - max)) - (row[label] - max), and out = softmax(row) (GRAD
// false: xent_fwd's probabilities) or out = (softmax(row) - onehot(label)) / denom (GRAD true:
// loss and gradient in one pass of three reads of each row, max, sum, then out written, with the
// bits of xent_fwd then xent_bwd: the same probability, rounded to T, then the same subtraction
// and division, and no probs array written or read again; what a training step's loss takes,
// since its backward always follows). A label outside [0, c) gives a NaN loss instead of a read
// outside the row: gpu.py does not read the labels back to check them (a read would wait for
// the GPU); raysinga.data.check checked them before training.
template <typename T, bool GRAD>
__device__ void xent_rows(const T* __restrict__ logits, const long long* __restrict__ labels,
                          T* __restrict__ out, T* __restrict__ loss, long long n, long long c,
                          T denom) {
  __shared__ T buf[BLOCK];
  for (long long r = blockIdx.x; r < n; r += gridDim.x) {  // uniform per block: syncs are safe
    const T* row = logits + r * c;
    T m = neg_inf(T(0));
    for (long long j = threadIdx.x; j < c; j += BLOCK) m = row[j] > m ? row[j] : m;
    m = block_reduce<T, true>(m, buf);
    T s = T(0);
    for (long long j = threadIdx.x; j < c; j += BLOCK) s += k_exp(row[j] - m);
    s = block_reduce<T, false>(s, buf);
    const long long l = labels[r];
    for (long long j = threadIdx.x; j < c; j += BLOCK) {
      const T p = k_exp(row[j] - m) / s;
      out[r * c + j] = GRAD ? (p - (j == l ? T(1) : T(0))) / denom : p;
    }
    if (threadIdx.x == 0) loss[r] = l >= 0 && l < c ? k_log(s) - (row[l] - m) : quiet_nan(T(0));
  }
}

// d = (probs - onehot(labels)) / denom.
template <typename T>
__device__ void xent_bwd(const T* __restrict__ probs, const long long* __restrict__ labels,
                         T* __restrict__ d, long long n, long long c, T denom) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n * c;
       i += (long long)gridDim.x * blockDim.x) {
    const T hit = i % c == labels[i / c] ? T(1) : T(0);
    d[i] = (probs[i] - hit) / denom;
  }
}

#define ENTRY_POINTS(T, SUF)                                                                 \
  extern "C" __global__ void xent_fwd_##SUF(const T* logits, const long long* labels,        \
                                            T* probs, T* loss, long long n, long long c) {   \
    xent_rows<T, false>(logits, labels, probs, loss, n, c, T(1));                            \
  }                                                                                          \
  extern "C" __global__ void xent_bwd_##SUF(const T* probs, const long long* labels, T* d,   \
                                            long long n, long long c, T denom) {             \
    xent_bwd<T>(probs, labels, d, n, c, denom);                                              \
  }                                                                                          \
  extern "C" __global__ void xent_grad_##SUF(const T* logits, const long long* labels, T* d, \
                                             T* loss, long long n, long long c, T denom) {   \
    xent_rows<T, true>(logits, labels, d, loss, n, c, denom);                                \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
