// The sequence layers' kernels for gpu_seq.py: embedding, layer and RMS norm, GELU, causal
// attention's fused scale + mask + softmax, and the GRU and LSTM cells. Compiled by NVRTC at run
// time: no #include; builtin math only. No atomics: every sum runs in a fixed order (the
// embedding's gradient sums each token's rows in sorted order; row reductions use a fixed
// shared-memory tree, layer norm's a fixed butterfly of warp shuffles), so every run gives the same
// bits.

#define BLOCK 256  // threads per block: gpu_launch.BLOCK launches exactly this many

__device__ __forceinline__ float k_exp(float x) { return expf(x); }
__device__ __forceinline__ double k_exp(double x) { return exp(x); }
__device__ __forceinline__ float k_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double k_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float k_rsqrt(float x) { return 1.0f / sqrtf(x); }
__device__ __forceinline__ double k_rsqrt(double x) { return 1.0 / sqrt(x); }
template <typename T>
__device__ __forceinline__ T k_sigmoid(T x) {
  return T(1) / (T(1) + k_exp(-x));
}

#define GRID_STRIDE(i, n)                                                       \
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
       i += (long long)gridDim.x * blockDim.x)

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

// ---------------------------------------------------------------- embedding

// y[r, :] = w[idx[r], :] for r < m rows of d features.
template <typename T>
__device__ void emb_fwd(const long long* __restrict__ idx, const T* __restrict__ w,
                        T* __restrict__ y, long long m, long long d) {
  GRID_STRIDE(i, m * d) { y[i] = w[idx[i / d] * d + i % d]; }
}

// counts[v] = the number of the m rows whose id is v (ids were checked to lie in [0, vocab)).
// T is unused: every entry point of this file exists for both dtypes.
template <typename T>
__device__ void emb_count(const long long* __restrict__ idx, long long* __restrict__ counts,
                          long long m, long long vocab) {
  GRID_STRIDE(v, vocab) {
    long long c = 0;
    for (long long r = 0; r < m; ++r) c += idx[r] == v;
    counts[v] = c;
  }
}

// The rows grouped by id, each id's rows in row order from order[starts[v]] (a stable argsort,
// without Thrust's sort, which synchronises the stream and so cannot be recorded in a graph).
template <typename T>
__device__ void emb_order(const long long* __restrict__ idx, const long long* __restrict__ starts,
                          long long* __restrict__ order, long long m, long long vocab) {
  GRID_STRIDE(v, vocab) {
    long long o = starts[v];
    for (long long r = 0; r < m; ++r)
      if (idx[r] == v) order[o++] = r;
  }
}

// dw[v, j] = sum of dy[order[k], j] for k in [starts[v], starts[v + 1]): order lists the rows
// sorted by token, so each token's rows are summed by one thread, in row order.
template <typename T>
__device__ void emb_bwd(const long long* __restrict__ order, const long long* __restrict__ starts,
                        const T* __restrict__ dy, T* __restrict__ dw, long long v, long long d) {
  GRID_STRIDE(i, v * d) {
    const long long tok = i / d, j = i % d;
    T s = T(0);
    for (long long k = starts[tok]; k < starts[tok + 1]; ++k) s += dy[order[k] * d + j];
    dw[i] = s;
  }
}

// ---------------------------------------------------------------- layer normalisation

// The sum of v over the block, the same bits in every thread: a butterfly of warp shuffles in
// each warp (every lane ends with the same sum: each step adds the same two values in either
// order), then the warps' sums added in warp order by every thread. Two __syncthreads; buf holds
// BLOCK / 32 values and is free again on return. Every thread of the block must call it.
template <typename T>
__device__ T block_sum(T v, T* buf) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = v;
  __syncthreads();
  T s = buf[0];
  for (int w = 1; w < BLOCK / 32; ++w) s += buf[w];
  __syncthreads();
  return s;
}

// Elements of a row each thread keeps in registers: rows of up to BLOCK * LN_KEEP features are
// read from global memory once; longer rows are read again for each pass.
#define LN_KEEP 8

// One output of a norm: (v - mean) * rstd * gamma + beta (layer norm), v * rstd * gamma (RMS).
template <typename T, bool CENTER>
__device__ __forceinline__ T norm_out(T v, T mu, T rs, const T* gamma, const T* beta,
                                      long long j) {
  return CENTER ? (v - mu) * rs * gamma[j] + beta[j] : v * rs * gamma[j];
}

// Layer norm (CENTER) and RMS norm (not), one block per row of f features. Layer norm: mean,
// rstd = 1 / sqrt(biased var + eps) with the variance the mean of (x - mean)^2, as NumPy's, and
// y = (x - mean) * rstd * gamma + beta. RMS norm: rstd = 1 / sqrt(mean(x^2) + eps) and
// y = x * rstd * gamma (no mean, no beta: the same arithmetic with the mean 0 and no shift).
// Each row is kept in registers where it fits (thread t holds features t, t + BLOCK, ...).
template <typename T, bool CENTER>
__device__ void norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma,
                         const T* __restrict__ beta, T* __restrict__ y, T* __restrict__ mean,
                         T* __restrict__ rstd, long long m, long long f, T eps) {
  __shared__ T buf[BLOCK / 32];
  const bool kept = f <= (long long)BLOCK * LN_KEEP;  // the same in every thread
  for (long long r = blockIdx.x; r < m; r += gridDim.x) {  // uniform per block: syncs are safe
    const T* row = x + r * f;
    T v[LN_KEEP];
    T mu = T(0), s = T(0);
    if (kept) {
#pragma unroll
      for (int k = 0; k < LN_KEEP; ++k) {
        const long long j = threadIdx.x + (long long)k * BLOCK;
        v[k] = j < f ? row[j] : T(0);
        s += v[k];
      }
    } else if (CENTER) {
      for (long long j = threadIdx.x; j < f; j += BLOCK) s += row[j];
    }
    if (CENTER) mu = block_sum(s, buf) / T(f);
    T q = T(0);
    if (kept) {
#pragma unroll
      for (int k = 0; k < LN_KEEP; ++k) {
        const long long j = threadIdx.x + (long long)k * BLOCK;
        const T d = v[k] - mu;
        if (j < f) q += d * d;
      }
    } else {
      for (long long j = threadIdx.x; j < f; j += BLOCK) q += (row[j] - mu) * (row[j] - mu);
    }
    const T rs = k_rsqrt(block_sum(q, buf) / T(f) + eps);
    if (kept) {
#pragma unroll
      for (int k = 0; k < LN_KEEP; ++k) {
        const long long j = threadIdx.x + (long long)k * BLOCK;
        if (j < f) y[r * f + j] = norm_out<T, CENTER>(v[k], mu, rs, gamma, beta, j);
      }
    } else {
      for (long long j = threadIdx.x; j < f; j += BLOCK)
        y[r * f + j] = norm_out<T, CENTER>(row[j], mu, rs, gamma, beta, j);
    }
    if (threadIdx.x == 0) {
      if (CENTER) mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// The rows r = blockIdx.x, blockIdx.x + gridDim.x, ... of the backward, in one read of dy and x:
// with g = dy * gamma and xhat = (x - mean) * rstd (layer norm) or x * rstd (RMS norm),
// dx = (g - mean(g) - xhat * mean(g * xhat)) * rstd, without mean(g) for RMS norm. The block
// also sums dy * xhat (and for layer norm dy) over its rows, each feature by the one thread that
// owns it, in row order, into row blockIdx.x of part (gridDim.x, 2 or 1, f): gamma's (and beta's)
// gradients are part's column sums, taken in a fixed order afterwards, so the bits depend on m
// and the grid, never on timing.
template <typename T, bool CENTER>
__device__ void norm_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                         const T* __restrict__ gamma, const T* __restrict__ mean,
                         const T* __restrict__ rstd, T* __restrict__ dx, T* __restrict__ part,
                         long long m, long long f) {
  __shared__ T buf[BLOCK / 32];
  const bool kept = f <= (long long)BLOCK * LN_KEEP;
  T* pg = part + (long long)blockIdx.x * (CENTER ? 2 : 1) * f;  // sums of dy * xhat, then dy
  T* pb = pg + f;
  T ag[LN_KEEP], ab[LN_KEEP];
#pragma unroll
  for (int k = 0; k < LN_KEEP; ++k) ag[k] = ab[k] = T(0);
  if (!kept)
    for (long long j = threadIdx.x; j < f; j += BLOCK) {
      pg[j] = T(0);
      if (CENTER) pb[j] = T(0);
    }
  for (long long r = blockIdx.x; r < m; r += gridDim.x) {
    const long long o = r * f;
    const T mu = CENTER ? mean[r] : T(0), rs = rstd[r];
    T sg = T(0), sgx = T(0);
    if (kept) {
      T h[LN_KEEP], g[LN_KEEP];
#pragma unroll
      for (int k = 0; k < LN_KEEP; ++k) {
        const long long j = threadIdx.x + (long long)k * BLOCK;
        const T d = j < f ? dy[o + j] : T(0);
        h[k] = j < f ? (x[o + j] - mu) * rs : T(0);
        g[k] = j < f ? d * gamma[j] : T(0);
        sg += g[k];
        sgx += g[k] * h[k];
        ag[k] += d * h[k];
        ab[k] += d;
      }
      if (CENTER) sg = block_sum(sg, buf) / T(f);
      sgx = block_sum(sgx, buf) / T(f);
#pragma unroll
      for (int k = 0; k < LN_KEEP; ++k) {
        const long long j = threadIdx.x + (long long)k * BLOCK;
        if (j < f) dx[o + j] = ((CENTER ? g[k] - sg : g[k]) - h[k] * sgx) * rs;
      }
    } else {
      for (long long j = threadIdx.x; j < f; j += BLOCK) {
        const T d = dy[o + j], h = (x[o + j] - mu) * rs, g = d * gamma[j];
        sg += g;
        sgx += g * h;
        pg[j] += d * h;
        if (CENTER) pb[j] += d;
      }
      if (CENTER) sg = block_sum(sg, buf) / T(f);
      sgx = block_sum(sgx, buf) / T(f);
      for (long long j = threadIdx.x; j < f; j += BLOCK) {
        const T g = dy[o + j] * gamma[j];
        dx[o + j] = ((CENTER ? g - sg : g) - (x[o + j] - mu) * rs * sgx) * rs;
      }
    }
  }
  if (kept) {
#pragma unroll
    for (int k = 0; k < LN_KEEP; ++k) {
      const long long j = threadIdx.x + (long long)k * BLOCK;
      if (j < f) {
        pg[j] = ag[k];
        if (CENTER) pb[j] = ab[k];
      }
    }
  }
}

// ---------------------------------------------------------------- GELU (tanh approximation)

#define GELU_C 0.7978845608028654  // sqrt(2 / pi)
#define GELU_A 0.044715

template <typename T>
__device__ void gelu_fwd(const T* __restrict__ x, T* __restrict__ y, T* __restrict__ t,
                         long long n) {
  GRID_STRIDE(i, n) {
    const T v = x[i];
    const T th = k_tanh(v * (T(GELU_C) + T(GELU_A * GELU_C) * v * v));
    t[i] = th;
    y[i] = T(0.5) * v * (T(1) + th);
  }
}

template <typename T>
__device__ void gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                         const T* __restrict__ t, T* __restrict__ dx, long long n) {
  GRID_STRIDE(i, n) {
    const T v = x[i], th = t[i];
    const T g = T(GELU_C) + T(3 * GELU_A * GELU_C) * v * v;
    dx[i] = dy[i] * (T(0.5) * (T(1) + th + v * (T(1) - th * th) * g));
  }
}

// ---------------------------------------------------------------- causal attention's softmax

// One block per row of the (b * t, t) scores: row r is query i = r % t, which sees keys
// j <= i. probs = softmax(scale * scores) over those, 0 for the future.
template <typename T>
__device__ void csoftmax_fwd(const T* __restrict__ scores, T* __restrict__ probs, long long rows,
                             long long t, T scale) {
  __shared__ T buf[BLOCK];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const long long i = r % t;
    const T* row = scores + r * t;
    T m = row[0] * scale;
    for (long long j = threadIdx.x; j <= i; j += BLOCK) m = row[j] * scale > m ? row[j] * scale : m;
    m = block_reduce<T, true>(m, buf);
    T s = T(0);
    for (long long j = threadIdx.x; j <= i; j += BLOCK) s += k_exp(row[j] * scale - m);
    s = block_reduce<T, false>(s, buf);
    for (long long j = threadIdx.x; j < t; j += BLOCK)
      probs[r * t + j] = j <= i ? k_exp(row[j] * scale - m) / s : T(0);
  }
}

// One block per row: dscores = (dp - sum(dp * p)) * p * scale.
template <typename T>
__device__ void csoftmax_bwd(const T* __restrict__ dp, const T* __restrict__ p,
                             T* __restrict__ ds, long long rows, long long t, T scale) {
  __shared__ T buf[BLOCK];
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const long long o = r * t;
    T s = T(0);
    for (long long j = threadIdx.x; j < t; j += BLOCK) s += dp[o + j] * p[o + j];
    s = block_reduce<T, false>(s, buf);
    for (long long j = threadIdx.x; j < t; j += BLOCK)
      ds[o + j] = (dp[o + j] - s) * p[o + j] * scale;
  }
}

// ---------------------------------------------------------------- recurrent cells

// One GRU step over n rows of u units; gx, gh (n, 3u) in the order (r, z, n); gates (n, 4u)
// keeps r, z, n and gh's n block for the backward step.
template <typename T>
__device__ void gru_fwd(const T* __restrict__ gx, const T* __restrict__ gh,
                        const T* __restrict__ h, T* __restrict__ h_new, T* __restrict__ gates,
                        long long n, long long u) {
  GRID_STRIDE(i, n * u) {
    const long long row = i / u, k = i % u, g3 = row * 3 * u, g4 = row * 4 * u;
    const T r = k_sigmoid(gx[g3 + k] + gh[g3 + k]);
    const T z = k_sigmoid(gx[g3 + u + k] + gh[g3 + u + k]);
    const T ghn = gh[g3 + 2 * u + k];
    const T nn = k_tanh(gx[g3 + 2 * u + k] + r * ghn);
    h_new[i] = (T(1) - z) * nn + z * h[i];
    gates[g4 + k] = r;
    gates[g4 + u + k] = z;
    gates[g4 + 2 * u + k] = nn;
    gates[g4 + 3 * u + k] = ghn;
  }
}

template <typename T>
__device__ void gru_bwd(const T* __restrict__ dh_new, const T* __restrict__ gates,
                        const T* __restrict__ h, T* __restrict__ dgx, T* __restrict__ dgh,
                        T* __restrict__ dh, long long n, long long u) {
  GRID_STRIDE(i, n * u) {
    const long long row = i / u, k = i % u, g3 = row * 3 * u, g4 = row * 4 * u;
    const T r = gates[g4 + k], z = gates[g4 + u + k], nn = gates[g4 + 2 * u + k];
    const T ghn = gates[g4 + 3 * u + k], d = dh_new[i];
    const T dan = d * (T(1) - z) * (T(1) - nn * nn);
    const T dar = dan * ghn * r * (T(1) - r);
    const T daz = d * (h[i] - nn) * z * (T(1) - z);
    dgx[g3 + k] = dar;
    dgx[g3 + u + k] = daz;
    dgx[g3 + 2 * u + k] = dan;
    dgh[g3 + k] = dar;
    dgh[g3 + u + k] = daz;
    dgh[g3 + 2 * u + k] = dan * r;
    dh[i] = d * z;
  }
}

// One LSTM step: g (n, 4u) pre-activations in the order (i, f, g, o), c the cell entering.
template <typename T>
__device__ void lstm_fwd(const T* __restrict__ g, const T* __restrict__ c,
                         T* __restrict__ h_new, T* __restrict__ c_new, T* __restrict__ acts,
                         long long n, long long u) {
  GRID_STRIDE(i, n * u) {
    const long long o = (i / u) * 4 * u + i % u;
    const T ig = k_sigmoid(g[o]), fg = k_sigmoid(g[o + u]);
    const T gg = k_tanh(g[o + 2 * u]), og = k_sigmoid(g[o + 3 * u]);
    const T cn = fg * c[i] + ig * gg;
    c_new[i] = cn;
    h_new[i] = og * k_tanh(cn);
    acts[o] = ig;
    acts[o + u] = fg;
    acts[o + 2 * u] = gg;
    acts[o + 3 * u] = og;
  }
}

template <typename T>
__device__ void lstm_bwd(const T* __restrict__ dh_new, const T* __restrict__ dc_new,
                         const T* __restrict__ acts, const T* __restrict__ c,
                         const T* __restrict__ c_new, T* __restrict__ dg, T* __restrict__ dc,
                         long long n, long long u) {
  GRID_STRIDE(i, n * u) {
    const long long o = (i / u) * 4 * u + i % u;
    const T ig = acts[o], fg = acts[o + u], gg = acts[o + 2 * u], og = acts[o + 3 * u];
    const T tc = k_tanh(c_new[i]);
    const T dct = dc_new[i] + dh_new[i] * og * (T(1) - tc * tc);
    dg[o] = dct * gg * ig * (T(1) - ig);
    dg[o + u] = dct * c[i] * fg * (T(1) - fg);
    dg[o + 2 * u] = dct * ig * (T(1) - gg * gg);
    dg[o + 3 * u] = dh_new[i] * tc * og * (T(1) - og);
    dc[i] = dct * fg;
  }
}

#define ENTRY_POINTS(T, SUF)                                                                    \
  extern "C" __global__ void emb_fwd_##SUF(const long long* idx, const T* w, T* y, long long m, \
                                           long long d) {                                       \
    emb_fwd<T>(idx, w, y, m, d);                                                                \
  }                                                                                             \
  extern "C" __global__ void emb_bwd_##SUF(const long long* order, const long long* starts,     \
                                           const T* dy, T* dw, long long v, long long d) {      \
    emb_bwd<T>(order, starts, dy, dw, v, d);                                                    \
  }                                                                                             \
  extern "C" __global__ void emb_count_##SUF(const long long* idx, long long* counts,           \
                                             long long m, long long vocab) {                      \
    emb_count<T>(idx, counts, m, vocab);                                                        \
  }                                                                                             \
  extern "C" __global__ void emb_order_##SUF(const long long* idx, const long long* starts,      \
                                             long long* order, long long m, long long vocab) {    \
    emb_order<T>(idx, starts, order, m, vocab);                                                 \
  }                                                                                             \
  extern "C" __global__ void ln_fwd_##SUF(const T* x, const T* gamma, const T* beta, T* y,      \
                                          T* mean, T* rstd, long long m, long long f, T eps) {  \
    norm_fwd<T, true>(x, gamma, beta, y, mean, rstd, m, f, eps);                                \
  }                                                                                             \
  extern "C" __global__ void ln_bwd_##SUF(const T* dy, const T* x, const T* gamma,              \
                                          const T* mean, const T* rstd, T* dx, T* part,         \
                                          long long m, long long f) {                           \
    norm_bwd<T, true>(dy, x, gamma, mean, rstd, dx, part, m, f);                                \
  }                                                                                             \
  extern "C" __global__ void rms_fwd_##SUF(const T* x, const T* gamma, T* y, T* rstd,           \
                                           long long m, long long f, T eps) {                   \
    norm_fwd<T, false>(x, gamma, nullptr, y, nullptr, rstd, m, f, eps);                         \
  }                                                                                             \
  extern "C" __global__ void rms_bwd_##SUF(const T* dy, const T* x, const T* gamma,             \
                                           const T* rstd, T* dx, T* part, long long m,          \
                                           long long f) {                                       \
    norm_bwd<T, false>(dy, x, gamma, nullptr, rstd, dx, part, m, f);                            \
  }                                                                                             \
  extern "C" __global__ void gelu_fwd_##SUF(const T* x, T* y, T* t, long long n) {              \
    gelu_fwd<T>(x, y, t, n);                                                                    \
  }                                                                                             \
  extern "C" __global__ void gelu_bwd_##SUF(const T* dy, const T* x, const T* t, T* dx,         \
                                            long long n) {                                      \
    gelu_bwd<T>(dy, x, t, dx, n);                                                               \
  }                                                                                             \
  extern "C" __global__ void csoftmax_fwd_##SUF(const T* scores, T* probs, long long rows,       \
                                                long long t, T scale) {                         \
    csoftmax_fwd<T>(scores, probs, rows, t, scale);                                             \
  }                                                                                             \
  extern "C" __global__ void csoftmax_bwd_##SUF(const T* dp, const T* p, T* ds, long long rows, \
                                                long long t, T scale) {                         \
    csoftmax_bwd<T>(dp, p, ds, rows, t, scale);                                                 \
  }                                                                                             \
  extern "C" __global__ void gru_fwd_##SUF(const T* gx, const T* gh, const T* h, T* h_new,      \
                                           T* gates, long long n, long long u) {                \
    gru_fwd<T>(gx, gh, h, h_new, gates, n, u);                                                  \
  }                                                                                             \
  extern "C" __global__ void gru_bwd_##SUF(const T* dh_new, const T* gates, const T* h, T* dgx, \
                                           T* dgh, T* dh, long long n, long long u) {           \
    gru_bwd<T>(dh_new, gates, h, dgx, dgh, dh, n, u);                                           \
  }                                                                                             \
  extern "C" __global__ void lstm_fwd_##SUF(const T* g, const T* c, T* h_new, T* c_new,         \
                                            T* acts, long long n, long long u) {                \
    lstm_fwd<T>(g, c, h_new, c_new, acts, n, u);                                                \
  }                                                                                             \
  extern "C" __global__ void lstm_bwd_##SUF(const T* dh_new, const T* dc_new, const T* acts,    \
                                            const T* c, const T* c_new, T* dg, T* dc,           \
                                            long long n, long long u) {                         \
    lstm_bwd<T>(dh_new, dc_new, acts, c, c_new, dg, dc, n, u);                                  \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
