// Activations, fused bias + activation, and the bias gradient (a column sum), for gpu.py.
// Compiled by NVRTC at run time: no #include; builtin math only.
// Activation codes are indices into common.ACTIVATIONS: 0 linear, 1 relu, 2 sigmoid, 3 tanh.

#define GRID_STRIDE(i, n)                                                   \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float k_exp(float x) { return expf(x); }
__device__ __forceinline__ double k_exp(double x) { return exp(x); }
__device__ __forceinline__ float k_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double k_tanh(double x) { return tanh(x); }

template <typename T>
__device__ __forceinline__ T activate(T z, long long act) {
  if (act == 1) return z <= T(0) ? T(0) : z;  // NaN passes through, as with np.maximum
  if (act == 2) return T(1) / (T(1) + k_exp(-z));
  if (act == 3) return k_tanh(z);
  return z;
}

// The derivative written in terms of the output y, as in cpu.activation_backward.
template <typename T>
__device__ __forceinline__ T act_grad(T dy, T y, long long act) {
  if (act == 1) return dy * (y > T(0) ? T(1) : T(0));
  if (act == 2) return dy * y * (T(1) - y);
  if (act == 3) return dy * (T(1) - y * y);
  return dy;
}

template <typename T>
__device__ void act_fwd(const T* __restrict__ z, T* __restrict__ y, long long n, long long act) {
  GRID_STRIDE(i, n) { y[i] = activate(z[i], act); }
}

// y = act(z + b) for z of shape (n / f, f) and b of shape (f,).
template <typename T>
__device__ void bias_act_fwd(const T* __restrict__ z, const T* __restrict__ b, T* __restrict__ y,
                             long long n, long long f, long long act) {
  GRID_STRIDE(i, n) { y[i] = activate(z[i] + b[i % f], act); }
}

template <typename T>
__device__ void act_bwd(const T* __restrict__ dy, const T* __restrict__ y, T* __restrict__ dz,
                        long long n, long long act) {
  GRID_STRIDE(i, n) { dz[i] = act_grad(dy[i], y[i], act); }
}

// Thread idx of a pass over (m, f) in chunks of `rows` rows: its column, and its chunk's rows
// [r0, r1). Adjacent threads take adjacent columns, so the loads coalesce.
struct Chunk {
  long long col, r0, r1;
};
__device__ __forceinline__ Chunk chunk_of(long long idx, long long m, long long f,
                                          long long rows) {
  const long long r0 = (idx / f) * rows;
  return Chunk{idx % f, r0, r0 + rows < m ? r0 + rows : m};
}

// One pass of a deterministic column sum of a (m, f) matrix: thread (chunk, col) adds the rows of
// its chunk in order, so out is (ceil(m / rows), f). gpu.py repeats passes until one row is left.
template <typename T>
__device__ void col_sum(const T* __restrict__ a, T* __restrict__ out, long long m, long long f,
                        long long rows) {
  GRID_STRIDE(idx, (m + rows - 1) / rows * f) {
    const Chunk c = chunk_of(idx, m, f, rows);
    T acc = T(0);
    for (long long r = c.r0; r < c.r1; ++r) acc += a[r * f + c.col];
    out[idx] = acc;
  }
}

// The activation's backward pass and the first pass of the bias gradient's column sum in one
// kernel: thread (chunk, col) writes dz for the rows of its chunk and adds them in row order into
// part[chunk, col], which is what act_bwd and then col_sum over dz give, bit for bit, with one
// launch and one pass over dz fewer.
template <typename T>
__device__ void act_bwd_col_sum(const T* __restrict__ dy, const T* __restrict__ y,
                                T* __restrict__ dz, T* __restrict__ part, long long m, long long f,
                                long long rows, long long act) {
  GRID_STRIDE(idx, (m + rows - 1) / rows * f) {
    const Chunk c = chunk_of(idx, m, f, rows);
    T acc = T(0);
    for (long long r = c.r0; r < c.r1; ++r) {
      const T g = act_grad(dy[r * f + c.col], y[r * f + c.col], act);
      dz[r * f + c.col] = g;
      acc += g;
    }
    part[idx] = acc;
  }
}

#define ENTRY_POINTS(T, SUF)                                                                   \
  extern "C" __global__ void act_fwd_##SUF(const T* z, T* y, long long n, long long act) {     \
    act_fwd<T>(z, y, n, act);                                                                  \
  }                                                                                            \
  extern "C" __global__ void bias_act_fwd_##SUF(const T* z, const T* b, T* y, long long n,     \
                                                long long f, long long act) {                  \
    bias_act_fwd<T>(z, b, y, n, f, act);                                                       \
  }                                                                                            \
  extern "C" __global__ void act_bwd_##SUF(const T* dy, const T* y, T* dz, long long n,        \
                                           long long act) {                                    \
    act_bwd<T>(dy, y, dz, n, act);                                                             \
  }                                                                                            \
  extern "C" __global__ void col_sum_##SUF(const T* a, T* out, long long m, long long f,       \
                                           long long rows) {                                   \
    col_sum<T>(a, out, m, f, rows);                                                            \
  }                                                                                            \
  extern "C" __global__ void act_bwd_col_sum_##SUF(const T* dy, const T* y, T* dz, T* part,    \
                                                   long long m, long long f, long long rows,   \
                                                   long long act) {                            \
    act_bwd_col_sum<T>(dy, y, dz, part, m, f, rows, act);                                      \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
