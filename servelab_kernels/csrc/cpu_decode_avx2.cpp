// Paged decode attention on AVX2 + FMA, for x86 CPUs without AVX-512 (Zen 2 / Zen 3, Haswell to
// Alder Lake): a prelude of csrc/cpu_attention.cpp, whose dispatch takes it before the portable loop.
//
// Two passes per (sequence, KV head), as the AVX-512 and AMX kernels do: (1) every key's score for
// each of the KV head's G query heads, 8 keys a tile (8 dot products, their sums gathered by hsum8),
// then the exact softmax over the whole context in fp32; (2) O = P . V with every head's accumulators
// for a slice of the output dims in registers, each value row read once per slice. fp32, bf16 and
// INT8 caches (per-token fp16 scales: a key's on its score, a value's folded into its probability
// after the softmax's sum) all compute in fp32, so an fp32 cache gives the reference's values to
// rounding. While a block computes, the block after next is asked for into L2, an 8-key slice per
// tile (ReadAhead, csrc/cpu_read_ahead.cpp, the AVX-512 kernel's schedule).
//
// Why it exists: the portable loop reads each block into a buffer, then computes on it with no read
// in flight, and runs at about half the KV-read floor with an fp32 cache on a 2-core Zen 3 (64
// sequences x 512 tokens: 5.4 ms a layer against read_blocks' 2.9), at a third of it with bf16 and
// a sixth with INT8 (its element-by-element conversions).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__) && !defined(SERVELAB_PORTABLE)
#define SERVELAB_AVX2_DECODE 1
#include <immintrin.h>

static bool avx2_decode_on = true;

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// exp on [-87, 0]: 2^n * p(r), |r| <= ln2 / 2, error ~1e-7 (the AVX-512 kernels' exp16 on 8 lanes; n
// >= -126 keeps 2^n a normal number built in the exponent field)
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Eight dot-product vectors in, one vector of their eight sums out (lane t = the sum of v[t]'s lanes).
static inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // lo + hi = sums 0-3
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

static inline float hadd8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Chunk c (8 lanes) of a cache row as fp32. A bf16 row is read 16 values a load: the even ones are
// its 32-bit words shifted up, the odd ones the words with their low halves masked off, so chunk 2m
// holds d = 16m, 16m+2, ..., 16m+14 and chunk 2m+1 the odd d between them. No widening pass: the
// queries are laid out in the same order (lane_dim), and the outputs put back in order at the end.
static inline __m256 row_chunk(const float* row, int c) { return _mm256_loadu_ps(row + 8 * c); }
static inline __m256 row_chunk(const at::BFloat16* row, int c) {
  const __m256i pair = _mm256_loadu_si256((const __m256i*)(row + 16 * (c / 2)));
  return _mm256_castsi256_ps(c % 2 == 0 ? _mm256_slli_epi32(pair, 16) : _mm256_and_si256(pair, _mm256_set1_epi32(-65536)));
}
static inline __m256 row_chunk(const int8_t* row, int c) { return load8(row + 8 * c); }

// The dim held by lane i of chunk c (row_chunk's order).
template <typename KV>
static inline int lane_dim(int c, int i) {
  if constexpr (std::is_same_v<KV, at::BFloat16>) return 16 * (c / 2) + 2 * i + c % 2;
  return 8 * c + i;
}

// KV = float, at::BFloat16, or int8_t with fp16 scales ks / vs; ND = head_dim / 8; G = query heads per
// KV head. Blocks hold a multiple of 8 keys (a tile never crosses one). Pass 1 keeps four chunks of a
// query in registers and reads the keys as the products' memory operands (one load per product: with
// both operands loaded the loads, not the FMAs, set the pace); an INT8 tile is widened once into a
// buffer, as every head reads it.
template <typename KV, int ND, int G>
static void decode_two_pass_avx2(const float* q, const KV* kc, const KV* vc, const at::Half* ks, const at::Half* vs,
                                 const int64_t* tables, const int64_t* ctx_lens, float* out, int64_t B, int64_t H,
                                 int64_t KVH, int64_t BS, int64_t W, int64_t stride_blk, float scale) {
  constexpr int64_t D = ND * 8, ROW = D * static_cast<int64_t>(sizeof(KV));  // a row's bytes
  constexpr bool i8 = std::is_same_v<KV, int8_t>;
  // 8-lane chunks of the output a value sweep keeps in registers: G x CH accumulators, at most 12
  constexpr int CH = G <= 3 ? 4 : G <= 6 ? 2 : 1;
  static_assert(ND % CH == 0 && ND % 4 == 0, "head_dim a multiple of the slices");
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) max_ctx = std::max(max_ctx, ctx_lens[b]);
  const int64_t cap = (max_ctx + 7) / 8 * 8;
  const ReadAhead<KV> ahead{kc, vc, tables, ctx_lens, KVH, BS, D, W, stride_blk};
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(G * cap), vscale(i8 ? cap : 0);
    alignas(32) float qs[G * D];       // the queries times the scale, in row_chunk's order
    alignas(32) float widened[8 * D];  // a tile of INT8 keys as fp32
    alignas(32) float acc[G * D];      // the outputs (row_chunk's order), a slice at a time in registers
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH, ctx = ctx_lens[b];
      float* o0 = out + (b * H + h * G) * D;
      if (ctx == 0) {
        std::fill(o0, o0 + G * D, 0.f);
        continue;
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < ND; ++c)
          for (int i = 0; i < 8; ++i) qs[g * D + 8 * c + i] = q[(b * H + h * G + g) * D + lane_dim<KV>(c, i)] * scale;
      const int64_t* table = tables + b * W;
      const int64_t nblk = (ctx + BS - 1) / BS;
      auto scales_of = [&](const at::Half* s, int64_t j) { return s + (table[j] * KVH + h) * BS; };
      // pass 1: scores
      for (int64_t j = 0; j < nblk; ++j) {
        const int64_t start = j * BS, n_keys = std::min(BS, ctx - start);
        const KV* kb = kc + table[j] * stride_blk + h * BS * D;
        const char* next = ahead.during_keys(b, h, j, nblk);
        const char* also = j == 0 && task == begin && nblk > 1 ? ahead.block(kc, b, h, 1) : nullptr;
        if constexpr (i8) ahead.scales(ks, vs, b, h, j, nblk);
        for (int64_t t0 = 0; t0 < n_keys; t0 += 8) {
          ReadAhead<KV>::slice(next, t0 * ROW, (t0 + 8) * ROW);
          ReadAhead<KV>::slice(also, t0 * ROW, (t0 + 8) * ROW);
          const int n = static_cast<int>(std::min<int64_t>(8, n_keys - t0));
          float* dst = probs.data() + start + t0;
          auto tile = [&](const auto* kt) {
            for (int g = 0; g < G; ++g) {
              __m256 dots[8];
              for (int t = 0; t < 8; ++t) dots[t] = _mm256_setzero_ps();
#pragma GCC unroll 4
              for (int c0 = 0; c0 < ND; c0 += 4) {  // unrolled, or the dots live in memory across it
                __m256 qv[4];
                for (int c = 0; c < 4; ++c) qv[c] = _mm256_load_ps(qs + g * D + 8 * (c0 + c));
                auto dot_row = [&](int t) {
                  for (int c = 0; c < 4; ++c) dots[t] = _mm256_fmadd_ps(row_chunk(kt + t * D, c0 + c), qv[c], dots[t]);
                };
                if (n == 8) {
#pragma GCC unroll 8
                  for (int t = 0; t < 8; ++t) dot_row(t);
                } else {
                  for (int t = 0; t < n; ++t) dot_row(t);
                }
              }
              __m256 s = hsum8(dots);
              if constexpr (i8) s = _mm256_mul_ps(s, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales_of(ks, j) + t0))));
              if (n == 8) {
                _mm256_storeu_ps(dst + g * cap, s);
              } else {
                alignas(32) float tmp[8];
                _mm256_store_ps(tmp, s);
                std::memcpy(dst + g * cap, tmp, n * sizeof(float));
              }
            }
          };
          if constexpr (i8) {
            for (int t = 0; t < n; ++t)
              for (int c = 0; c < ND; ++c) _mm256_store_ps(widened + t * D + 8 * c, load8(kb + (t0 + t) * D + 8 * c));
            tile(static_cast<const float*>(widened));
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales_of(vs, j) + t0))));
            std::memcpy(vscale.data() + start + t0, tmp, n * sizeof(float));
          } else {
            tile(kb + t0 * D);
          }
        }
      }
      // the softmax, exact over the context, the probabilities in place of the scores (zero past it)
      float inv[G];
      const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
      for (int g = 0; g < G; ++g) {
        float* p = probs.data() + g * cap;
        std::fill(p + ctx, p + cap, -std::numeric_limits<float>::infinity());
        __m256 vmax = neg_inf;
        for (int64_t t = 0; t < cap; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + t));
        const __m256 mx = _mm256_set1_ps(hmax8(vmax));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < cap; t += 8) {
          const __m256 x = _mm256_loadu_ps(p + t);  // past the context -inf: exp8 clamps it, the mask zeroes it
          const __m256 e = _mm256_and_ps(_mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ), exp8(_mm256_sub_ps(x, mx)));
          sum = _mm256_add_ps(sum, e);
          _mm256_storeu_ps(p + t, i8 ? _mm256_mul_ps(e, _mm256_loadu_ps(vscale.data() + t)) : e);
        }
        const float l = hadd8(sum);
        inv[g] = l > 0.f ? 1.f / l : 0.f;
      }
      // pass 2: P . V, a slice of CH x 8 dims at a time with every head's accumulators in registers
      std::fill(acc, acc + G * D, 0.f);
      for (int64_t j = 0; j < nblk; ++j) {
        const int64_t start = j * BS, n_keys = std::min(BS, ctx - start);
        const KV* vb = vc + table[j] * stride_blk + h * BS * D;
        const char* next = ahead.during_values(task, end, j, nblk);
        for (int c0 = 0; c0 < ND; c0 += CH) {
          __m256 a[G * CH];
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c) a[g * CH + c] = _mm256_load_ps(acc + g * D + 8 * (c0 + c));
          for (int64_t t = 0; t < n_keys; ++t) {
            if (c0 == 0 && t % 8 == 0) ReadAhead<KV>::slice(next, t * ROW, (t + 8) * ROW);
            __m256 p[G];
            for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(probs.data() + g * cap + start + t);
            for (int c = 0; c < CH; ++c) {
              const __m256 v = row_chunk(vb + t * D, c0 + c);
              for (int g = 0; g < G; ++g) a[g * CH + c] = _mm256_fmadd_ps(p[g], v, a[g * CH + c]);
            }
          }
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < CH; ++c) _mm256_store_ps(acc + g * D + 8 * (c0 + c), a[g * CH + c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < ND; ++c)
          for (int i = 0; i < 8; ++i) o0[g * D + lane_dim<KV>(c, i)] = acc[g * D + 8 * c + i] * inv[g];
    }
  });
}

// The AVX2 kernel where it serves (head_dim 64 or 128, up to 8 query heads a KV head, blocks of a
// multiple of 8 keys, an INT8 cache with its scales); false leaves the call to the portable loop.
template <typename KV>
static bool decode_avx2(const float* q, const KV* kc, const KV* vc, const at::Half* ks, const at::Half* vs,
                        const int64_t* tables, const int64_t* ctx_lens, float* out, int64_t B, int64_t H, int64_t KVH,
                        int64_t BS, int64_t D, int64_t W, int64_t stride_blk, float scale) {
  if (!avx2_decode_on || BS % 8 != 0 || (D != 64 && D != 128) || (std::is_same_v<KV, int8_t> && !(ks && vs))) return false;
  auto run = [&](auto nd) {
    constexpr int ND = decltype(nd)::value;
    switch (H / KVH) {
#define SERVELAB_G(g) \
  case g: decode_two_pass_avx2<KV, ND, g>(q, kc, vc, ks, vs, tables, ctx_lens, out, B, H, KVH, BS, W, stride_blk, scale); return true;
      SERVELAB_G(1) SERVELAB_G(2) SERVELAB_G(3) SERVELAB_G(4) SERVELAB_G(5) SERVELAB_G(6) SERVELAB_G(7) SERVELAB_G(8)
#undef SERVELAB_G
      default: return false;
    }
  };
  return D == 64 ? run(std::integral_constant<int, 8>{}) : run(std::integral_constant<int, 16>{});
}
#endif

// Whether decode on CPUs without AVX-512 takes the AVX2 kernel (on, the default where built) or the
// portable loop (off): for A/B runs and tests. Returns the setting before (false where not built).
bool set_avx2_decode(bool on) {
#if defined(SERVELAB_AVX2_DECODE)
  const bool before = avx2_decode_on;
  avx2_decode_on = on;
  return before;
#else
  (void)on;
  return false;
#endif
}

bool avx2_decode_built() {
#if defined(SERVELAB_AVX2_DECODE)
  return true;
#else
  return false;
#endif
}
