// Max and average pooling (square k x k windows, NCHW), forward and backward, for gpu.py.
// Compiled by NVRTC at run time: no #include.
// Backward passes are gathers, one thread per input element (no atomics), adding contributions
// in the (i, j) order of cpu._scatter_windows.

#define GRID_STRIDE(i, n)                                                   \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

__device__ __forceinline__ float neg_inf(float) { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ double neg_inf(double) {
  return -__longlong_as_double(0x7ff0000000000000LL);
}

// arg = position i*k + j in the window of the first maximum (as np.argmax: padding is -inf, the
// first NaN wins); y = that value.
template <typename T>
__device__ void maxpool_fwd(const T* __restrict__ x, T* __restrict__ y, int* __restrict__ arg,
                            long long nc, long long h, long long w, long long k, long long stride,
                            long long pad, long long oh, long long ow) {
  GRID_STRIDE(idx, nc * oh * ow) {
    const long long ox = idx % ow, oy = (idx / ow) % oh;
    const T* plane = x + (idx / (ow * oh)) * h * w;
    T best = neg_inf(T(0));
    int best_at = 0;
    for (long long i = 0; i < k; ++i) {
      const long long r = oy * stride - pad + i;
      for (long long j = 0; j < k; ++j) {
        const long long q = ox * stride - pad + j;
        const T v = r >= 0 && r < h && q >= 0 && q < w ? plane[r * w + q] : neg_inf(T(0));
        if (v > best || (v != v && best == best)) {
          best = v;
          best_at = (int)(i * k + j);
        }
      }
    }
    y[idx] = best;
    arg[idx] = best_at;
  }
}

// Calls f(output index, position in window) for every window covering input element idx, in
// (i, j) order.
template <typename F>
__device__ __forceinline__ void for_covering(long long idx, long long h, long long w, long long k,
                                             long long stride, long long pad, long long oh,
                                             long long ow, F f) {
  const long long xx = idx % w, y = (idx / w) % h, plane = idx / (w * h);
  for (long long i = 0; i < k; ++i) {
    const long long dy = y + pad - i;  // = oy * stride for the window that puts offset i here
    if (dy < 0 || dy % stride != 0 || dy / stride >= oh) continue;
    for (long long j = 0; j < k; ++j) {
      const long long dx = xx + pad - j;
      if (dx < 0 || dx % stride != 0 || dx / stride >= ow) continue;
      f((plane * oh + dy / stride) * ow + dx / stride, i * k + j);
    }
  }
}

template <typename T>
__device__ void maxpool_bwd(const T* __restrict__ dy, const int* __restrict__ arg,
                            T* __restrict__ dx, long long nc, long long h, long long w,
                            long long k, long long stride, long long pad, long long oh,
                            long long ow) {
  GRID_STRIDE(idx, nc * h * w) {
    T acc = T(0);
    for_covering(idx, h, w, k, stride, pad, oh, ow, [&](long long o, long long p) {
      if (arg[o] == p) acc += dy[o];
    });
    dx[idx] = acc;
  }
}

// Padding counts in the divisor (count_include_pad), as cpu.avgpool_forward.
template <typename T>
__device__ void avgpool_fwd(const T* __restrict__ x, T* __restrict__ y, long long nc, long long h,
                            long long w, long long k, long long stride, long long pad,
                            long long oh, long long ow) {
  GRID_STRIDE(idx, nc * oh * ow) {
    const long long ox = idx % ow, oy = (idx / ow) % oh;
    const T* plane = x + (idx / (ow * oh)) * h * w;
    T acc = T(0);
    for (long long i = 0; i < k; ++i) {
      const long long r = oy * stride - pad + i;
      for (long long j = 0; j < k; ++j) {
        const long long q = ox * stride - pad + j;
        if (r >= 0 && r < h && q >= 0 && q < w) acc += plane[r * w + q];
      }
    }
    y[idx] = acc / T(k * k);
  }
}

template <typename T>
__device__ void avgpool_bwd(const T* __restrict__ dy, T* __restrict__ dx, long long nc,
                            long long h, long long w, long long k, long long stride,
                            long long pad, long long oh, long long ow) {
  const T kk = T(k * k);
  GRID_STRIDE(idx, nc * h * w) {
    T acc = T(0);
    for_covering(idx, h, w, k, stride, pad, oh, ow,
                 [&](long long o, long long) { acc += dy[o] / kk; });
    dx[idx] = acc;
  }
}

#define ENTRY_POINTS(T, SUF)                                                                   \
  extern "C" __global__ void maxpool_fwd_##SUF(const T* x, T* y, int* arg, long long nc,       \
                                               long long h, long long w, long long k,          \
                                               long long stride, long long pad, long long oh,  \
                                               long long ow) {                                 \
    maxpool_fwd<T>(x, y, arg, nc, h, w, k, stride, pad, oh, ow);                               \
  }                                                                                            \
  extern "C" __global__ void maxpool_bwd_##SUF(const T* dy, const int* arg, T* dx,             \
                                               long long nc, long long h, long long w,         \
                                               long long k, long long stride, long long pad,   \
                                               long long oh, long long ow) {                   \
    maxpool_bwd<T>(dy, arg, dx, nc, h, w, k, stride, pad, oh, ow);                             \
  }                                                                                            \
  extern "C" __global__ void avgpool_fwd_##SUF(const T* x, T* y, long long nc, long long h,    \
                                               long long w, long long k, long long stride,     \
                                               long long pad, long long oh, long long ow) {    \
    avgpool_fwd<T>(x, y, nc, h, w, k, stride, pad, oh, ow);                                    \
  }                                                                                            \
  extern "C" __global__ void avgpool_bwd_##SUF(const T* dy, T* dx, long long nc, long long h,  \
                                               long long w, long long k, long long stride,     \
                                               long long pad, long long oh, long long ow) {    \
    avgpool_bwd<T>(dy, dx, nc, h, w, k, stride, pad, oh, ow);                                  \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
