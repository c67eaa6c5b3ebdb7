// Batch normalisation over the channel axis, for gpu.py. x is viewed as (N, C, S), with S = H*W
// for NCHW and 1 for (N, C): channel ch's elements are x[(b*C + ch)*S + s].
// Compiled by NVRTC at run time: no #include; builtin math only.
// Per-channel statistics: one block per channel, a fixed-order strided loop and a shared-memory
// tree, so every run gives the same bits (no atomics).

#define BLOCK 256  // threads per block: gpu.BLOCK launches exactly this many (a power of two)

#define GRID_STRIDE(i, n)                                                   \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float k_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double k_sqrt(double x) { return sqrt(x); }

// The sum of v over the block; buf holds BLOCK values and is free again on return.
template <typename T>
__device__ T block_sum(T v, T* buf) {
  buf[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
    __syncthreads();
  }
  const T r = buf[0];
  __syncthreads();
  return r;
}

// Offset of the e-th element (e < N*S) of channel ch.
__device__ __forceinline__ long long at(long long e, long long ch, long long c, long long s) {
  return ((e / s) * c + ch) * s + e % s;
}

// mean, biased var and inv_std = 1 / sqrt(var + eps) of every channel.
template <typename T>
__device__ void bn_stats(const T* __restrict__ x, T* __restrict__ mean, T* __restrict__ var,
                         T* __restrict__ inv_std, long long n, long long c, long long s, T eps) {
  __shared__ T buf[BLOCK];
  const long long m = n * s;
  for (long long ch = blockIdx.x; ch < c; ch += gridDim.x) {  // uniform per block: syncs are safe
    T acc = T(0);
    for (long long e = threadIdx.x; e < m; e += BLOCK) acc += x[at(e, ch, c, s)];
    const T mu = block_sum(acc, buf) / T(m);
    acc = T(0);
    for (long long e = threadIdx.x; e < m; e += BLOCK) {
      const T d = x[at(e, ch, c, s)] - mu;
      acc += d * d;
    }
    const T v = block_sum(acc, buf) / T(m);
    if (threadIdx.x == 0) {
      mean[ch] = mu;
      var[ch] = v;
      inv_std[ch] = T(1) / k_sqrt(v + eps);
    }
  }
}

// y = (x - mean) * a * g + beta per channel: training passes (inv_std, gamma), inference
// (gamma * inv_std, ones), matching the two formulas in cpu.py.
template <typename T>
__device__ void bn_apply(const T* __restrict__ x, const T* __restrict__ mean,
                         const T* __restrict__ a, const T* __restrict__ g,
                         const T* __restrict__ beta, T* __restrict__ y, long long total,
                         long long c, long long s) {
  GRID_STRIDE(i, total) {
    const long long ch = (i / s) % c;
    y[i] = (x[i] - mean[ch]) * a[ch] * g[ch] + beta[ch];
  }
}

// dbeta = sum dy and dgamma = sum dy * xhat per channel.
template <typename T>
__device__ void bn_bwd_reduce(const T* __restrict__ dy, const T* __restrict__ x,
                              const T* __restrict__ mean, const T* __restrict__ inv_std,
                              T* __restrict__ dgamma, T* __restrict__ dbeta, long long n,
                              long long c, long long s) {
  __shared__ T buf[BLOCK];
  const long long m = n * s;
  for (long long ch = blockIdx.x; ch < c; ch += gridDim.x) {
    T sum_dy = T(0), sum_dyx = T(0);
    for (long long e = threadIdx.x; e < m; e += BLOCK) {
      const long long o = at(e, ch, c, s);
      sum_dy += dy[o];
      sum_dyx += dy[o] * ((x[o] - mean[ch]) * inv_std[ch]);
    }
    sum_dy = block_sum(sum_dy, buf);
    sum_dyx = block_sum(sum_dyx, buf);
    if (threadIdx.x == 0) {
      dbeta[ch] = sum_dy;
      dgamma[ch] = sum_dyx;
    }
  }
}

// dx = k * (m * dy - dbeta - xhat * dgamma) with k = gamma * inv_std / m, as cpu.batchnorm_backward.
template <typename T>
__device__ void bn_bwd_dx(const T* __restrict__ dy, const T* __restrict__ x,
                          const T* __restrict__ mean, const T* __restrict__ inv_std,
                          const T* __restrict__ k, const T* __restrict__ dgamma,
                          const T* __restrict__ dbeta, T* __restrict__ dx, long long total,
                          long long c, long long s, T m) {
  GRID_STRIDE(i, total) {
    const long long ch = (i / s) % c;
    const T xhat = (x[i] - mean[ch]) * inv_std[ch];
    dx[i] = k[ch] * (m * dy[i] - dbeta[ch] - xhat * dgamma[ch]);
  }
}

#define ENTRY_POINTS(T, SUF)                                                                   \
  extern "C" __global__ void bn_stats_##SUF(const T* x, T* mean, T* var, T* inv_std,           \
                                            long long n, long long c, long long s, T eps) {    \
    bn_stats<T>(x, mean, var, inv_std, n, c, s, eps);                                          \
  }                                                                                            \
  extern "C" __global__ void bn_apply_##SUF(const T* x, const T* mean, const T* a, const T* g,  \
                                            const T* beta, T* y, long long total, long long c, \
                                            long long s) {                                     \
    bn_apply<T>(x, mean, a, g, beta, y, total, c, s);                                          \
  }                                                                                            \
  extern "C" __global__ void bn_bwd_reduce_##SUF(const T* dy, const T* x, const T* mean,       \
                                                 const T* inv_std, T* dgamma, T* dbeta,        \
                                                 long long n, long long c, long long s) {      \
    bn_bwd_reduce<T>(dy, x, mean, inv_std, dgamma, dbeta, n, c, s);                            \
  }                                                                                            \
  extern "C" __global__ void bn_bwd_dx_##SUF(const T* dy, const T* x, const T* mean,           \
                                             const T* inv_std, const T* k, const T* dgamma,    \
                                             const T* dbeta, T* dx, long long total,           \
                                             long long c, long long s, T m) {                  \
    bn_bwd_dx<T>(dy, x, mean, inv_std, k, dgamma, dbeta, dx, total, c, s, m);                  \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
