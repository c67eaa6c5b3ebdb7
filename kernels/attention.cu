// Causal multi-head self-attention in one fused pass for gpu_attention.py (flash-attention
// style): a block takes a tile of queries (or, in the backward pass, of keys), walks the tiles of
// the other side through shared memory and keeps a running max and sum (online softmax), so no
// T x T matrix ever reaches global memory. The forward pass keeps each row's log-sum-exp, from
// which the backward pass recomputes the probabilities.
//
// Layout: row i of head hh of sequence b of q (and k, v) is at q + (b * t + i) * ld + hh * hd:
// views of the projection (n, t, 3, h, hd) with ld = 3 h hd, written the same way into dq, dk,
// dv; o and do are (n, t, h, hd) with their own ld; lse and delta are (n * h, t).
//
// Deterministic: no atomics. dQ and dK/dV are two kernels, each block owning its output rows
// and summing over the other side's tiles in ascending order. Compiled by NVRTC: no #include.

#define BLOCK 256   // threads per block: gpu_launch.BLOCK launches exactly this many
#define HD_MAX 64   // the largest head dimension; gpu_attention.py sends larger ones elsewhere

__device__ __forceinline__ float k_exp(float x) { return expf(x); }
__device__ __forceinline__ double k_exp(double x) { return exp(x); }
__device__ __forceinline__ float k_log(float x) { return logf(x); }
__device__ __forceinline__ double k_log(double x) { return log(x); }

// Rows per tile: Q, K, V and dO tiles of HD_MAX + 1 columns plus two score tiles stay within the
// 48 KiB of static shared memory a block may hold, for either float type.
template <typename T>
struct Tile {
  static const int R = 32;
};
template <>
struct Tile<double> {
  static const int R = 16;
};

// The accumulators a thread owns in a R x HD_MAX tile: elements tid, tid + BLOCK, ...
#define NACC(T) (Tile<T>::R * HD_MAX / BLOCK)
// The shared memory of a R x hd tile (see load_tile for the + 1).
#define TILE(T) (Tile<T>::R * (HD_MAX + 1))

// Rows [r0, r0 + R) of one head into a R x hd tile, zeros past the sequence's end. A tile's
// rows lie hd + 1 apart: threads that each read their own row (a dot product with row c of K or
// V) then hit different shared-memory banks, where a stride of 64 words would put a warp's 32
// reads in one bank.
template <typename T>
__device__ void load_tile(T* __restrict__ dst, const T* __restrict__ src, long long ld,
                          long long r0, long long t, long long hd) {
  const int R = Tile<T>::R;
  for (long long e = threadIdx.x; e < R * hd; e += BLOCK) {
    const long long r = e / hd, c = e % hd;
    dst[r * (hd + 1) + c] = r0 + r < t ? src[(r0 + r) * ld + c] : T(0);
  }
}

template <typename T>
__device__ T dot(const T* __restrict__ a, const T* __restrict__ b, long long hd) {
  T s = T(0);
  for (long long c = 0; c < hd; ++c) s += a[c] * b[c];
  return s;
}

// ---------------------------------------------------------------- forward

// One block per (sequence, head, query tile): o = softmax(scale q k^T, causal) v and each row's
// lse = max + log(sum). Rows past t stand in for row t - 1 (their mask) and are not written.
template <typename T>
__device__ void attn_fwd(const T* __restrict__ q, const T* __restrict__ k,
                         const T* __restrict__ v, long long ld, T* __restrict__ o, long long ldo,
                         T* __restrict__ lse, long long n, long long h, long long t, long long hd,
                         T scale) {
  const int R = Tile<T>::R;
  __shared__ T sq[TILE(T)], sk[TILE(T)], sv[TILE(T)];
  __shared__ T sp[Tile<T>::R * (Tile<T>::R + 1)];  // rows R + 1 apart: one thread per row reads
  __shared__ T sm[Tile<T>::R], sl[Tile<T>::R], salpha[Tile<T>::R];
  const long long tiles = (t + R - 1) / R, blocks = n * h * tiles, ls = hd + 1;
  for (long long blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const long long bh = blk / tiles, i0 = (blk % tiles) * R;
    const long long b = bh / h, hh = bh % h, base = b * t * ld + hh * hd;
    load_tile(sq, q + base, ld, i0, t, hd);
    T acc[NACC(T)];
    for (int a = 0; a < NACC(T); ++a) acc[a] = T(0);
    const long long last = (i0 + R < t ? i0 + R : t) - 1;  // the tile's last real query
    for (long long j0 = 0; j0 <= last; j0 += R) {
      load_tile(sk, k + base, ld, j0, t, hd);
      load_tile(sv, v + base, ld, j0, t, hd);
      __syncthreads();
      for (int e = threadIdx.x; e < R * R; e += BLOCK)
        sp[(e / R) * (R + 1) + e % R] = scale * dot(sq + (e / R) * ls, sk + (e % R) * ls, hd);
      __syncthreads();
      if (threadIdx.x < R) {
        const int r = threadIdx.x;
        const long long i = i0 + r < t ? i0 + r : t - 1;
        const long long valid = i - j0 + 1 < R ? i - j0 + 1 : R;  // keys j0 .. i of this tile
        T* p = sp + r * (R + 1);
        if (valid <= 0) {
          salpha[r] = T(1);
          for (int c = 0; c < R; ++c) p[c] = T(0);
        } else {
          T m = p[0];
          for (int c = 1; c < valid; ++c) m = p[c] > m ? p[c] : m;
          if (j0 > 0 && sm[r] > m) m = sm[r];
          T s = T(0);
          for (int c = 0; c < R; ++c) {
            p[c] = c < valid ? k_exp(p[c] - m) : T(0);
            s += p[c];
          }
          const T alpha = j0 > 0 ? k_exp(sm[r] - m) : T(0);
          sl[r] = j0 > 0 ? alpha * sl[r] + s : s;
          sm[r] = m;
          salpha[r] = alpha;
        }
      }
      __syncthreads();
      for (int a = 0; a < NACC(T); ++a) {
        const long long e = threadIdx.x + (long long)a * BLOCK;
        if (e >= R * hd) break;
        const long long r = e / hd, c = e % hd;
        T s = T(0);
        for (int x = 0; x < R; ++x) s += sp[r * (R + 1) + x] * sv[x * ls + c];
        acc[a] = acc[a] * salpha[r] + s;
      }
      __syncthreads();
    }
    for (int a = 0; a < NACC(T); ++a) {
      const long long e = threadIdx.x + (long long)a * BLOCK;
      if (e >= R * hd) break;
      const long long r = e / hd, c = e % hd;
      if (i0 + r < t) o[(b * t + i0 + r) * ldo + hh * hd + c] = acc[a] / sl[r];
    }
    if (threadIdx.x < R && i0 + threadIdx.x < t)
      lse[bh * t + i0 + threadIdx.x] = sm[threadIdx.x] + k_log(sl[threadIdx.x]);
    __syncthreads();  // sm and sl are the next tile's
  }
}

// ---------------------------------------------------------------- backward

// delta[bh, i] = <do_i, o_i>, the softmax backward's row sum, one thread per row.
template <typename T>
__device__ void attn_bwd_delta(const T* __restrict__ dout, const T* __restrict__ o,
                               long long ldo, T* __restrict__ delta, long long n, long long h,
                               long long t, long long hd) {
  for (long long x = (long long)blockIdx.x * blockDim.x + threadIdx.x; x < n * h * t;
       x += (long long)gridDim.x * blockDim.x) {
    const long long bh = x / t, i = x % t, b = bh / h, hh = bh % h;
    const long long off = (b * t + i) * ldo + hh * hd;
    delta[x] = dot(dout + off, o + off, hd);
  }
}

// The probabilities and score gradients of a query tile (rows i0..) against a key tile (j0..):
// p = exp(scale q k^T - lse), ds = p (do v^T - delta), both 0 where j > i or past t.
template <typename T>
__device__ void attn_scores_bwd(const T* sq, const T* sk, const T* sv, const T* sdo,
                                const T* slse, const T* sdelta, T* sp, T* sds, long long i0,
                                long long j0, long long t, long long hd, T scale) {
  const int R = Tile<T>::R;
  const long long ls = hd + 1;
  for (int e = threadIdx.x; e < R * R; e += BLOCK) {
    const int r = e / R, c = e % R;
    const long long i = i0 + r, j = j0 + c;
    if (j <= i && i < t) {
      const T p = k_exp(scale * dot(sq + r * ls, sk + c * ls, hd) - slse[r]);
      sp[e] = p;
      sds[e] = p * (dot(sdo + r * ls, sv + c * ls, hd) - sdelta[r]);
    } else {
      sp[e] = T(0);
      sds[e] = T(0);
    }
  }
}

template <typename T>
__device__ void load_rows(T* __restrict__ dst, const T* __restrict__ src, long long i0,
                          long long t) {
  if (threadIdx.x < Tile<T>::R)
    dst[threadIdx.x] = i0 + threadIdx.x < t ? src[i0 + threadIdx.x] : T(0);
}

// One block per (sequence, head, query tile): dq = scale ds k over the key tiles up to the
// diagonal, in order.
template <typename T>
__device__ void attn_bwd_dq(const T* __restrict__ q, const T* __restrict__ k,
                            const T* __restrict__ v, long long ld, const T* __restrict__ dout,
                            long long ldo, const T* __restrict__ lse,
                            const T* __restrict__ delta, T* __restrict__ dq, long long ldd,
                            long long n, long long h, long long t, long long hd, T scale) {
  const int R = Tile<T>::R;
  __shared__ T sq[TILE(T)], sk[TILE(T)], sv[TILE(T)];
  __shared__ T sdo[TILE(T)], sp[Tile<T>::R * Tile<T>::R];
  __shared__ T sds[Tile<T>::R * Tile<T>::R], slse[Tile<T>::R], sdelta[Tile<T>::R];
  const long long tiles = (t + R - 1) / R, blocks = n * h * tiles, ls = hd + 1;
  for (long long blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const long long bh = blk / tiles, i0 = (blk % tiles) * R;
    const long long b = bh / h, hh = bh % h, base = b * t * ld + hh * hd;
    load_tile(sq, q + base, ld, i0, t, hd);
    load_tile(sdo, dout + b * t * ldo + hh * hd, ldo, i0, t, hd);
    load_rows(slse, lse + bh * t, i0, t);
    load_rows(sdelta, delta + bh * t, i0, t);
    T acc[NACC(T)];
    for (int a = 0; a < NACC(T); ++a) acc[a] = T(0);
    const long long last = (i0 + R < t ? i0 + R : t) - 1;
    for (long long j0 = 0; j0 <= last; j0 += R) {
      load_tile(sk, k + base, ld, j0, t, hd);
      load_tile(sv, v + base, ld, j0, t, hd);
      __syncthreads();
      attn_scores_bwd(sq, sk, sv, sdo, slse, sdelta, sp, sds, i0, j0, t, hd, scale);
      __syncthreads();
      for (int a = 0; a < NACC(T); ++a) {
        const long long e = threadIdx.x + (long long)a * BLOCK;
        if (e >= R * hd) break;
        const long long r = e / hd, c = e % hd;
        T s = T(0);
        for (int x = 0; x < R; ++x) s += sds[r * R + x] * sk[x * ls + c];
        acc[a] += s;
      }
      __syncthreads();
    }
    for (int a = 0; a < NACC(T); ++a) {
      const long long e = threadIdx.x + (long long)a * BLOCK;
      if (e >= R * hd) break;
      const long long r = e / hd, c = e % hd;
      if (i0 + r < t) dq[(b * t + i0 + r) * ldd + hh * hd + c] = scale * acc[a];
    }
  }
}

// One block per (sequence, head, key tile): dv = p^T do and dk = scale ds^T q over the query
// tiles from the diagonal on, in order.
template <typename T>
__device__ void attn_bwd_dkv(const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, long long ld, const T* __restrict__ dout,
                             long long ldo, const T* __restrict__ lse,
                             const T* __restrict__ delta, T* __restrict__ dk,
                             T* __restrict__ dv, long long ldd, long long n, long long h,
                             long long t, long long hd, T scale) {
  const int R = Tile<T>::R;
  __shared__ T sq[TILE(T)], sk[TILE(T)], sv[TILE(T)];
  __shared__ T sdo[TILE(T)], sp[Tile<T>::R * Tile<T>::R];
  __shared__ T sds[Tile<T>::R * Tile<T>::R], slse[Tile<T>::R], sdelta[Tile<T>::R];
  const long long tiles = (t + R - 1) / R, blocks = n * h * tiles, ls = hd + 1;
  for (long long blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const long long bh = blk / tiles, j0 = (blk % tiles) * R;
    const long long b = bh / h, hh = bh % h, base = b * t * ld + hh * hd;
    load_tile(sk, k + base, ld, j0, t, hd);
    load_tile(sv, v + base, ld, j0, t, hd);
    T ak[NACC(T)], av[NACC(T)];
    for (int a = 0; a < NACC(T); ++a) ak[a] = av[a] = T(0);
    for (long long i0 = j0; i0 < t; i0 += R) {  // tiles align: the diagonal tile starts at j0
      load_tile(sq, q + base, ld, i0, t, hd);
      load_tile(sdo, dout + b * t * ldo + hh * hd, ldo, i0, t, hd);
      load_rows(slse, lse + bh * t, i0, t);
      load_rows(sdelta, delta + bh * t, i0, t);
      __syncthreads();
      attn_scores_bwd(sq, sk, sv, sdo, slse, sdelta, sp, sds, i0, j0, t, hd, scale);
      __syncthreads();
      for (int a = 0; a < NACC(T); ++a) {
        const long long e = threadIdx.x + (long long)a * BLOCK;
        if (e >= R * hd) break;
        const long long c = e / hd, x = e % hd;
        T sv_ = T(0), sk_ = T(0);
        for (int r = 0; r < R; ++r) {
          sv_ += sp[r * R + c] * sdo[r * ls + x];
          sk_ += sds[r * R + c] * sq[r * ls + x];
        }
        av[a] += sv_;
        ak[a] += sk_;
      }
      __syncthreads();
    }
    for (int a = 0; a < NACC(T); ++a) {
      const long long e = threadIdx.x + (long long)a * BLOCK;
      if (e >= R * hd) break;
      const long long c = e / hd, x = e % hd;
      if (j0 + c < t) {
        const long long off = (b * t + j0 + c) * ldd + hh * hd + x;
        dk[off] = scale * ak[a];
        dv[off] = av[a];
      }
    }
    __syncthreads();  // sk and sv are the next tile's
  }
}

#define ENTRY_POINTS(T, SUF)                                                                    \
  extern "C" __global__ void attn_fwd_##SUF(const T* q, const T* k, const T* v, long long ld,    \
                                            T* o, long long ldo, T* lse, long long n,           \
                                            long long h, long long t, long long hd, T scale) {  \
    attn_fwd<T>(q, k, v, ld, o, ldo, lse, n, h, t, hd, scale);                                  \
  }                                                                                             \
  extern "C" __global__ void attn_bwd_delta_##SUF(const T* dout, const T* o, long long ldo,     \
                                                  T* delta, long long n, long long h,           \
                                                  long long t, long long hd) {                  \
    attn_bwd_delta<T>(dout, o, ldo, delta, n, h, t, hd);                                        \
  }                                                                                             \
  extern "C" __global__ void attn_bwd_dq_##SUF(                                                 \
      const T* q, const T* k, const T* v, long long ld, const T* dout, long long ldo,           \
      const T* lse, const T* delta, T* dq, long long ldd, long long n, long long h,             \
      long long t, long long hd, T scale) {                                                     \
    attn_bwd_dq<T>(q, k, v, ld, dout, ldo, lse, delta, dq, ldd, n, h, t, hd, scale);            \
  }                                                                                             \
  extern "C" __global__ void attn_bwd_dkv_##SUF(                                                \
      const T* q, const T* k, const T* v, long long ld, const T* dout, long long ldo,           \
      const T* lse, const T* delta, T* dk, T* dv, long long ldd, long long n, long long h,      \
      long long t, long long hd, T scale) {                                                     \
    attn_bwd_dkv<T>(q, k, v, ld, dout, ldo, lse, delta, dk, dv, ldd, n, h, t, hd, scale);       \
  }

ENTRY_POINTS(float, f32)
ENTRY_POINTS(double, f64)
