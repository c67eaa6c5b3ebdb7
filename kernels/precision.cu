// Casts between float32 and bfloat16 for the bf16 compute precision (precision.py, gpu.py).
// Compiled by NVRTC at run time: no #include, so bfloat16 is its 16-bit word (the top half of a
// float32) and the rounding is written out: to nearest, ties to even, NaN kept quiet with its
// sign, as ml_dtypes.bfloat16 and precision.bf16_bits round (the CPU suite checks those).

__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16);
}

// y[i] = bf16(x[i]) for a grid-stride range of n elements (a double is narrowed to float first:
// float64 runs compute in float64 and never call this).
template <typename T>
__device__ void to_bf16(const T* __restrict__ x, unsigned short* __restrict__ y, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = f32_to_bf16((float)x[i]);
}

template <typename T>
__device__ void from_bf16(const unsigned short* __restrict__ x, T* __restrict__ y, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = (T)bf16_to_f32(x[i]);
}

#define ENTRY_POINTS(T, SUF)                                                                    \
  extern "C" __global__ void to_bf16_##SUF(const T* x, unsigned short* y, long long n) {        \
    to_bf16<T>(x, y, n);                                                                        \
  }                                                                                             \
  extern "C" __global__ void from_bf16_##SUF(const unsigned short* x, T* y, long long n) {      \
    from_bf16<T>(x, y, n);                                                                      \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
