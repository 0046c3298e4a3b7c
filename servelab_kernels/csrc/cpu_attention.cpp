// Paged decode attention for the CPU: see servelab_kernels/cpu_attention.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

template <typename KV>
static void decode_kernel(const float* q, const KV* kc, const KV* vc, const at::Half* ks, const at::Half* vs,
                          const int64_t* tables, const int64_t* ctx_lens, float* out, int64_t B, int64_t H,
                          int64_t KVH, int64_t BS, int64_t D, int64_t W, int64_t stride_blk, float scale) {
  const int64_t G = H / KVH;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    // per task: the query rows, the running max / sum / output of each, and one block of K and V in fp32
    std::vector<float> qf(G * D), acc(G * D), m(G), l(G), s(G * BS), kf(BS * D), vf(BS * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t ctx = ctx_lens[b];
      for (int64_t g = 0; g < G; ++g) {
        const float* qrow = q + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = qrow[d] * scale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < ctx; start += BS) {
        const int64_t blk = tables[b * W + start / BS];
        const int64_t n = std::min(BS, ctx - start);
        const KV* kb = kc + blk * stride_blk + h * BS * D;  // head-major block: n rows of D, contiguous
        const KV* vb = vc + blk * stride_blk + h * BS * D;
        for (int64_t i = 0; i < n * D; ++i) kf[i] = to_f(kb[i]);  // read each block once, widened once
        for (int64_t i = 0; i < n * D; ++i) vf[i] = to_f(vb[i]);
        if (ks) {
          for (int64_t t = 0; t < n; ++t) {
            const float kscale = static_cast<float>(ks[(blk * KVH + h) * BS + t]);
            const float vscale = static_cast<float>(vs[(blk * KVH + h) * BS + t]);
            for (int64_t d = 0; d < D; ++d) { kf[t * D + d] *= kscale; vf[t * D + d] *= vscale; }
          }
        }
        for (int64_t t = 0; t < n; ++t) {  // every query head against each key row, read once
          const float* kr = kf.data() + t * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
            s[g * BS + t] = dot;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * BS;
          float bmax = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) bmax = std::max(bmax, sg[t]);
          const float mnew = std::max(m[g], bmax);
          const float alpha = std::exp(m[g] - mnew);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {  // a loop of its own, so the exponentials vectorize
            sg[t] = std::exp(sg[t] - mnew);
            sum += sg[t];
          }
          l[g] = l[g] * alpha + sum;
          m[g] = mnew;
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        }
        for (int64_t t = 0; t < n; ++t) {  // each value row, read once, into every head's output
          const float* vr = vf.data() + t * D;
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * BS + t];
            float* a = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = out + (b * H + h * G + g) * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}

#if defined(__AVX512F__) && !defined(SERVELAB_PORTABLE)
#define SERVELAB_AVX512 1
#include <immintrin.h>
// The vector path: 16 fp32 lanes; head_dim a multiple of 16; key rows in tiles of 16 tokens.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512 exp16(__m512 x) {  // exp on [-87, 0]: 2^n * p(r), |r| <= ln2 / 2, error ~1e-7
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Sixteen dot-product vectors in, one vector of their sixteen sums out (lane t = sum of v[t]): a
// tree of shuffles and adds, about three instructions per sum instead of a full reduction each.
static inline __m512 hsum16(__m512* v) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)  // halves of 256 bits: v[2k] into 128-bit chunks 0-1, v[2k+1] into 2-3
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int j = 0; j < 4; ++j)  // chunk c of x[j] holds v[4j + c]'s four partial sums
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4c + p now holds v[4p + c]: one permute restores the order
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, z);
}

#if defined(__AVX512BF16__)
// P.V as bf16 pair products (P rounded to bf16, as flash attention's P.V GEMM does): value rows t
// and t+1 interleaved word by word (row1 null past a tile's end) give each lane a (v[t][d],
// v[t+1][d]) pair, so the rows are never widened. pair[2c] / pair[2c+1] cover d = 32c..32c+31 in
// unpack order: 128-bit chunk i of (lo, hi) holds d = 8i..8i+3 and 8i+4..8i+7 (store_unpacked
// undoes it). NP = head_dim / 32.
template <int NP>
static inline void value_pairs(const void* row0, const void* row1, __m512i* pair) {
  for (int c = 0; c < NP; ++c) {
    const __m512i r0 = _mm512_loadu_si512(static_cast<const char*>(row0) + c * 64);
    const __m512i r1 = row1 ? _mm512_loadu_si512(static_cast<const char*>(row1) + c * 64) : _mm512_setzero_si512();
    pair[2 * c] = _mm512_unpacklo_epi16(r0, r1);
    pair[2 * c + 1] = _mm512_unpackhi_epi16(r0, r1);
  }
}

// Accumulators in value_pairs' unpack order, times `inv`, stored to o[0..32 NP) in d order.
template <int NP>
static inline void store_unpacked(float* o, const __m512* acc, __m512 inv) {
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int c = 0; c < NP; ++c) {
    _mm512_storeu_ps(o + c * 32, _mm512_mul_ps(_mm512_permutex2var_ps(acc[2 * c], first, acc[2 * c + 1]), inv));
    _mm512_storeu_ps(o + c * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(acc[2 * c], second, acc[2 * c + 1]), inv));
  }
}
#endif

template <typename KV, int ND, int GT>  // ND = head_dim / 16; GT = query heads per KV head, 0 = known at run time
static void decode_kernel_avx512(const float* q, const KV* kc, const KV* vc, const at::Half* ks, const at::Half* vs,
                                 const int64_t* tables, const int64_t* ctx_lens, float* out, int64_t B, int64_t H,
                                 int64_t KVH, int64_t BS, int64_t W, int64_t stride_blk, float scale) {
  constexpr int64_t D = ND * 16;
  constexpr bool scaled = std::is_same<KV, int8_t>::value;  // the INT8 cache carries a scale per token
#if defined(__AVX512BF16__)
  constexpr bool bf16_dot = std::is_same<KV, at::BFloat16>::value;  // q.k as bf16 pair products, K never widened
#else
  constexpr bool bf16_dot = false;
#endif
  const int64_t G = GT > 0 ? GT : H / KVH;  // a compile-time group lets the accumulators live in registers
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    __m512 qv[16 * ND], acc[16 * ND], dots[16];
#if defined(__AVX512BF16__)
    __m512bh qbh[16 * ND / 2 + 1];
#endif
    alignas(64) float kf[16 * D];  // one tile of keys widened to fp32 (when not read as bf16 pairs)
    alignas(64) float s[16 * 16];  // the tile's probabilities, one row of 16 per query head (G <= 16)
    float m[16], l[16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t ctx = ctx_lens[b];
      for (int64_t g = 0; g < G; ++g) {
        const float* qrow = q + (b * H + h * G + g) * D;
        for (int c = 0; c < ND; ++c) {
          // bf16 queries are exact in bf16, so the scale is applied to the scores instead
          qv[g * ND + c] = bf16_dot ? _mm512_loadu_ps(qrow + c * 16)
                                    : _mm512_mul_ps(_mm512_loadu_ps(qrow + c * 16), _mm512_set1_ps(scale));
          acc[g * ND + c] = _mm512_setzero_ps();
        }
#if defined(__AVX512BF16__)
        for (int c = 0; c < ND / 2; ++c) qbh[g * ND / 2 + c] = _mm512_cvtne2ps_pbh(qv[g * ND + 2 * c + 1], qv[g * ND + 2 * c]);
#endif
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      for (int64_t start = 0; start < ctx; start += BS) {
        const int64_t blk = tables[b * W + start / BS];
        const int64_t nblk = std::min(BS, ctx - start);
        const KV* kb = kc + blk * stride_blk + h * BS * D;  // head-major block: rows of D, contiguous
        const KV* vb = vc + blk * stride_blk + h * BS * D;
        const at::Half* ksb = scaled ? ks + (blk * KVH + h) * BS : nullptr;
        const at::Half* vsb = scaled ? vs + (blk * KVH + h) * BS : nullptr;
        if (start + 2 * BS < ctx) {  // blocks are scattered: fetch the one after next while this one computes
          const int64_t next = tables[b * W + start / BS + 2] * stride_blk + h * BS * D;
          const int64_t bytes = std::min(BS, ctx - start - 2 * BS) * D * static_cast<int64_t>(sizeof(KV));
          for (int64_t off = 0; off < bytes; off += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(kc + next) + off, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(vc + next) + off, _MM_HINT_T0);
          }
        }
        for (int64_t t0 = 0; t0 < nblk; t0 += 16) {
          const int n = static_cast<int>(std::min<int64_t>(16, nblk - t0));
          const KV* kt = kb + t0 * D;
          if (!bf16_dot) {  // widen (and for INT8 dequantize) the tile's keys once for every query head
            for (int t = 0; t < n; ++t) {
              const __m512 ksc = _mm512_set1_ps(scaled ? static_cast<float>(ksb[t0 + t]) : 1.f);
              for (int c = 0; c < ND; ++c) {
                const __m512 k = load16(kt + t * D + c * 16);
                _mm512_store_ps(kf + t * D + c * 16, scaled ? _mm512_mul_ps(k, ksc) : k);
              }
            }
          }
          const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
          for (int64_t g = 0; g < G; ++g) {
            for (int t = 0; t < 16; ++t) dots[t] = _mm512_setzero_ps();
            // a row's q.k: bf16 pairs straight from the cache, or fp32 against the widened tile
            auto dot_row = [&](int t) {
              if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
                for (int c = 0; c < ND / 2; ++c)
                  dots[t] = _mm512_dpbf16_ps(dots[t], qbh[g * ND / 2 + c],
                                             (__m512bh)_mm512_loadu_si512(kt + t * D + c * 32));
#endif
              } else {
                for (int c = 0; c < ND; ++c)
                  dots[t] = _mm512_fmadd_ps(qv[g * ND + c], _mm512_load_ps(kf + t * D + c * 16), dots[t]);
              }
            };
            // a whole tile unrolled, so that the 16 sums stay in registers: a loop of run-time length
            // kept them in memory, and the kernel ran 1.6x slower on one core of a 2-core Zen 4
            if (n == 16) {
#pragma GCC unroll 16
              for (int t = 0; t < 16; ++t) dot_row(t);
            } else {
              for (int t = 0; t < n; ++t) dot_row(t);
            }
            __m512 sv = hsum16(dots);
            if (bf16_dot) sv = _mm512_mul_ps(sv, _mm512_set1_ps(scale));
            sv = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, sv);
            // online softmax over the tile, 16 lanes at once
            const float mnew = std::max(m[g], _mm512_reduce_max_ps(sv));
            const float alpha = std::exp(m[g] - mnew);
            const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
            l[g] = l[g] * alpha + _mm512_reduce_add_ps(p);
            m[g] = mnew;
            _mm512_store_ps(s + g * 16, p);
            const __m512 a = _mm512_set1_ps(alpha);
            for (int c = 0; c < ND; ++c) acc[g * ND + c] = _mm512_mul_ps(acc[g * ND + c], a);
          }
          if (bf16_dot) {
#if defined(__AVX512BF16__)
            alignas(64) uint16_t pb[16 * 16];  // P.V as pair products: see value_pairs
            for (int64_t g = 0; g < G; ++g)
              _mm256_store_si256((__m256i*)(pb + g * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(s + g * 16)));
            for (int t = 0; t < n; t += 2) {
              __m512i pair[ND];
              value_pairs<ND / 2>(vb + (t0 + t) * D, t + 1 < n ? vb + (t0 + t + 1) * D : nullptr, pair);
              for (int64_t g = 0; g < G; ++g) {
                uint32_t pp;  // (p[t], p[t+1]); p of a dead lane is 0
                std::memcpy(&pp, pb + g * 16 + t, 4);
                const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp));
                for (int c = 0; c < ND; ++c) acc[g * ND + c] = _mm512_dpbf16_ps(acc[g * ND + c], (__m512bh)pair[c], pv);
              }
            }
#endif
          } else {
          for (int t = 0; t < n; ++t) {  // each value row read once, into every head's output
            __m512 vr[ND];
            const __m512 vsc = _mm512_set1_ps(scaled ? static_cast<float>(vsb[t0 + t]) : 1.f);
            for (int c = 0; c < ND; ++c) {
              const __m512 v = load16(vb + (t0 + t) * D + c * 16);
              vr[c] = scaled ? _mm512_mul_ps(v, vsc) : v;
            }
            for (int64_t g = 0; g < G; ++g) {
              const __m512 p = _mm512_set1_ps(s[g * 16 + t]);
              for (int c = 0; c < ND; ++c) acc[g * ND + c] = _mm512_fmadd_ps(p, vr[c], acc[g * ND + c]);
            }
          }
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? 1.f / l[g] : 0.f);
        float* o = out + (b * H + h * G + g) * D;
#if defined(__AVX512BF16__)
        if (bf16_dot) {
          store_unpacked<ND / 2>(o, acc + g * ND, inv);
          continue;
        }
#endif
        for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(acc[g * ND + c], inv));
      }
    }
  });
}

#if defined(__AVX512BF16__)
// Decode over a bf16 cache in two passes per (sequence, KV head), as the AMX kernel below does, on
// AVX512-BF16 pair products: (1) every key's scores into a row per query head (a 16-key tile's q.k as
// pair products, its 16 sums gathered by hsum16); the exact softmax over the whole context,
// probabilities rounded to bf16; (2) O = P . V, two value rows interleaved into pairs (value_pairs)
// against each head's broadcast (p[t], p[t+1]), no accumulator ever rescaled. While a block computes,
// the block after next is asked for into L2 (T1), a 16-key slice per tile; past the last key block
// the same slots ask for the task's first value blocks, and the value pass's last two blocks for the
// next task's first two key blocks (ReadAhead, csrc/cpu_read_ahead.cpp, which the AVX2 kernel shares).
// Cold caches on a 2-core Zen 4 (64 x 640 tokens, blocks of 64,
// rounds alternating): 1.5-1.6x the one-pass kernel above (its T0 burst at each block's start). Without
// the prefetch the two passes ran at the one-pass kernel's speed, and the one-pass kernel with the same
// T1 hint gained 1.11x: the passes' long runs of independent products are what the early reads feed.
static bool two_pass_decode_on = true;

// One query head's exact softmax over ctx scores: the probabilities rounded to bf16 into probs, zero
// from ctx up to the next multiple of 32 (P is read in pairs and in 32-key tiles), each times its
// value's scale where vscale is given (an INT8 cache; the sum is taken before it). Returns 1 / the sum
// (0 for an empty row). Both two-pass kernels, vector and AMX, end their first pass with it.
static inline float softmax_row(const float* scores, int64_t ctx, uint16_t* probs, const float* vscale) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < ctx; t += 16) {
    const __mmask16 live = static_cast<__mmask16>(ctx - t >= 16 ? 0xFFFF : (1u << (ctx - t)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, live, scores + t));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 sum = _mm512_setzero_ps();
  const int64_t padded = (ctx + 31) / 32 * 32;
  for (int64_t t = 0; t < padded; t += 16) {
    const int64_t left = ctx - t;
    const __mmask16 live = static_cast<__mmask16>(left >= 16 ? 0xFFFF : left <= 0 ? 0 : (1u << left) - 1);
    const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + t), mx)));
    sum = _mm512_add_ps(sum, p);
    const __m512 pv = vscale ? _mm512_mul_ps(p, _mm512_maskz_loadu_ps(live, vscale + t)) : p;
    _mm256_storeu_si256((__m256i*)(probs + t), (__m256i)_mm512_cvtneps_pbh(pv));
  }
  const float l = _mm512_reduce_add_ps(sum);
  return l > 0.f ? 1.f / l : 0.f;
}

// INT8 rows (the cache's per-token scales applied outside the products) widened to bf16, exactly: 32
// values a step, into dst.
template <int NP>
static inline void int8_row_to_bf16(const int8_t* src, uint16_t* dst) {
  for (int c = 0; c < NP; ++c) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 32 * c))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(src + 32 * c + 16))));
    _mm512_store_si512(dst + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// KV = at::BFloat16, or int8_t with per-token fp16 scales (ks, vs): the int8 rows are widened to bf16
// (exact) and multiplied as bf16 pairs, a key's scale applied to its score, a value's folded into its
// probability before the rounding to bf16 (the softmax's sum taken before it).
template <typename KV, int ND, int GT>
static void decode_kernel_two_pass(const float* q, const KV* kc, const KV* vc, const at::Half* ks, const at::Half* vs,
                                   const int64_t* tables, const int64_t* ctx_lens, float* out, int64_t B, int64_t H,
                                   int64_t KVH, int64_t BS, int64_t W, int64_t stride_blk, float scale) {
  constexpr int64_t D = ND * 16, ROW = D * static_cast<int64_t>(sizeof(KV));  // a row's bytes
  constexpr bool i8 = std::is_same_v<KV, int8_t>;
  const int64_t G = GT > 0 ? GT : H / KVH;
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) max_ctx = std::max(max_ctx, ctx_lens[b]);
  const int64_t cap = (max_ctx + 31) / 32 * 32;  // a row of scores / probabilities, padded (P is read in pairs)
  const ReadAhead<KV> ahead{kc, vc, tables, ctx_lens, KVH, BS, ND * 16, W, stride_blk};
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * cap), vscale(i8 ? cap : 0);
    std::vector<uint16_t> probs(G * cap);
    __m512bh qbh[16 * ND / 2];
    __m512 dots[16];
    float inv[16];
    alignas(64) uint16_t widened[16 * D];  // an INT8 tile of keys, or two value rows, as bf16
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, ctx = ctx_lens[b];
      float* o0 = out + (b * H + h * G) * D;
      if (ctx == 0) {
        std::fill(o0, o0 + G * D, 0.f);
        continue;
      }
      for (int64_t g = 0; g < G; ++g)  // bf16 queries are exact in bf16, so the scale goes on the scores
        for (int c = 0; c < ND / 2; ++c)
          qbh[g * ND / 2 + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + (b * H + h * G + g) * D + 32 * c + 16),
                                                    _mm512_loadu_ps(q + (b * H + h * G + g) * D + 32 * c));
      const int64_t* table = tables + b * W;
      const int64_t nblk = (ctx + BS - 1) / BS;
      auto scales_of = [&](const at::Half* sc, int64_t j) { return sc + (table[j] * KVH + h) * BS; };
      // pass 1: scores
      const __m512 sc = _mm512_set1_ps(scale);
      for (int64_t j = 0; j < nblk; ++j) {
        const int64_t start = j * BS, n_keys = std::min(BS, ctx - start);
        const KV* kb = kc + table[j] * stride_blk + h * BS * D;
        const char* next = ahead.during_keys(b, h, j, nblk);
        const char* also = j == 0 && task == begin && nblk > 1 ? ahead.block(kc, b, h, 1) : nullptr;
        if constexpr (i8) ahead.scales(ks, vs, b, h, j, nblk);
        for (int64_t t0 = 0; t0 < n_keys; t0 += 16) {
          ReadAhead<KV>::slice(next, t0 * ROW, (t0 + 16) * ROW);
          ReadAhead<KV>::slice(also, t0 * ROW, (t0 + 16) * ROW);
          const int n = static_cast<int>(std::min<int64_t>(16, n_keys - t0));
          const __mmask16 live = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
          const uint16_t* kt;
          if constexpr (i8) {
            for (int t = 0; t < n; ++t) int8_row_to_bf16<ND / 2>(kb + (t0 + t) * D, widened + t * D);
            kt = widened;
          } else {
            kt = reinterpret_cast<const uint16_t*>(kb + t0 * D);
          }
          __m512 kscale = sc;
          if constexpr (i8) {
            kscale = _mm512_mul_ps(sc, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, scales_of(ks, j) + t0)));
            _mm512_mask_storeu_ps(vscale.data() + start + t0, live,
                                  _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, scales_of(vs, j) + t0)));
          }
          for (int64_t g = 0; g < G; ++g) {
            for (int t = 0; t < 16; ++t) dots[t] = _mm512_setzero_ps();
            auto dot_row = [&](int t) {
              for (int c = 0; c < ND / 2; ++c)
                dots[t] = _mm512_dpbf16_ps(dots[t], qbh[g * ND / 2 + c], (__m512bh)_mm512_loadu_si512(kt + t * D + c * 32));
            };
            if (n == 16) {
#pragma GCC unroll 16
              for (int t = 0; t < 16; ++t) dot_row(t);
            } else {
              for (int t = 0; t < n; ++t) dot_row(t);
            }
            _mm512_mask_storeu_ps(scores.data() + g * cap + start + t0, live, _mm512_mul_ps(hsum16(dots), kscale));
          }
        }
      }
      // the softmax, exact over the context
      for (int64_t g = 0; g < G; ++g)
        inv[g] = softmax_row(scores.data() + g * cap, ctx, probs.data() + g * cap, i8 ? vscale.data() : nullptr);
      // pass 2: P . V, 64 dims at a time (the accumulators of every head in registers)
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[16 * 4];
        for (int64_t i = 0; i < G * 4; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nblk; ++j) {
          const int64_t start = j * BS, n_keys = std::min(BS, ctx - start);
          const KV* vb = vc + table[j] * stride_blk + h * BS * D + d0;
          const char* next = d0 == 0 ? ahead.during_values(task, end, j, nblk) : nullptr;
          for (int64_t t = 0; t < n_keys; t += 2) {
            if (t % 16 == 0) ReadAhead<KV>::slice(next, t * ROW, (t + 16) * ROW);
            __m512i pair[4];
            const bool two = t + 1 < n_keys;
            if constexpr (i8) {
              int8_row_to_bf16<2>(vb + t * D, widened);
              if (two) int8_row_to_bf16<2>(vb + (t + 1) * D, widened + 64);
              value_pairs<2>(widened, two ? widened + 64 : nullptr, pair);
            } else {
              value_pairs<2>(vb + t * D, two ? vb + (t + 1) * D : nullptr, pair);
            }
            for (int64_t g = 0; g < G; ++g) {
              uint32_t pp;  // (p[t], p[t+1]); past the context p is 0
              std::memcpy(&pp, probs.data() + g * cap + start + t, 4);
              const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp));
              for (int c = 0; c < 4; ++c) acc[g * 4 + c] = _mm512_dpbf16_ps(acc[g * 4 + c], (__m512bh)pair[c], pv);
            }
          }
        }
        for (int64_t g = 0; g < G; ++g)
          store_unpacked<2>(o0 + g * D + d0, acc + g * 4, _mm512_set1_ps(inv[g]));
      }
    }
  });
}
#endif

template <typename KV, int ND>
static void by_group(const float* q, const KV* kc, const KV* vc, const at::Half* ks, const at::Half* vs,
                     const int64_t* tables, const int64_t* ctx_lens, float* out, int64_t B, int64_t H, int64_t KVH,
                     int64_t BS, int64_t W, int64_t stride_blk, float scale) {
  switch (H / KVH) {  // the common GQA groups get their own code (SmolLM2 3, Llama 3 4, Qwen2.5-7B 7)
    case 1: return decode_kernel_avx512<KV, ND, 1>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
    case 3: return decode_kernel_avx512<KV, ND, 3>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
    case 4: return decode_kernel_avx512<KV, ND, 4>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
    default: return decode_kernel_avx512<KV, ND, 0>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
  }
}

#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(SERVELAB_AMX_TILES)
#define SERVELAB_AMX_DECODE 1
// Decode over a bf16 cache on AMX tiles. The vector kernel above spends about 37 cycles a key per
// KV head on pair products and horizontal sums, which made it compute-bound below the read
// bandwidth (13 GB/s of cold KV against a 31 GB/s probe on a 2-core Xeon); the tiles do the same
// products in a few instructions a tile. Two passes per (sequence, KV head), so no accumulator is
// ever rescaled: (1) S^T = K . Q^T, 16 keys a tile, the keys loaded as the cache holds them (tile
// rows = keys, 32 dims a tile), the G queries as bf16 pairs, scores kept in fp32; then the exact
// softmax over the whole context (probabilities rounded to bf16, as the vector kernel's P.V is);
// (2) O = P . V, 32 keys a tile, value rows interleaved two by two into the tiles' pair layout
// (value_pairs: d in unpack order, undone by store_unpacked), 64 dims at a time in four
// accumulator tiles. Block sizes a multiple of 16, head_dim a multiple of 64, up to 16 query heads a
// KV head (amx_decode_fits).
static bool amx_decode_on = true;

// Where element d of query row r goes in Q^T as the tiles' B operand: per 32 dims a tile of 16
// rows of (row, d pair), 32 bf16 each (the decode and prefill tile kernels both pack it so).
static inline int64_t qt_slot(int64_t d, int64_t r) { return (d / 32) * 512 + ((d % 32) / 2) * 32 + r * 2 + d % 2; }

// The output tiles 0-3 (O as [rows][16 d] each, d in value_pairs' unpack order) out in d order:
// row r of them, times inv(r), to dst(r), for the first `rows` rows (both tile kernels end so).
template <typename Dst, typename Inv>
static inline void store_o_tiles(int64_t rows, Dst dst, Inv inv) {
  alignas(64) float o[4][16 * 16];
  _tile_stored(0, o[0], 64);
  _tile_stored(1, o[1], 64);
  _tile_stored(2, o[2], 64);
  _tile_stored(3, o[3], 64);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 acc[4] = {_mm512_load_ps(o[0] + r * 16), _mm512_load_ps(o[1] + r * 16),
                           _mm512_load_ps(o[2] + r * 16), _mm512_load_ps(o[3] + r * 16)};
    if constexpr (std::is_same_v<decltype(dst(r)), at::BFloat16*>) {  // rounded once, as .to(bf16) rounds
      alignas(64) float row[64];
      store_unpacked<2>(row, acc, _mm512_set1_ps(inv(r)));
      for (int c = 0; c < 4; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst(r) + c * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + c * 16)));
    } else {
      store_unpacked<2>(dst(r), acc, _mm512_set1_ps(inv(r)));
    }
  }
}

bool amx_decode_fits(int64_t G, int64_t BS, int64_t D) {
  return amx_decode_on && G <= 16 && BS % 16 == 0 && D % 64 == 0 && amx::permitted();
}

static void configure_decode_tiles(int64_t G) {
  amx::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = (t < 4 || t == 7) ? static_cast<uint8_t>(G) : 16;  // 0-3: O [G][16 d]; 7: P [G][32 keys]
    c.colsb[t] = 64;                                                 // 4: S^T [16 keys][16 q]; 5: K; 6: Q^T / V
  }
  _tile_loadconfig(&c);
}

// q and out fp32, or bf16 for a bf16 model (read and written as they are: no converted copies)
template <typename QT>
static void decode_kernel_amx(const QT* q, const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* tables,
                              const int64_t* ctx_lens, QT* out, int64_t B, int64_t H, int64_t KVH, int64_t BS,
                              int64_t D, int64_t W, int64_t stride_blk, float scale) {
  const int64_t G = H / KVH, NS = D / 32;
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) max_ctx = std::max(max_ctx, ctx_lens[b]);
  const int64_t cap = (max_ctx + 31) / 32 * 32;  // a row of scores / probabilities, padded to a P tile
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    configure_decode_tiles(G);
    std::vector<float> scores(G * cap);
    std::vector<uint16_t> probs(G * cap);
    std::vector<uint16_t> qt(NS * 16 * 32);                 // Q^T: per 32 dims, 16 rows of (q, d pair)
    alignas(64) float st[2][16 * 16];                        // S^T tiles, two chunks
    alignas(64) uint16_t vp[2][4][16 * 32];                  // 32 value rows in pair layout, 64 dims, twice
    const __m512i cols = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, ctx = ctx_lens[b];
      if (ctx == 0) {
        for (int64_t g = 0; g < G; ++g) std::fill(out + (b * H + h * G + g) * D, out + (b * H + h * G + g + 1) * D, QT(0.f));
        continue;
      }
      std::fill(qt.begin(), qt.end(), 0);
      for (int64_t g = 0; g < G; ++g) {  // bf16 queries (exact for a bf16 model); the scale goes on the scores
        const QT* qrow = q + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) {
          const at::BFloat16 x = static_cast<at::BFloat16>(qrow[d]);
          qt[qt_slot(d, g)] = x.x;
        }
      }
      const int64_t* table = tables + b * W;
      // pass 1: scores. A chunk's S^T tile goes out to st while the next chunk's products run, and is
      // read into the scores then (vector loads of a tile store still draining would wait for it)
      auto to_scores = [&](const float* tile, int64_t pos) {
        const int n = static_cast<int>(std::min<int64_t>(16, ctx - pos));
        const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
        for (int64_t g = 0; g < G; ++g)  // column g of S^T: query head g's scores of these keys
          _mm512_mask_storeu_ps(scores.data() + g * cap + pos, live,
                                _mm512_mul_ps(_mm512_i32gather_ps(cols, tile + g, 4), _mm512_set1_ps(scale)));
      };
      int64_t pending = -1;  // the key position of the chunk in st[pending_buf], not yet in the scores
      int pending_buf = 0;
      for (int64_t start = 0; start < ctx; start += BS) {
        const at::BFloat16* kb = kc + table[start / BS] * stride_blk + h * BS * D;
        // blocks are scattered, so the hardware prefetcher cannot follow them: while this block computes,
        // ask for the one after next into L2, a 16-key slice per sub-step (a burst into L1 at the block's
        // start evicted the lines in use and was 2-4 % slower per step). Past the last key block the same
        // slots fetch this task's first two value blocks, and block 0 also fetches key block 1, which the
        // previous task's tail could not name
        const int64_t nblk = (ctx + BS - 1) / BS, j = start / BS;
        const char* next = nullptr;
        if (j + 2 < nblk) next = reinterpret_cast<const char*>(kc + table[j + 2] * stride_blk + h * BS * D);
        else if (j + 2 - nblk < std::min<int64_t>(2, nblk))
          next = reinterpret_cast<const char*>(vc + table[j + 2 - nblk] * stride_blk + h * BS * D);
        const char* also = j == 0 && nblk > 1 ? reinterpret_cast<const char*>(kc + table[1] * stride_blk + h * BS * D) : nullptr;
        for (int64_t t0 = 0; t0 < BS && start + t0 < ctx; t0 += 16) {
          for (int64_t off = t0 * D * 2; off < (t0 + 16) * D * 2; off += 64) {
            if (next) _mm_prefetch(next + off, _MM_HINT_T1);
            if (also) _mm_prefetch(also + off, _MM_HINT_T1);
          }
          _tile_zero(4);
          for (int64_t s = 0; s < NS; ++s) {
            _tile_loadd(5, kb + t0 * D + s * 32, D * 2);
            _tile_loadd(6, qt.data() + s * 512, 64);
            _tile_dpbf16ps(4, 5, 6);
          }
          if (pending >= 0) to_scores(st[pending_buf], pending);
          pending_buf ^= 1;
          _tile_stored(4, st[pending_buf], 64);
          pending = start + t0;
        }
      }
      to_scores(st[pending_buf], pending);
      // the softmax, exact over the context
      float inv[16];
      for (int64_t g = 0; g < G; ++g) inv[g] = softmax_row(scores.data() + g * cap, ctx, probs.data() + g * cap, nullptr);
      // pass 2: P . V, 64 dims at a time
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        // the value pairs of keys t0... into buf (vector stores), a chunk ahead of the tiles that read
        // them: a tile load of lines still in the store buffer waits for it to drain
        auto pack_values = [&](int64_t t0, uint16_t (*buf)[16 * 32]) {
          for (int64_t r = 0; r < 16; ++r) {  // keys t0 + 2r, t0 + 2r + 1 (never across a block: BS is even)
            const int64_t t = t0 + 2 * r;
            if (t + 65 < ctx) {  // the rows two tiles on, while this one computes
              const char* ahead = reinterpret_cast<const char*>(vc + table[(t + 64) / BS] * stride_blk + h * BS * D +
                                                                ((t + 64) % BS) * D + d0);
              _mm_prefetch(ahead, _MM_HINT_T0);
              _mm_prefetch(ahead + 64, _MM_HINT_T0);
              _mm_prefetch(ahead + D * 2, _MM_HINT_T0);
              _mm_prefetch(ahead + D * 2 + 64, _MM_HINT_T0);
            } else if (d0 == 0 && task + 1 < end && t + 64 - ctx < BS) {  // the next task's first keys, into L2
              const int64_t u = std::max<int64_t>(t + 64 - ctx, 0), nb = (task + 1) / KVH, nh = (task + 1) % KVH;
              if (u < ctx_lens[nb]) {
                const char* ahead = reinterpret_cast<const char*>(kc + tables[nb * W + u / BS] * stride_blk + nh * BS * D + (u % BS) * D);
                _mm_prefetch(ahead, _MM_HINT_T1);
                _mm_prefetch(ahead + 64, _MM_HINT_T1);
                _mm_prefetch(ahead + D * 2, _MM_HINT_T1);
                _mm_prefetch(ahead + D * 2 + 64, _MM_HINT_T1);
              }
            }
            __m512i pair[4];
            if (t < ctx) {
              const at::BFloat16* row = vc + table[t / BS] * stride_blk + h * BS * D + (t % BS) * D + d0;
              value_pairs<2>(row, t + 1 < ctx ? row + D : nullptr, pair);
            } else {
              for (auto& p : pair) p = _mm512_setzero_si512();
            }
            for (int c = 0; c < 4; ++c) _mm512_store_si512(buf[c] + r * 32, pair[c]);
          }
        };
        pack_values(0, vp[0]);
        for (int64_t t0 = 0, i = 0; t0 < ctx; t0 += 32, ++i) {
          uint16_t (*cur)[16 * 32] = vp[i & 1];
          if (t0 + 32 < ctx) pack_values(t0 + 32, vp[(i + 1) & 1]);
          _tile_loadd(7, probs.data() + t0, cap * 2);
          _tile_loadd(6, cur[0], 64);
          _tile_dpbf16ps(0, 7, 6);
          _tile_loadd(6, cur[1], 64);
          _tile_dpbf16ps(1, 7, 6);
          _tile_loadd(6, cur[2], 64);
          _tile_dpbf16ps(2, 7, 6);
          _tile_loadd(6, cur[3], 64);
          _tile_dpbf16ps(3, 7, 6);
        }
        store_o_tiles(G, [&](int64_t g) { return out + (b * H + h * G + g) * D + d0; }, [&](int64_t g) { return inv[g]; });
      }
    }
    _tile_release();
  });
}
#endif
#endif

template <typename KV>
static void dispatch(const float* q, const KV* kc, const KV* vc, const at::Half* ks, const at::Half* vs,
                     const int64_t* tables, const int64_t* ctx_lens, float* out, int64_t B, int64_t H, int64_t KVH,
                     int64_t BS, int64_t D, int64_t W, int64_t stride_blk, float scale) {
#if defined(SERVELAB_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<KV, at::BFloat16> || std::is_same_v<KV, int8_t>) {
    const bool scaled = std::is_same_v<KV, int8_t>;
    if (two_pass_decode_on && H / KVH <= 16 && BS % 2 == 0 && (D == 64 || D == 128) && (!scaled || (ks && vs))) {
      auto run = [&](auto nd) {
        constexpr int ND = decltype(nd)::value;
        switch (H / KVH) {
          case 3: return decode_kernel_two_pass<KV, ND, 3>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
          case 4: return decode_kernel_two_pass<KV, ND, 4>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
          default: return decode_kernel_two_pass<KV, ND, 0>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
        }
      };
      if (D == 64) return run(std::integral_constant<int, 4>{});
      return run(std::integral_constant<int, 8>{});
    }
  }
#endif
#if defined(SERVELAB_AVX512)
  if (H / KVH <= 16) {
    switch (D) {
      case 64: return by_group<KV, 4>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
      case 128: return by_group<KV, 8>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale);
      default: break;
    }
  }
#endif
#if defined(SERVELAB_AVX2_DECODE)
  if (decode_avx2(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, D, W, stride_blk, scale)) return;
#endif
  decode_kernel(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, D, W, stride_blk, scale);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale) {
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), BS = k_cache.size(2), W = tables.size(1);
  const at::Half* ks = k_scale.has_value() ? k_scale->data_ptr<at::Half>() : nullptr;
  const at::Half* vs = v_scale.has_value() ? v_scale->data_ptr<at::Half>() : nullptr;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const int64_t stride = k_cache.stride(0);
#if defined(SERVELAB_AMX_DECODE)
  if (k_cache.scalar_type() == torch::kBFloat16 && !ks && amx_decode_fits(H / KVH, BS, D)) {
    // a bf16 model's queries are read and its output written as they are (no converted copies)
    const bool bf16 = q.scalar_type() == torch::kBFloat16;
    auto qk = bf16 ? q.contiguous() : q.to(torch::kFloat32).contiguous();
    auto out = torch::empty({B, H, D}, qk.options());
    auto run = [&](auto* qp, auto* op) {
      decode_kernel_amx(qp, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), tables.data_ptr<int64_t>(),
                        lens.data_ptr<int64_t>(), op, B, H, KVH, BS, D, W, stride, scale);
    };
    if (bf16)
      run(qk.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
    else
      run(qk.data_ptr<float>(), out.data_ptr<float>());
    return out.to(q.scalar_type());
  }
#endif
  auto qf = q.to(torch::kFloat32).contiguous();
  auto out = torch::empty({B, H, D}, qf.options());
  if (k_cache.scalar_type() == torch::kBFloat16) {
    dispatch(qf.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), ks, vs,
                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, BS, D, W,
                  stride, scale);
  } else if (k_cache.scalar_type() == torch::kFloat32) {
    dispatch(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), ks, vs,
                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, BS, D, W,
                  stride, scale);
  } else if (k_cache.scalar_type() == torch::kChar) {
    dispatch(qf.data_ptr<float>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), ks, vs,
                  tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, BS, D, W,
                  stride, scale);
  } else {
    TORCH_CHECK(false, "unsupported KV cache dtype");
  }
  return out.to(q.scalar_type());
}

// Whether bf16 decode takes the AMX kernel (where it fits); set_amx_decode(false) keeps the vector
// kernel (A/B runs, tests). Returns the setting before.
bool set_amx_decode(bool on) {
#if defined(SERVELAB_AMX_DECODE)
  const bool before = amx_decode_on;
  amx_decode_on = on;
  return before;
#else
  (void)on;
  return false;
#endif
}

// Whether bf16 and INT8 decode on the vector path take the two-pass kernel; false keeps the one-pass
// (A/B runs, tests). Returns the setting before.
bool set_two_pass_decode(bool on) {
#if defined(SERVELAB_AVX512) && defined(__AVX512BF16__)
  const bool before = two_pass_decode_on;
  two_pass_decode_on = on;
  return before;
#else
  (void)on;
  return false;
#endif
}

bool amx_decode_ready() {
#if defined(SERVELAB_AMX_DECODE)
  return amx::permitted();
#else
  return false;
#endif
}

// The decode kernel's reads without its arithmetic, for the micro-benchmark's floor: every row of
// K and V a sequence's context covers, per (sequence, KV head) task through its block table, in the
// same order and on the same threads, summed as 64-bit words modulo 2^64 (a checksum the caller
// can verify, so nothing is optimized away; four sums so the adds never wait on each other). Any
// dtype whose rows are whole 32-byte multiples.
uint64_t sum_words(const uint64_t* p, int64_t n) {
  int64_t i = 0;
#if defined(SERVELAB_AVX512)
  // 512-bit loads: with four scalar sums a core added 64 bits a cycle or so, and the "floor" was the
  // loop's own speed (21 GB/s where the same rows read at 25, the bandwidth probe's rate)
  __m512i va = _mm512_setzero_si512(), vb = va, vcc = va, vd = va;
  for (; i + 32 <= n; i += 32) {
    va = _mm512_add_epi64(va, _mm512_loadu_si512(p + i));
    vb = _mm512_add_epi64(vb, _mm512_loadu_si512(p + i + 8));
    vcc = _mm512_add_epi64(vcc, _mm512_loadu_si512(p + i + 16));
    vd = _mm512_add_epi64(vd, _mm512_loadu_si512(p + i + 24));
  }
  uint64_t a = _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(va, vb), _mm512_add_epi64(vcc, vd)));
  uint64_t b = 0, c = 0, d = 0;
#else
  uint64_t a = 0, b = 0, c = 0, d = 0;
#endif
  for (; i + 4 <= n; i += 4) a += p[i], b += p[i + 1], c += p[i + 2], d += p[i + 3];
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
}

int64_t read_blocks(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                    torch::Tensor context_lens) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "read_blocks: two contiguous caches of one shape");
  const int64_t esize = k_cache.element_size(), KVH = k_cache.size(1), BS = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) * esize % 32 == 0, "read_blocks: rows of whole 32-byte multiples");
  const int64_t row_words = k_cache.size(3) * esize / 8, blk_words = k_cache.stride(0) * esize / 8;
  auto tables = block_tables.to(torch::kInt64).contiguous();
  auto lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t B = tables.size(0), W = tables.size(1);
  const uint64_t* kw = static_cast<const uint64_t*>(k_cache.data_ptr());
  const uint64_t* vw = static_cast<const uint64_t*>(v_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<uint64_t> sums(B * KVH, 0);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, ctx = lp[b];
      uint64_t acc = 0;
      for (int64_t start = 0; start < ctx; start += BS) {
        const int64_t off = tp[b * W + start / BS] * blk_words + h * BS * row_words;
        const int64_t n = std::min(BS, ctx - start) * row_words;
        acc += sum_words(kw + off, n) + sum_words(vw + off, n);
      }
      sums[task] = acc;
    }
  });
  uint64_t total = 0;
  for (uint64_t x : sums) total += x;
  return static_cast<int64_t>(total);
}

// New tokens' K and V [T, KVH, D] into a bf16 / fp32 cache [blocks, KVH, BS, D] at their flat
// slots (block * BS + offset): the twin of servelab_kernels.attention.write_kv, one call for both.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() != torch::kChar,
              "write_kv: a contiguous bf16 / fp32 cache");
  // rows of D contiguous elements are all a copy needs: the caller's views (k, v narrowed from one qkv
  // output) are read in place
  auto kc = k.to(k_cache.scalar_type()), vc = v.to(v_cache.scalar_type());
  if (kc.stride(2) != 1) kc = kc.contiguous();
  if (vc.stride(2) != 1) vc = vc.contiguous();
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t T = kc.size(0), KVH = kc.size(1), D = kc.size(2), BS = k_cache.size(2);
  const int64_t esize = kc.element_size(), stride = k_cache.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  char *kd = static_cast<char*>(k_cache.data_ptr()), *vd = static_cast<char*>(v_cache.data_ptr());
  const char *ks = static_cast<const char*>(kc.data_ptr()), *vs = static_cast<const char*>(vc.data_ptr());
  const int64_t k_row = kc.stride(0), k_head = kc.stride(1), v_row = vc.stride(0), v_head = vc.stride(1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blk = sp[t] / BS, off = sp[t] % BS;
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = (blk * stride + (h * BS + off) * D) * esize;
      std::memcpy(kd + dst, ks + (t * k_row + h * k_head) * esize, D * esize);
      std::memcpy(vd + dst, vs + (t * v_row + h * v_head) * esize, D * esize);
    }
  }
}

// A row's INT8 scale from its largest magnitude, and (quantize_row) its values into dst: exact
// divisions, as torch divides (this build's -ffast-math would otherwise multiply by a reciprocal,
// a unit off now and then).
__attribute__((optimize("no-fast-math"))) static float row_scale(float amax) { return std::max(amax / 127.0f, 1e-8f); }

__attribute__((optimize("no-fast-math"))) static float quantize_row(const float* row, int64_t D, int8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(row[d]));
  const float s = row_scale(amax);
  for (int64_t d = 0; d < D; ++d)
    dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(row[d] / s))));
  return s;
}

// New tokens' K and V [T, KVH, D] quantized into an INT8 cache and its fp16 scales [blocks, KVH, BS]:
// the twin of servelab_kernels.attention.quantize_kv, value for value (a row's scale its largest
// magnitude / 127 in fp32, at least 1e-8; each value divided by it, rounded half to even and clamped
// to +-127; the scale stored rounded to fp16).
static void write_kv_int8(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_scale.is_contiguous() && v_scale.is_contiguous() &&
                  k_scale.scalar_type() == torch::kHalf && v_scale.scalar_type() == torch::kHalf,
              "write_and_decode: an INT8 cache takes contiguous fp16 scales [blocks, kv_heads, block_size]");
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), BS = k_cache.size(2), stride = k_cache.stride(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (auto [x, cache, scales] : {std::tuple{k.to(torch::kFloat32).contiguous(), k_cache, k_scale},
                                  std::tuple{v.to(torch::kFloat32).contiguous(), v_cache, v_scale}}) {
    const float* xd = x.data_ptr<float>();
    auto* qd = cache.data_ptr<int8_t>();
    auto* sd = scales.data_ptr<at::Half>();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t blk = sp[t] / BS, off = sp[t] % BS;
      for (int64_t h = 0; h < KVH; ++h) {
        const float* row = xd + (t * KVH + h) * D;
        int8_t* dst = qd + blk * stride + (h * BS + off) * D;
#if defined(SERVELAB_AVX512)
        if (D % 16 == 0) {  // the same divisions and roundings, 16 lanes at a time
          __m512 m = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(row + d)));
          const float s = row_scale(_mm512_reduce_max_ps(m));
          const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
          for (int64_t d = 0; d < D; d += 16) {
            // the rounding-mode form of the division: -ffast-math may not turn it into a reciprocal
            const __m512 r = _mm512_roundscale_ps(
                _mm512_div_round_ps(_mm512_loadu_ps(row + d), sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d),
                             _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)))));
          }
          sd[(blk * KVH + h) * BS + off] = static_cast<at::Half>(s);
          continue;
        }
#endif
        sd[(blk * KVH + h) * BS + off] = static_cast<at::Half>(quantize_row(row, D, dst));
      }
    }
  }
}

// A decode-only step's layer in one call: the new K/V written (quantized for an INT8 cache, whose
// scales come with it), then attention over the cache.
torch::Tensor write_and_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                               torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
                               torch::Tensor context_lens, double scale, c10::optional<torch::Tensor> k_scale,
                               c10::optional<torch::Tensor> v_scale) {
  if (k_cache.scalar_type() == torch::kChar) {
    TORCH_CHECK(k_scale && v_scale, "write_and_decode: an INT8 cache needs its k_scale and v_scale");
    write_kv_int8(k, v, k_cache, v_cache, *k_scale, *v_scale, slot_mapping);
    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale);
  }
  write_kv(k, v, k_cache, v_cache, slot_mapping);
  return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, c10::nullopt, c10::nullopt);
}

// Also a torch op, for callers in C++ (csrc/cpu_decode.cpp); Python calls the module's function.
TORCH_LIBRARY(SERVELAB_NS, m) {
  m.def("write_and_decode(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, float scale, Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(SERVELAB_NS, CPU, m) {
  m.impl("write_and_decode", &write_and_decode);
}
