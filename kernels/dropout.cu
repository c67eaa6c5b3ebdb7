// The counter-based dropout mask, bit-identical to cpu.dropout_mask, for gpu.py.
// Compiled by NVRTC at run time: no #include. All hash arithmetic wraps modulo 2**64.

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {  // SplitMix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Element e has counter base + e (base = first sample's global index * elements per sample); it is
// kept, with value scale, iff the top 24 bits of mix64(key + counter * golden) are >= thresh.
// With key_offset (device memory: the key and the first sample's global index), those are read
// there and base = key_offset[1] * per: a replayed CUDA graph draws the step's own mask.
template <typename T>
__device__ void dropout_mask(T* __restrict__ out, long long n, unsigned long long key,
                             unsigned long long base, unsigned long long thresh, T scale,
                             const unsigned long long* __restrict__ key_offset,
                             unsigned long long per) {
  if (key_offset != nullptr) {
    key = key_offset[0];
    base = key_offset[1] * per;
  }
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const unsigned long long ctr = base + (unsigned long long)e;
    const unsigned long long h = mix64(key + ctr * 0x9E3779B97F4A7C15ULL);
    out[e] = (h >> 40) >= thresh ? scale : T(0);
  }
}

#define ENTRY_POINTS(T, SUF)                                                                 \
  extern "C" __global__ void dropout_mask_##SUF(                                             \
      T* out, long long n, unsigned long long key, unsigned long long base,                  \
      unsigned long long thresh, T scale, const unsigned long long* key_offset,              \
      unsigned long long per) {                                                              \
    dropout_mask<T>(out, n, key, base, thresh, scale, key_offset, per);                      \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
