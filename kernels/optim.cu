// Fused optimizer updates over flat parameter buffers, and the stub's weighted sum of N gradient
// buffers in one pass, for gpu_optim.py. Compiled by NVRTC at run time: no #include.
//
// Every kernel is element-wise (no reduction, no atomics), and gpu_launch.py compiles this file with
// --fmad=false: each operation below is one IEEE-rounded float operation in the order NumPy
// performs it in raysinga/optim.py and actors/stub.py, so the results are bit-identical to the CPU
// path. Scalars arrive already rounded to T, as NumPy rounds a Python float against a T array.
//
// copy (may be null): where the updated parameter's bfloat16 words go, in the same pass (the bf16
// compute precision's copy of a weight, read by the matrix products in place of a cast of their
// own). Rounded as precision.cu's f32_to_bf16 rounds (this file is compiled alone).

__device__ __forceinline__ unsigned short bf16_word(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);  // NaN
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float k_sqrt(float x) { return sqrtf(x); }  // IEEE-rounded
__device__ __forceinline__ double k_sqrt(double x) { return sqrt(x); }

// SGD: g = grad (+ wd * p); buf = buf * momentum + g; g = nesterov ? g + momentum * buf : buf;
// p = p - lr * g. has_buf = 0: no momentum slot (buf may be null). With step (device memory),
// lr = T(step[0]): the rate of the step a replayed CUDA graph runs, rounded as the argument is.
template <typename T>
__device__ void sgd_update(T* __restrict__ p, const T* __restrict__ grad, T* __restrict__ buf,
                           long long n, T lr, T momentum, T wd, long long has_buf,
                           long long nesterov, const double* __restrict__ step,
                           unsigned short* __restrict__ copy) {
  if (step != nullptr) lr = T(step[0]);
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    const T pe = p[e];
    T g = grad[e];
    if (wd != T(0)) g = g + wd * pe;
    if (has_buf) {
      T b = buf[e] * momentum;
      b = b + g;
      buf[e] = b;
      g = nesterov ? g + momentum * b : b;
    }
    const T pn = pe - lr * g;
    p[e] = pn;
    if (copy != nullptr) copy[e] = bf16_word((float)pn);
  }
}

// Adam / AdamW, one step t (bias corrections computed by the caller):
//   p = p * decay                                (AdamW: decay = 1 - lr * wd; else 1, skipped)
//   g = grad (+ wd * p)                          (Adam with weight decay)
//   m = lerp(m, g, w)                            (torch's two formulas, picked by lerp_hi)
//   v = v * beta2 + ((1 - beta2) * g) * g
//   p = p + (neg_step * m) / (sqrt(v) / bc2 + eps)
// With step (device memory): decay, neg_step and bc2 = T(step[0]), T(step[1]), T(step[2]).
template <typename T>
__device__ void adam_update(T* __restrict__ p, const T* __restrict__ grad, T* __restrict__ m,
                            T* __restrict__ v, long long n, T decay, long long decoupled, T wd, T w,
                            T one_minus_w, long long lerp_hi, T beta2, T one_minus_beta2,
                            T neg_step, T bc2, T eps, const double* __restrict__ step,
                            unsigned short* __restrict__ copy) {
  if (step != nullptr) {
    decay = T(step[0]);
    neg_step = T(step[1]);
    bc2 = T(step[2]);
  }
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    T pe = p[e];
    T g = grad[e];
    if (decoupled) {
      pe = pe * decay;
    } else if (wd != T(0)) {
      g = g + wd * pe;
    }
    T me = m[e];
    me = lerp_hi ? g - (g - me) * one_minus_w : me + w * (g - me);
    m[e] = me;
    T ve = v[e] * beta2;
    ve = ve + (one_minus_beta2 * g) * g;
    v[e] = ve;
    T denom = k_sqrt(ve);
    denom = denom / bc2;
    denom = denom + eps;
    const T pn = pe + (neg_step * me) / denom;
    p[e] = pn;
    if (copy != nullptr) copy[e] = bf16_word((float)pn);
  }
}

// out = sum over j in 0..k-1, in that order, of w[j] * ins[j] (w == null: plain sum, exact as
// the stub's CPU sum). ins: k device pointers.
template <typename T>
__device__ void weighted_sum(T* __restrict__ out, const unsigned long long* __restrict__ ins,
                             const T* __restrict__ w, long long k, long long n) {
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += (long long)gridDim.x * blockDim.x) {
    T acc = w ? w[0] * ((const T*)ins[0])[e] : ((const T*)ins[0])[e];
    for (long long j = 1; j < k; ++j) {
      const T x = ((const T*)ins[j])[e];
      acc = acc + (w ? w[j] * x : x);
    }
    out[e] = acc;
  }
}

#define ENTRY_POINTS(T, SUF)                                                                       \
  extern "C" __global__ void sgd_update_##SUF(T* p, const T* grad, T* buf, long long n, T lr,      \
                                              T momentum, T wd, long long has_buf,                 \
                                              long long nesterov, const double* step,              \
                                              unsigned short* copy) {                              \
    sgd_update<T>(p, grad, buf, n, lr, momentum, wd, has_buf, nesterov, step, copy);               \
  }                                                                                                \
  extern "C" __global__ void adam_update_##SUF(                                                    \
      T* p, const T* grad, T* m, T* v, long long n, T decay, long long decoupled, T wd, T w,       \
      T one_minus_w, long long lerp_hi, T beta2, T one_minus_beta2, T neg_step, T bc2, T eps,      \
      const double* step, unsigned short* copy) {                                                  \
    adam_update<T>(p, grad, m, v, n, decay, decoupled, wd, w, one_minus_w, lerp_hi, beta2,         \
                   one_minus_beta2, neg_step, bc2, eps, step, copy);                               \
  }                                                                                                \
  extern "C" __global__ void weighted_sum_##SUF(T* out, const unsigned long long* ins,             \
                                                const T* w, long long k, long long n) {            \
    weighted_sum<T>(out, ins, w, k, n);                                                            \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
