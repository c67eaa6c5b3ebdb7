// im2col and its adjoint col2im for NCHW batches, for gpu.py (convolution = im2col + cuBLAS GEMM).
// Compiled by NVRTC at run time: no #include.
// cols is (N*OH*OW, C*KH*KW): row = (n*OH + oh)*OW + ow, column = (c*KH + i)*KW + j, as cpu.im2col.

#define GRID_STRIDE(i, n)                                                   \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

// One thread per element of cols; padding reads as zero.
template <typename T>
__device__ void im2col(const T* __restrict__ x, T* __restrict__ cols, long long n, long long c,
                       long long h, long long w, long long kh, long long kw, long long stride,
                       long long pad, long long oh, long long ow) {
  const long long k = c * kh * kw;
  GRID_STRIDE(idx, n * oh * ow * k) {
    const long long row = idx / k, col = idx % k;
    const long long ox = row % ow, oy = (row / ow) % oh, b = row / (ow * oh);
    const long long j = col % kw, i = (col / kw) % kh, ch = col / (kw * kh);
    const long long y = oy * stride - pad + i, xx = ox * stride - pad + j;
    const bool inside = y >= 0 && y < h && xx >= 0 && xx < w;
    cols[idx] = inside ? x[((b * c + ch) * h + y) * w + xx] : T(0);
  }
}

// One thread per input element gathers every window entry that covers it (no atomics), adding
// them in the (i, j) order of cpu.col2im's loops.
template <typename T>
__device__ void col2im(const T* __restrict__ cols, T* __restrict__ x, long long n, long long c,
                       long long h, long long w, long long kh, long long kw, long long stride,
                       long long pad, long long oh, long long ow) {
  const long long k = c * kh * kw;
  GRID_STRIDE(idx, n * c * h * w) {
    const long long xx = idx % w, y = (idx / w) % h, ch = (idx / (w * h)) % c;
    const long long b = idx / (w * h * c);
    T acc = T(0);
    for (long long i = 0; i < kh; ++i) {
      const long long dy = y + pad - i;  // = oy * stride for the window that puts offset i here
      if (dy < 0 || dy % stride != 0 || dy / stride >= oh) continue;
      for (long long j = 0; j < kw; ++j) {
        const long long dx = xx + pad - j;
        if (dx < 0 || dx % stride != 0 || dx / stride >= ow) continue;
        const long long row = (b * oh + dy / stride) * ow + dx / stride;
        acc += cols[row * k + (ch * kh + i) * kw + j];
      }
    }
    x[idx] = acc;
  }
}

#define ENTRY_POINTS(T, SUF)                                                                  \
  extern "C" __global__ void im2col_##SUF(const T* x, T* cols, long long n, long long c,      \
                                          long long h, long long w, long long kh,             \
                                          long long kw, long long stride, long long pad,      \
                                          long long oh, long long ow) {                       \
    im2col<T>(x, cols, n, c, h, w, kh, kw, stride, pad, oh, ow);                              \
  }                                                                                           \
  extern "C" __global__ void col2im_##SUF(const T* cols, T* x, long long n, long long c,      \
                                          long long h, long long w, long long kh,             \
                                          long long kw, long long stride, long long pad,      \
                                          long long oh, long long ow) {                       \
    col2im<T>(cols, x, n, c, h, w, kh, kw, stride, pad, oh, ow);                              \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
