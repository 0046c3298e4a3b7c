// Weight-only INT4 / INT8 matmuls for few activation rows on the CPU: see servelab_kernels/cpu_quant.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(SERVELAB_PORTABLE)
#include <immintrin.h>
#define SERVELAB_VNNI 1
#define SERVELAB_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(SERVELAB_PORTABLE)
// AVX2 without VNNI (e.g. AMD Zen 2/3): the same sums from vpmaddubsw / vpmaddwd pairs
#include <immintrin.h>
#define SERVELAB_AVX2 1
#define SERVELAB_SIMD 1
#endif

#if defined(SERVELAB_VNNI) && defined(__AVX512BF16__) && defined(SERVELAB_AMX_TILES) && defined(__AMX_INT8__)
// AMX tiles (Sapphire Rapids and later, csrc/cpu_amx.cpp): the INT8 GEMM below, for any number of rows
#define SERVELAB_AMX 1
#endif

#ifndef SERVELAB_NS
#define SERVELAB_NS servelab_quant
#endif

namespace {

constexpr int64_t GROUP = 32;  // activations are quantized per 32 inputs, as the INT4 weights are

// Activations as int8 per group of 32 inputs (scale = absmax / 127, round half to even), each
// group's 32 values split in two halves of 16 so that they line up with the low and the high
// nibbles of the packed INT4 bytes. `lo`/`hi`: [M][C * 64] (zero padded to whole chunks);
// `dx`, `sx`: each group's scale and exact sum, [M][C * 4].
struct QuantizedRows {
  int64_t M, G, C;
  std::vector<int8_t> lo, hi;
  std::vector<float> dx, sx;
};

#ifdef SERVELAB_VNNI
template <typename T>
inline __m512 load16f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bf16: the upper half of a float
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
}

// One group of 32 inputs (a: 0..15, b: 16..31) as integers of at most `qmax`: its scale
// absmax / qmax to *dx, its exact sum to *sx, and each half's integers (cvtps rounds half to even,
// as nearbyint).
inline void quantize_group(__m512 a, __m512 b, float qmax, float* dx, float* sx, __m512i& qa, __m512i& qb) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 iv = _mm512_set1_ps(amax > 0.f ? qmax / amax : 0.f);
  *dx = amax / qmax;
  *sx = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv));
  qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, iv));
}

// One row's G groups as quantize_rows makes them (the same scale and rounding; the sum of a
// group added in another order).
template <typename T>
void quantize_row_avx512(const T* x, int64_t G, float* dx, float* sx, int8_t* lo, int8_t* hi) {
  for (int64_t g = 0; g < G; ++g) {
    __m512i qa, qb;
    quantize_group(load16f(x + g * GROUP), load16f(x + g * GROUP + 16), 127.f, dx + g, sx + g, qa, qb);
    // |q| <= 127, so the narrowing never saturates
    _mm_storeu_si128((__m128i*)(lo + g * 16), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(hi + g * 16), _mm512_cvtsepi32_epi8(qb));
  }
}
#endif

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  QuantizedRows r;
  r.M = M;
  r.G = K / GROUP;
  r.C = (r.G + 3) / 4;
  const int64_t width = r.C * 4;
  r.dx.assign(M * width, 0.f);
  r.sx.assign(M * width, 0.f);
  r.lo.assign(M * r.C * 64, 0);
  r.hi.assign(M * r.C * 64, 0);
  // (a parallel region costs more than a few rows take)
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
#ifdef SERVELAB_VNNI
    if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
      quantize_row_avx512(x + m * K, r.G, r.dx.data() + m * width, r.sx.data() + m * width,
                          r.lo.data() + m * r.C * 64, r.hi.data() + m * r.C * 64);
      continue;
    }
#endif
    for (int64_t g = 0; g < r.G; ++g) {
      float v[GROUP], amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < GROUP; ++i) {
        v[i] = static_cast<float>(x[m * K + g * GROUP + i]);
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      r.dx[m * width + g] = d;
      r.sx[m * width + g] = sum;
      for (int64_t i = 0; i < GROUP; ++i) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        if (i < 16) {
          r.lo[m * r.C * 64 + g * 16 + i] = q;
        } else {
          r.hi[m * r.C * 64 + g * 16 + i - 16] = q;
        }
      }
    }
  }
  });
  return r;
}

// ---- INT4: y[m, n] = sum_g d[n,g] * dx[m,g] * sum_i q[n,g,i] * xq[m,g,i] + mn[n,g] * sx[m,g] ----

template <typename OT>
void q4_rows_portable(const uint8_t* w, const at::Half* dm, const QuantizedRows& x, OT* y, int64_t N,
                      int64_t n0, int64_t n1) {
  const int64_t C = x.C, G = x.G, KH = C * 64;  // KH: packed bytes per row incl. padding
  const int64_t bytes_per_row = G * 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * bytes_per_row;
    for (int64_t m = 0; m < x.M; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t isum = 0;
        for (int64_t i = 0; i < 16; ++i) {
          const uint8_t b = wr[g * 16 + i];
          isum += (b & 15) * x.lo[m * KH + g * 16 + i] + (b >> 4) * x.hi[m * KH + g * 16 + i];
        }
        const float d = static_cast<float>(dm[(n * C + g / 4) * 8 + g % 4]);
        const float mn = static_cast<float>(dm[(n * C + g / 4) * 8 + 4 + g % 4]);
        acc += d * x.dx[m * C * 4 + g] * static_cast<float>(isum) + mn * x.sx[m * C * 4 + g];
      }
      y[m * N + n] = static_cast<OT>(acc);
    }
  }
}

#ifdef SERVELAB_VNNI
#ifndef Q4_PREFETCH
#define Q4_PREFETCH 4096
#endif
// One output row n against MR activation rows: each 64-byte chunk of the row holds 4 groups
// (bytes g*16..g*16+15: low nibbles = inputs 0..15 of group g, high nibbles = inputs 16..31), so
// two u8 x s8 dot products give each group's sum in 4 int32 lanes.
template <int MR, typename OT>
inline void q4_row(const uint8_t* wr, const at::Half* dmr, const QuantizedRows& x, const float* dxe,
                   const float* sxe, int64_t m0, OT* out, int64_t N, int64_t n) {
  const int64_t C = x.C, KH = C * 64, bytes = x.G * 16;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i idx_d = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i idx_m = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
  __m512 acc[MR];
  for (int j = 0; j < MR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const int64_t left = bytes - c * 64;
    _mm_prefetch(reinterpret_cast<const char*>(wr + c * 64) + Q4_PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dmr + c * 8) + Q4_PREFETCH / 4, _MM_HINT_T0);
    const __m512i wv = left >= 64 ? _mm512_loadu_si512(wr + c * 64)
                                  : _mm512_maskz_loadu_epi8((__mmask64)((1ULL << left) - 1), wr + c * 64);
    const __m512i lo = _mm512_and_si512(wv, low4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
    const __m512 dm8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dmr + c * 8))));
    const __m512 d = _mm512_permutexvar_ps(idx_d, dm8);
    const __m512 mn = _mm512_permutexvar_ps(idx_m, dm8);
    for (int j = 0; j < MR; ++j) {
      const int64_t m = m0 + j;
      __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x.lo.data() + m * KH + c * 64));
      s = _mm512_dpbusd_epi32(s, hi, _mm512_loadu_si512(x.hi.data() + m * KH + c * 64));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps(dxe + (m * C + c) * 16));
      acc[j] = _mm512_fmadd_ps(t, d, acc[j]);
      acc[j] = _mm512_fmadd_ps(mn, _mm512_loadu_ps(sxe + (m * C + c) * 16), acc[j]);
    }
  }
  for (int j = 0; j < MR; ++j) out[(m0 + j) * N + n] = static_cast<OT>(_mm512_reduce_add_ps(acc[j]));
}

#endif

#ifdef SERVELAB_AVX2
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// As the VNNI kernel, 32 bytes (2 groups) at a time: u8 x s8 pairs to int16 (15 * 127 * 2 for a
// nibble half, twice that for both: no saturation), then pairs of int16 to int32, 4 lanes a group.
template <int MR, typename OT>
inline void q4_row(const uint8_t* wr, const at::Half* dmr, const QuantizedRows& x, const float* dxe,
                   const float* sxe, int64_t m0, OT* out, int64_t N, int64_t n) {
  const int64_t C = x.C, KH = C * 64, bytes = x.G * 16;  // bytes: a multiple of 32 (K of 64)
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i idx_d[2] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)};
  const __m256i idx_m[2] = {_mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  __m256 acc[MR];
  for (int j = 0; j < MR; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < bytes; b += 32) {
    const int64_t c = b / 64, h = (b / 32) % 2;
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(wr + b));
    const __m256i lo = _mm256_and_si256(wv, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low4);
    const __m256 dm8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dmr + c * 8)));
    const __m256 d = _mm256_permutevar8x32_ps(dm8, idx_d[h]);
    const __m256 mn = _mm256_permutevar8x32_ps(dm8, idx_m[h]);
    for (int j = 0; j < MR; ++j) {
      const int64_t m = m0 + j;
      const __m256i p = _mm256_add_epi16(
          _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(x.lo.data() + m * KH + b))),
          _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(x.hi.data() + m * KH + b))));
      const __m256i s = _mm256_madd_epi16(p, ones);
      const int64_t e = (m * C + c) * 16 + h * 8;
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_loadu_ps(dxe + e));
      acc[j] = _mm256_fmadd_ps(t, d, acc[j]);
      acc[j] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(sxe + e), acc[j]);
    }
  }
  for (int j = 0; j < MR; ++j) out[(m0 + j) * N + n] = static_cast<OT>(hsum8(acc[j]));
}
#endif

#ifdef SERVELAB_SIMD
// Each group's activation scale and sum spread over its 4 lanes (the sum divided by 4, as the
// 4 lanes of a group are added at the end).
void spread(const QuantizedRows& x, std::vector<float>& dxe, std::vector<float>& sxe) {
  dxe.assign(x.M * x.C * 16, 0.f);
  sxe.assign(x.M * x.C * 16, 0.f);
  for (int64_t m = 0; m < x.M; ++m)
    for (int64_t c = 0; c < x.C; ++c)
      for (int64_t l = 0; l < 16; ++l) {
        dxe[(m * x.C + c) * 16 + l] = x.dx[m * x.C * 4 + c * 4 + l / 4];
        sxe[(m * x.C + c) * 16 + l] = x.sx[m * x.C * 4 + c * 4 + l / 4] / 4.f;
      }
}
#endif

// The output in the activations' dtype (T), written as each sum is done.
template <typename T>
torch::Tensor q4_linear_impl(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& dm) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto xc = x.contiguous();
  const QuantizedRows xq = quantize_rows(xc.data_ptr<T>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dmp = dm.data_ptr<at::Half>();
  T* yp = y.data_ptr<T>();
#ifdef SERVELAB_SIMD
  std::vector<float> dxe, sxe;
  spread(xq, dxe, sxe);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = wp + n * xq.G * 16;
      const at::Half* dmr = dmp + n * xq.C * 8;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) q4_row<4>(wr, dmr, xq, dxe.data(), sxe.data(), m, yp, N, n);
      switch (M - m) {
        case 3: q4_row<3>(wr, dmr, xq, dxe.data(), sxe.data(), m, yp, N, n); break;
        case 2: q4_row<2>(wr, dmr, xq, dxe.data(), sxe.data(), m, yp, N, n); break;
        case 1: q4_row<1>(wr, dmr, xq, dxe.data(), sxe.data(), m, yp, N, n); break;
        default: break;
      }
    }
  });
#else
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { q4_rows_portable(wp, dmp, xq, yp, N, n0, n1); });
#endif
  return y;
}

// ---- INT8, one scale per output row: y[m, n] = s[n] * dx[m] * sum_k w[n,k] * xq[m,k] ----------
// The activations as 14-bit integers with one scale per row (absmax / 8191): finer than bf16 for
// a row's large values, which per-group int8 would round to 1/127 of an outlier group's
// absmax (0.3 logits off on SmolLM2's head). Sums are exact in int32 over blocks of KB inputs
// (KB * 127 * 8191 < 2^31), then added in float.
// `levels` below Q16 (W8A8: 127) rounds the activations coarser, to signed integers of that many
// levels a side, with the same kernels: the sums stay exact, so every path gives the same numbers.

constexpr int64_t Q16 = 8191, KB = 2048;

#ifdef SERVELAB_AVX2
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// quantize_rows16's row on AVX2 (K a multiple of 8): the same amax, inverse and rounding (cvtps under
// MXCSR rounds to nearest even, as nearbyint), so the same integers.
template <typename T>
inline void quantize_row16_avx2(const T* xr, int64_t K, int64_t levels, int16_t* out, float& dx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8f(xr + k)));
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  const float amax = *std::max_element(lanes, lanes + 8);
  const float inv = amax > 0.f ? static_cast<float>(levels) / amax : 0.f;
  dx = amax / static_cast<float>(levels);
  const __m256 iv = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 8) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8f(xr + k), iv));
    _mm_storeu_si128((__m128i*)(out + k), _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)));
  }
}
#endif

template <typename T>
std::vector<int16_t> quantize_rows16(const T* x, int64_t M, int64_t K, std::vector<float>& dx, int64_t levels = Q16) {
  std::vector<int16_t> xq(M * K);
  dx.assign(M, 0.f);
#ifdef SERVELAB_AVX2
  if (K % 8 == 0) {
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) quantize_row16_avx2(x + m * K, K, levels, xq.data() + m * K, dx[m]);
    });
    return xq;
  }
#endif
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[m * K + k])));
    const float inv = amax > 0.f ? static_cast<float>(levels) / amax : 0.f;
    dx[m] = amax / static_cast<float>(levels);
    for (int64_t k = 0; k < K; ++k)
      xq[m * K + k] = static_cast<int16_t>(std::nearbyint(static_cast<float>(x[m * K + k]) * inv));
  }
  return xq;
}

#ifdef SERVELAB_VNNI
template <int MR, typename OT>
inline void q8_row(const int8_t* wr, const int16_t* xq, const float* dx, int64_t K, int64_t m0, float scale,
                   OT* out, int64_t N, int64_t n) {
  __m512 facc[MR];
  for (int j = 0; j < MR; ++j) facc[j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    __m512i acc[2][MR];  // even and odd steps: two dependency chains a row
    for (int j = 0; j < MR; ++j) acc[0][j] = acc[1][j] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      for (int u = 0; u < 2; ++u) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wr + k + 32 * u)));
        for (int j = 0; j < MR; ++j)
          acc[u][j] = _mm512_dpwssd_epi32(acc[u][j], w, _mm512_loadu_si512(xq + (m0 + j) * K + k + 32 * u));
      }
    }
    if (k < k1) {  // 32 left (K is a multiple of 32)
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wr + k)));
      for (int j = 0; j < MR; ++j)
        acc[0][j] = _mm512_dpwssd_epi32(acc[0][j], w, _mm512_loadu_si512(xq + (m0 + j) * K + k));
    }
    for (int j = 0; j < MR; ++j)
      facc[j] = _mm512_add_ps(facc[j], _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][j], acc[1][j])));
  }
  for (int j = 0; j < MR; ++j)
    out[(m0 + j) * N + n] = static_cast<OT>(scale * dx[m0 + j] * _mm512_reduce_add_ps(facc[j]));
}
#elif defined(SERVELAB_AVX2)
// 16 inputs a step: int8 weights widened to int16, pairs of s16 x s16 products into int32 lanes
// (exact over a block of KB inputs: 256 products a lane).
template <int MR, typename OT>
inline void q8_row(const int8_t* wr, const int16_t* xq, const float* dx, int64_t K, int64_t m0, float scale,
                   OT* out, int64_t N, int64_t n) {
  __m256 facc[MR];
  for (int j = 0; j < MR; ++j) facc[j] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    __m256i acc[2][MR];  // even and odd steps: two dependency chains a row
    for (int j = 0; j < MR; ++j) acc[0][j] = acc[1][j] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 32) {  // K is a multiple of 32
      for (int u = 0; u < 2; ++u) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wr + k + 16 * u)));
        for (int j = 0; j < MR; ++j)
          acc[u][j] = _mm256_add_epi32(acc[u][j], _mm256_madd_epi16(w, _mm256_loadu_si256(
                                                      (const __m256i*)(xq + (m0 + j) * K + k + 16 * u))));
      }
    }
    for (int j = 0; j < MR; ++j)
      facc[j] = _mm256_add_ps(facc[j], _mm256_cvtepi32_ps(_mm256_add_epi32(acc[0][j], acc[1][j])));
  }
  for (int j = 0; j < MR; ++j) out[(m0 + j) * N + n] = static_cast<OT>(scale * dx[m0 + j] * hsum8(facc[j]));
}
#endif

template <typename T>
torch::Tensor q8_linear_impl(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                             int64_t levels) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto xc = x.contiguous();
  std::vector<float> dx;
  const std::vector<int16_t> xq = quantize_rows16(xc.data_ptr<T>(), M, K, dx, levels);
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  auto sc = scales.to(torch::kFloat32).contiguous();
  const float* sp = sc.data_ptr<float>();
  T* yp = y.data_ptr<T>();
#ifdef SERVELAB_SIMD
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = wp + n * K;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) q8_row<4>(wr, xq.data(), dx.data(), K, m, sp[n], yp, N, n);
      switch (M - m) {
        case 3: q8_row<3>(wr, xq.data(), dx.data(), K, m, sp[n], yp, N, n); break;
        case 2: q8_row<2>(wr, xq.data(), dx.data(), K, m, sp[n], yp, N, n); break;
        case 1: q8_row<1>(wr, xq.data(), dx.data(), K, m, sp[n], yp, N, n); break;
        default: break;
      }
    }
  });
#else
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
          int32_t isum = 0;
          for (int64_t k = k0; k < std::min(K, k0 + KB); ++k) isum += wp[n * K + k] * xq[m * K + k];
          acc += static_cast<float>(isum);
        }
        yp[m * N + n] = static_cast<T>(sp[n] * dx[m] * acc);
      }
  });
#endif
  return y;
}

bool portable_build() {
#ifdef SERVELAB_SIMD
  return false;
#else
  return true;
#endif
}

torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& dm) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && dm.dim() == 3, "q4_linear: x [M, K], w [N, K/2], dm [N, C, 8]");
  TORCH_CHECK(x.size(1) % 64 == 0 && w.size(1) * 2 == x.size(1), "q4_linear: K must be a multiple of 64 and match w");
  TORCH_CHECK(w.is_contiguous() && dm.is_contiguous() && dm.scalar_type() == torch::kHalf && w.scalar_type() == torch::kByte,
              "q4_linear: w uint8 and dm float16, contiguous");
  if (x.scalar_type() == torch::kBFloat16) return q4_linear_impl<at::BFloat16>(x, w, dm);
  if (x.scalar_type() == torch::kFloat32) return q4_linear_impl<float>(x, w, dm);
  return q4_linear_impl<float>(x.to(torch::kFloat32), w, dm).to(x.scalar_type());
}

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t levels) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(1) % GROUP == 0,
              "q8_linear: x [M, K], w [N, K], K a multiple of 32");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kChar, "q8_linear: w int8, contiguous");
  TORCH_CHECK(levels >= 1 && levels <= Q16, "q8_linear: levels in 1..8191");
  if (x.scalar_type() == torch::kBFloat16) return q8_linear_impl<at::BFloat16>(x, w, scales, levels);
  if (x.scalar_type() == torch::kFloat32) return q8_linear_impl<float>(x, w, scales, levels);
  return q8_linear_impl<float>(x.to(torch::kFloat32), w, scales, levels).to(x.scalar_type());
}

// The INT4 weights as a dense matrix (for steps with many rows, where a bf16 GEMM wins).
template <typename T>
void q4_dequantize_rows(const uint8_t* wp, const at::Half* dmp, T* op, int64_t G, int64_t C, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t g = 0; g < G; ++g) {
      const float d = static_cast<float>(dmp[(n * C + g / 4) * 8 + g % 4]);
      const float mn = static_cast<float>(dmp[(n * C + g / 4) * 8 + 4 + g % 4]);
      const uint8_t* b = wp + n * G * 16 + g * 16;
      T* o = op + (n - n0) * G * GROUP + g * GROUP;
#if defined(SERVELAB_VNNI) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b));
        const __m512i low4 = _mm512_set1_epi32(15);
        const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), _mm512_set1_ps(d), _mm512_set1_ps(mn));
        const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), _mm512_set1_ps(d), _mm512_set1_ps(mn));
        _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(lo));
        _mm256_storeu_si256((__m256i*)(o + 16), (__m256i)_mm512_cvtneps_pbh(hi));
        continue;
      }
#endif
#ifdef SERVELAB_SIMD
      if constexpr (std::is_same_v<T, float>) {  // q * d then + m, rounded twice as the scalar loop and torch
        const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(mn);
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b + 8 * half)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          _mm256_storeu_ps(o + 8 * half, _mm256_add_ps(_mm256_mul_ps(lo, dv), mv));
          _mm256_storeu_ps(o + 16 + 8 * half, _mm256_add_ps(_mm256_mul_ps(hi, dv), mv));
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < 16; ++i) {
        o[i] = static_cast<T>((b[i] & 15) * d + mn);
        o[i + 16] = static_cast<T>((b[i] >> 4) * d + mn);
      }
    }
}

torch::Tensor q4_dequantize(const torch::Tensor& w, const torch::Tensor& dm, c10::ScalarType dtype) {
  const int64_t N = w.size(0), G = w.size(1) / 16, C = dm.size(1);
  const bool bf16 = dtype == torch::kBFloat16;
  auto out = torch::empty({N, G * GROUP}, w.options().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dmp = dm.data_ptr<at::Half>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (bf16) q4_dequantize_rows(wp, dmp, out.data_ptr<at::BFloat16>() + n0 * G * GROUP, G, C, n0, n1);
    else q4_dequantize_rows(wp, dmp, out.data_ptr<float>() + n0 * G * GROUP, G, C, n0, n1);
  });
  return out.scalar_type() == dtype ? out : out.to(dtype);
}

// ---- INT4 / INT8 weights times many fp32 rows on AVX2 FMA (CPUs without AVX-512) ----------
//
// Where fp32 is the model's dtype (no native bf16), slab_gemm wrote the whole weight dequantized to
// fp32 (4x its INT8 bytes) and read it back through at::linear, whose small-row GEMM re-lays it out:
// an INT8 step of 64 rows cost 1.1-1.2x fp32's. Now slab_gemm sends fp32 rows here (when asked: N a
// multiple of 16, K of 8): each thread dequantizes 16 weight rows at a time
// (the same roundings: the same products as slab_gemm's), lays them out as a panel of K lines of 16
// outputs in a buffer it keeps in L1/L2, and every activation row multiplies the panel there in
// csrc/cpu_fp32_tile.cpp's 6 x 16 register tiles, the ones fp32_linear runs over its packed copies.
#if defined(SERVELAB_AVX2) && defined(SERVELAB_FP32_TILES)
#define SERVELAB_FP32_PANELS 1
namespace fp32panel {

constexpr int64_t PANEL = 16;  // weight rows dequantized at a time

// dst[j][i] = src[i][j] for an 8 x 8 block (rows lds / ldd floats apart): 24 shuffles where the
// scalar loop's 64 loads and stores cost a quarter of a 64-row step's products
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

// x [M, K] fp32 (contiguous) times the N x K weight (N a multiple of 16, K of 8) that
// dequantize(out, n0, n1) writes rows [n0, n1) of, row-major.
template <typename Dequantize>
torch::Tensor gemm(const torch::Tensor& x, int64_t N, int64_t K, Dequantize dequantize) {
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / PANEL, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> rows(PANEL * K), panel(PANEL * K);
    for (int64_t p = p0; p < p1; ++p) {
      dequantize(rows.data(), p * PANEL, (p + 1) * PANEL);
      for (int64_t k = 0; k < K; k += 8)
        for (int64_t c = 0; c < PANEL; c += 8) transpose8(rows.data() + c * K + k, K, panel.data() + k * PANEL + c, PANEL);
      fp32tile::panel(panel.data(), M, K, xp, nullptr, yp + p * PANEL, N);
    }
  });
  return y;
}

}  // namespace fp32panel
#endif

// ---- INT8 weights packed once for vpmaddwd, times many rows (AVX2 without VNNI) ---------------
//
// Where the model runs fp32 on AVX2 (AMD Zen 2 / 3), the fp32 panels above multiply at the FMA
// rate: 8 products an instruction. vpmaddwd multiplies 16 int16 pairs into 8 int32 lanes, twice
// that per instruction, at the same issue rate: the GEMV's 14-bit activations (or W8A8's INT8 ones)
// times the INT8 weights widened to int16, summed exactly. The weight is laid out once
// (q8_pack_madd): per 16 outputs, K/2 lines of 16 x 2 consecutive inputs (32 bytes), so one 16-byte
// load widened by vpmovsxbw holds 8 outputs' pairs and an activation pair (one dword) is broadcast
// to them: each lane of an accumulator is one output, no horizontal sums. A register tile is 6 rows
// x 16 outputs (12 accumulators, 2 weights, 1 broadcast: the 16 registers), as fp32tile's.
// A lane's sum stays exact in int32 up to 2,064 inputs (8191 x 127 a product); longer rows are
// summed in blocks of KB inputs added in int64 and rounded to float once, as the twin's double sum is.
// The rows sweep a chunk of PC panels MB rows at a time, so the chunk's weights and the rows'
// integers both stay in L2 (8 x 24 KB and 48 x 3 KB at K = 1,536) while a panel sits in L1.
#ifdef SERVELAB_AVX2
#define SERVELAB_MADD 1
namespace q8madd {

constexpr int MR = 6;           // activation rows of a register tile
constexpr int64_t KB = 2048;    // inputs summed in int32 lanes before a block is added in int64
constexpr int64_t MB = 48;      // activation rows swept over a chunk of panels at a time
constexpr int64_t PC = 8;       // panels (of 16 outputs) a chunk

template <int R>
inline void tile(const int8_t* wp, const int16_t* a, int64_t K, int64_t k0, int64_t k1, int32_t* c) {
  __m256i lo[R], hi[R];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) lo[r] = _mm256_setzero_si256(), hi[r] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 2) {
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16 * k)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16 * k + 16)));
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * K + k, 4);
      const __m256i av = _mm256_set1_epi32(pair);
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(w0, av));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(w1, av));
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256((__m256i*)(c + 16 * r), lo[r]);
    _mm256_storeu_si256((__m256i*)(c + 16 * r + 8), hi[r]);
  }
}

inline void rows(int64_t r, const int8_t* wp, const int16_t* a, int64_t K, int64_t k0, int64_t k1, int32_t* c) {
  switch (r) {
    case 1: tile<1>(wp, a, K, k0, k1, c); break;
    case 2: tile<2>(wp, a, K, k0, k1, c); break;
    case 3: tile<3>(wp, a, K, k0, k1, c); break;
    case 4: tile<4>(wp, a, K, k0, k1, c); break;
    case 5: tile<5>(wp, a, K, k0, k1, c); break;
    default: tile<6>(wp, a, K, k0, k1, c); break;
  }
}

// y[m, n] = (float(sum) * dx[m]) * s[n], as the twin multiplies; `sums` [r][16] exact.
template <typename T>
inline void combine(const int32_t* sums, const int64_t* wide, int64_t r, const float* dx, const float* s, T* y,
                    int64_t N) {
  for (int64_t i = 0; i < r; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      if (!wide) {
        const __m256 d = _mm256_set1_ps(dx[i]);
        for (int j = 0; j < 16; j += 8) {
          const __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(sums + 16 * i + j)));
          _mm256_storeu_ps(y + i * N + j, _mm256_mul_ps(_mm256_mul_ps(v, d), _mm256_loadu_ps(s + j)));
        }
        continue;
      }
    }
    for (int j = 0; j < 16; ++j) {
      const float isum = wide ? static_cast<float>(wide[16 * i + j]) : static_cast<float>(sums[16 * i + j]);
      y[i * N + j] = static_cast<T>(isum * dx[i] * s[j]);
    }
  }
}

}  // namespace q8madd

bool madd_packable(int64_t N, int64_t K) { return N % 16 == 0 && K % 8 == 0; }

torch::Tensor q8_pack_madd(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar, "q8_pack_madd: w int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(madd_packable(N, K), "q8_pack_madd: N a multiple of 16, K of 8");
  const auto wc = w.contiguous();
  auto p = torch::empty({N / 16, K / 2, 16, 2}, w.options());
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = p.data_ptr<int8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) dst[(((n / 16) * (K / 2) + k / 2) * 16 + n % 16) * 2 + k % 2] = src[n * K + k];
  });
  return p;
}

template <typename T>
torch::Tensor q8_gemm_madd_impl(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                int64_t levels) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  std::vector<float> dx;
  const std::vector<int16_t> xq = quantize_rows16(x.data_ptr<T>(), M, K, dx, levels);
  const auto s = scales.to(torch::kFloat32).contiguous();
  const float* sp = s.data_ptr<float>();
  auto y = torch::empty({M, N}, x.options());
  T* yp = y.data_ptr<T>();
  const int8_t* wq = packed.data_ptr<int8_t>();
  const bool wide = K * levels * 127 >= (int64_t{1} << 31);
  at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) {
    int32_t sums[q8madd::MR * 16];
    int64_t total[q8madd::MR * 16];
    for (int64_t c0 = p0; c0 < p1; c0 += q8madd::PC) {
      const int64_t c1 = std::min(p1, c0 + q8madd::PC);
      for (int64_t mb = 0; mb < M; mb += q8madd::MB) {
        const int64_t me = std::min(M, mb + q8madd::MB);
        for (int64_t p = c0; p < c1; ++p) {
          const int8_t* wp = wq + p * 16 * K;
          for (int64_t m = mb; m < me; m += q8madd::MR) {
            const int64_t r = std::min<int64_t>(q8madd::MR, me - m);
            if (!wide) {
              q8madd::rows(r, wp, xq.data() + m * K, K, 0, K, sums);
              q8madd::combine<T>(sums, nullptr, r, dx.data() + m, sp + p * 16, yp + m * N + p * 16, N);
              continue;
            }
            std::fill(total, total + r * 16, int64_t{0});
            for (int64_t k0 = 0; k0 < K; k0 += q8madd::KB) {
              q8madd::rows(r, wp, xq.data() + m * K, K, k0, std::min(K, k0 + q8madd::KB), sums);
              for (int64_t i = 0; i < r * 16; ++i) total[i] += sums[i];
            }
            q8madd::combine<T>(sums, total, r, dx.data() + m, sp + p * 16, yp + m * N + p * 16, N);
          }
        }
      }
    }
  });
  return y;
}

torch::Tensor q8_gemm_madd(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                           int64_t levels) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 &&
                  x.size(1) == packed.size(1) * 2 && x.size(1) % 8 == 0 && packed.scalar_type() == torch::kChar &&
                  packed.is_contiguous(),
              "q8_gemm_madd: x [M, K], packed as q8_pack_madd lays it out");
  TORCH_CHECK(levels >= 1 && levels <= Q16, "q8_gemm_madd: levels in 1..8191");
  TORCH_CHECK(scales.numel() == packed.size(0) * 16, "q8_gemm_madd: one scale an output");
  if (x.size(0) == 0) return torch::empty({0, packed.size(0) * 16}, x.options());
  if (x.scalar_type() == torch::kFloat32) return q8_gemm_madd_impl<float>(x.contiguous(), packed, scales, levels);
  if (x.scalar_type() == torch::kBFloat16) return q8_gemm_madd_impl<at::BFloat16>(x.contiguous(), packed, scales, levels);
  return q8_gemm_madd_impl<float>(x.to(torch::kFloat32).contiguous(), packed, scales, levels).to(x.scalar_type());
}
#endif

// A weight past 2 slabs (the head: 49152 rows) is dequantized a slab at a time into one buffer
// that stays in cache: the whole of it would be a fresh 57 MB (113 MB in fp32) each call, its page
// faults and DRAM writes costing SmolLM2's head 2.6x the bf16 GEMM instead of about 1.05x.
constexpr int64_t SLAB_ROWS = 2048;

// y = x . W^T in T (x [M, K] already in T), W [N, K] made by `dequantize(out, n0, n1)`, which
// writes rows [n0, n1) to `out` (row n0 first). `panels`: fp32 rows on AVX2 take fp32panel::gemm
// where the shape allows it.
template <typename T, typename Dequantize>
torch::Tensor slab_gemm(const torch::Tensor& x, int64_t N, int64_t K, Dequantize dequantize, bool panels = false) {
#ifdef SERVELAB_FP32_PANELS
  if constexpr (std::is_same_v<T, float>) {
    if (panels && N % fp32panel::PANEL == 0 && K % 8 == 0) return fp32panel::gemm(x, N, K, dequantize);
  }
#endif
  (void)panels;
  const int64_t rows = N <= 2 * SLAB_ROWS ? N : SLAB_ROWS;
  auto slab = torch::empty({rows, K}, x.options());
  T* base = slab.data_ptr<T>();
  if (rows == N) {
    at::parallel_for(0, N, 16, [&](int64_t a, int64_t b) { dequantize(base + a * K, a, b); });
    return at::linear(x, slab);
  }
  auto y = torch::empty({x.size(0), N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t n1 = std::min(N, n0 + rows);
    at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) { dequantize(base + (a - n0) * K, a, b); });
    y.narrow(1, n0, n1 - n0).copy_(at::mm(x, slab.narrow(0, 0, n1 - n0).t()));
  }
  return y;
}

template <typename T>
torch::Tensor q4_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& dm, bool panels = false) {
  const int64_t N = w.size(0), G = w.size(1) / 16, C = dm.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dmp = dm.data_ptr<at::Half>();
  return slab_gemm<T>(x, N, G * GROUP, [&](T* out, int64_t a, int64_t b) { q4_dequantize_rows(wp, dmp, out, G, C, a, b); },
                      panels);
}

// ---- INT4 weights times many rows: a register-blocked integer GEMM --------------------------
//
// Prefill chunks and batched decodes without dequantizing the weight. The activations are finer
// than the GEMV's: 14-bit integers per group of 32 inputs (scale absmax / 8191), each split as
// hi * 128 + lo into two INT8 parts, so a group's sum is 128 * (q . hi) + (q . lo), exact in int32.
// (The GEMV's int8 per group, at every row of a prefill, cost the embedded GGUF model 9x its KL
// against fp32: 0.018 against 0.002 with the weight dequantized; at 14 bits the activations'
// rounding is 64x smaller, below bf16's.) Each lane of a `vpdpbusd` is an output row: the packed
// weight of 32 output rows is transposed by dwords once per call into a block that stays in cache
// (dword t of a row holds 4 consecutive inputs of one group in its low nibbles, 4 more in its high
// ones), each activation dword is broadcast to all lanes, and a tile of MR rows x 32 outputs keeps
// its sums in registers: no horizontal sums, the nibbles unpacked once per MR rows.
#ifdef SERVELAB_VNNI
namespace q4gemm {

constexpr int NB = 32;  // output rows per block: two vectors of 16 lanes
constexpr int MR = 3;   // activation rows per register tile (3 x 2 x 3 accumulators, of 32 registers)

// The activations, per row and group of 32: 64 bytes (the hi parts of inputs 0..15, of 16..31,
// then the lo parts of each), the group's scale d = absmax / 8191 and its inputs' exact sum.
struct SplitRows {
  int64_t M, G;
  std::vector<int8_t> parts;  // [M][G][64]
  std::vector<float> dx, sx;  // [M][G]
};

template <typename T>
void split_row(const T* x, int64_t G, float* dx, float* sx, int8_t* parts) {
  for (int64_t g = 0; g < G; ++g) {
    __m512i half[2];
    quantize_group(load16f(x + g * GROUP), load16f(x + g * GROUP + 16), static_cast<float>(Q16), dx + g, sx + g,
                   half[0], half[1]);
    int8_t* p = parts + g * 64;
    for (int h = 0; h < 2; ++h) {
      _mm_storeu_si128((__m128i*)(p + h * 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(half[h], 7)));
      _mm_storeu_si128((__m128i*)(p + 32 + h * 16), _mm512_cvtepi32_epi8(_mm512_and_si512(half[h], _mm512_set1_epi32(127))));
    }
  }
}

template <typename T>
SplitRows split_rows(const T* x, int64_t M, int64_t K) {
  SplitRows r{M, K / GROUP, {}, {}, {}};
  r.parts.resize(M * r.G * 64);
  r.dx.resize(M * r.G);
  r.sx.resize(M * r.G);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      split_row(x + m * K, r.G, r.dx.data() + m * r.G, r.sx.data() + m * r.G, r.parts.data() + m * r.G * 64);
  });
  return r;
}

// Rows [n0, n0 + NB) of the packed weight by dwords: wt[t * NB + r] = dword t of row n0 + r; each
// group's scale and offset the same way, dt / mt[g * NB + r]; rows past N zero.
inline void transpose_block(const uint8_t* w, const at::Half* dm, int64_t N, int64_t G, int64_t C, int64_t n0,
                            uint32_t* wt, float* dt, float* mt) {
  const int64_t T = G * 4, bytes = G * 16;
  for (int r = 0; r < NB; ++r) {
    const int64_t n = n0 + r;
    if (n >= N) {
      for (int64_t t = 0; t < T; ++t) wt[t * NB + r] = 0;
      for (int64_t g = 0; g < G; ++g) dt[g * NB + r] = mt[g * NB + r] = 0.f;
      continue;
    }
    const uint8_t* row = w + n * bytes;
    for (int64_t t = 0; t < T; ++t) std::memcpy(wt + t * NB + r, row + t * 4, 4);
    const at::Half* dr = dm + n * C * 8;
    for (int64_t g = 0; g < G; ++g) {
      dt[g * NB + r] = static_cast<float>(dr[(g / 4) * 8 + g % 4]);
      mt[g * NB + r] = static_cast<float>(dr[(g / 4) * 8 + 4 + g % 4]);
    }
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <typename OT>
inline void store16(OT* o, __m512 v, int valid) {
  const __mmask16 k = valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << std::max(valid, 0)) - 1);
  if constexpr (std::is_same_v<OT, float>) {
    _mm512_mask_storeu_ps(o, k, v);
  } else {
    _mm256_mask_storeu_epi16(o, k, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// y[m0 + j, n0 + v * 16 + l] for j < R: the block's two vectors of outputs against R rows.
template <int R, typename OT>
inline void tile(const uint32_t* wt, const float* dt, const float* mt, const SplitRows& x, int64_t m0, OT* y,
                 int64_t N, int64_t n0) {
  const int64_t G = x.G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R][2];
  for (int j = 0; j < R; ++j) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i sh[R][2], sl[R][2];  // the group's sums against the hi and the lo parts
    for (int j = 0; j < R; ++j) sh[j][0] = sh[j][1] = sl[j][0] = sl[j][1] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      const uint32_t* wp = wt + (g * 4 + t) * NB;
      __m512i q[2][2];  // [vector][low nibbles: inputs 4t.., high nibbles: inputs 16 + 4t..]
      for (int v = 0; v < 2; ++v) {
        const __m512i wv = _mm512_loadu_si512(wp + 16 * v);
        q[v][0] = _mm512_and_si512(wv, low4);
        q[v][1] = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low4);
      }
      for (int j = 0; j < R; ++j) {
        const int8_t* p = x.parts.data() + ((m0 + j) * G + g) * 64 + t * 4;
        const __m512i h0 = bcast4(p), h1 = bcast4(p + 16), l0 = bcast4(p + 32), l1 = bcast4(p + 48);
        for (int v = 0; v < 2; ++v) {
          sh[j][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sh[j][v], q[v][0], h0), q[v][1], h1);
          sl[j][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sl[j][v], q[v][0], l0), q[v][1], l1);
        }
      }
    }
    const __m512 d[2] = {_mm512_loadu_ps(dt + g * NB), _mm512_loadu_ps(dt + g * NB + 16)};
    const __m512 mn[2] = {_mm512_loadu_ps(mt + g * NB), _mm512_loadu_ps(mt + g * NB + 16)};
    for (int j = 0; j < R; ++j) {
      const __m512 dx = _mm512_set1_ps(x.dx[(m0 + j) * G + g]), sx = _mm512_set1_ps(x.sx[(m0 + j) * G + g]);
      for (int v = 0; v < 2; ++v) {
        const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(sh[j][v], 7), sl[j][v]);  // |isum| < 32 * 15 * 8191
        acc[j][v] = _mm512_fmadd_ps(mn[v], sx, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d[v], dx), acc[j][v]));
      }
    }
  }
  const int valid = static_cast<int>(std::min<int64_t>(NB, N - n0));
  for (int j = 0; j < R; ++j) {
    store16(y + (m0 + j) * N + n0, acc[j][0], valid);
    store16(y + (m0 + j) * N + n0 + 16, acc[j][1], valid - 16);
  }
}

}  // namespace q4gemm

template <typename T>
torch::Tensor q4_gemm_int_impl(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& dm) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / GROUP, C = dm.size(1);
  const q4gemm::SplitRows xs = q4gemm::split_rows(x.data_ptr<T>(), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dmp = dm.data_ptr<at::Half>();
  T* yp = y.data_ptr<T>();
  using namespace q4gemm;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> wt(G * 4 * NB);
    std::vector<float> dt(G * NB), mt(G * NB);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB;
      transpose_block(wp, dmp, N, G, C, n0, wt.data(), dt.data(), mt.data());
      int64_t m = 0;
      for (; m + MR <= M; m += MR) tile<MR>(wt.data(), dt.data(), mt.data(), xs, m, yp, N, n0);
      switch (M - m) {
        case 2: tile<2>(wt.data(), dt.data(), mt.data(), xs, m, yp, N, n0); break;
        case 1: tile<1>(wt.data(), dt.data(), mt.data(), xs, m, yp, N, n0); break;
        default: break;
      }
    }
  });
  return y;
}

torch::Tensor q4_gemm_int(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& dm) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && dm.dim() == 3, "q4_gemm_int: x [M, K], w [N, K/2], dm [N, C, 8]");
  TORCH_CHECK(x.size(1) % 64 == 0 && w.size(1) * 2 == x.size(1), "q4_gemm_int: K must be a multiple of 64 and match w");
  TORCH_CHECK(w.is_contiguous() && dm.is_contiguous() && dm.scalar_type() == torch::kHalf && w.scalar_type() == torch::kByte,
              "q4_gemm_int: w uint8 and dm float16, contiguous");
  if (x.scalar_type() == torch::kFloat32) return q4_gemm_int_impl<float>(x.contiguous(), w, dm);
  return q4_gemm_int_impl<at::BFloat16>(x.to(torch::kBFloat16).contiguous(), w, dm).to(x.scalar_type());
}
#endif


// One op for every path, so that a compiled graph holds no branch on the number of rows (a
// guard that would recompile it): the GEMV up to `gemv_rows` rows; else, for bf16 rows on an
// AVX512-VNNI build where `int_gemm` allows it, the integer GEMM of the GEMV's sums (q4_gemm_int);
// else, for fp32 rows on AVX2 where `int_gemm` allows it, the fp32 panels (fp32panel::gemm); else a
// GEMM over the weight dequantized for this call (bf16, or fp32 for fp32 activations: their
// precision, as q8_matmul keeps it).
torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& dm, int64_t gemv_rows,
                        bool int_gemm) {
  if (x.size(0) <= gemv_rows) return q4_linear(x, w, dm);
#ifdef SERVELAB_VNNI
  if (int_gemm && x.scalar_type() == torch::kBFloat16) return q4_gemm_int(x, w, dm);
#endif
  if (x.scalar_type() == torch::kFloat32) return q4_gemm<float>(x.contiguous(), w, dm, int_gemm);
  return q4_gemm<at::BFloat16>(x.to(torch::kBFloat16).contiguous(), w, dm).to(x.scalar_type());
}

// The INT8 weights times their row scales in T (bf16, or fp32 for fp32 activations), rows [n0, n1)
// to `op` (row n0 first), in one pass; each product is rounded once, as torch's `w.to(T) * s` rounds it.
template <typename T>
void q8_dequantize_rows(const int8_t* wp, const float* sp, T* op, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* b = wp + n * K;
    T* o = op + (n - n0) * K;
    int64_t k = 0;
#if defined(SERVELAB_VNNI) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const __m512 sv = _mm512_set1_ps(sp[n]);
      for (; k + 16 <= K; k += 16) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + k))));
        _mm256_storeu_si256((__m256i*)(o + k), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, sv)));
      }
    }
#endif
#ifdef SERVELAB_SIMD
    if constexpr (std::is_same_v<T, float>) {
      const __m256 sv = _mm256_set1_ps(sp[n]);
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + k)))), sv));
    }
#endif
    for (; k < K; ++k) o[k] = static_cast<T>(static_cast<float>(b[k]) * sp[n]);
  }
}

torch::Tensor q8_dequantize(const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == torch::kChar, "q8_dequantize: w int8 [N, K], contiguous");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = torch::empty({N, K}, w.options().dtype(torch::kBFloat16));
  const auto s = scales.to(torch::kFloat32).contiguous();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    q8_dequantize_rows(w.data_ptr<int8_t>(), s.data_ptr<float>(), out.data_ptr<at::BFloat16>() + n0 * K, K, n0, n1);
  });
  return out;
}

template <typename T>
torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, bool panels = false) {
  const int64_t K = w.size(1);
  const auto s = scales.to(torch::kFloat32).contiguous();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  return slab_gemm<T>(x, w.size(0), K, [&](T* out, int64_t a, int64_t b) { q8_dequantize_rows(wp, sp, out, K, a, b); },
                      panels);
}


// ---- INT8 weights times many rows through oneDNN's INT8 GEMM (AVX512-VNNI without AMX) ----------
//
// The GEMV's integer sums again, for CPUs without AMX: each row's 14-bit activations (as
// quantize_rows16 makes them) split as hi * 128 + lo (hi in -64..63, lo in 0..127) into two INT8
// rows, so that the 2M rows [hi; lo] times the INT8 weights as stored are one s8 x s8 -> s32 GEMM
// (at::_int_mm: oneDNN's VNNI kernel), whose two halves recombine exactly. On a 2-core Zen 4 that
// GEMM of 2M rows takes 0.95-1.05x the time of bf16's packed GEMM of M rows, where the weight
// dequantized to bf16 for each call took 1.1-1.5x (the dequantizing pass and an unpacked GEMM).
#ifdef SERVELAB_VNNI
namespace q8split {

// One activation row: its scale and its hi / lo INT8 parts, in the row's own order.
template <typename T>
void split_row(const T* x, int64_t K, float& dx, int8_t* hi, int8_t* lo) {
  auto load = [&](int64_t k) { return load16f(x + k); };
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load(k)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float inv = amax > 0.f ? static_cast<float>(Q16) / amax : 0.f;
  dx = amax / static_cast<float>(Q16);
  const __m512 iv = _mm512_set1_ps(inv);
  for (k = 0; k + 16 <= K; k += 16) {
    const __m512 v = load(k);
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, iv));  // rounds half to even, as nearbyint
    _mm_storeu_si128((__m128i*)(hi + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 7)));
    _mm_storeu_si128((__m128i*)(lo + k), _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(127))));
  }
  for (; k < K; ++k) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[k]) * inv));
    hi[k] = static_cast<int8_t>(q >> 7);
    lo[k] = static_cast<int8_t>(q & 127);
  }
}

// One activation row as INT8 of `levels` (<= 127) a side, one scale a row: W8A8's single part.
template <typename T>
void quantize_row8(const T* x, int64_t K, float& dx, int8_t* out, int64_t levels) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16f(x + k)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float inv = amax > 0.f ? static_cast<float>(levels) / amax : 0.f;
  dx = amax / static_cast<float>(levels);
  const __m512 iv = _mm512_set1_ps(inv);
  for (k = 0; k + 16 <= K; k += 16)
    _mm_storeu_si128((__m128i*)(out + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(load16f(x + k), iv))));
  for (; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[k]) * inv));
}

// y[m, n0 + j] = (hi[m][j] * 128 + lo[m][j]) * dx[m] * s[n0 + j], as the twin multiplies; sums
// [2M, nt] (rows M.. the lo parts). The recombined sum fits int32 while K * 8191 * 127 < 2^31.
// Unsplit (W8A8: sums [M, nt], no lo parts): y = sums * dx[m] * s.
template <typename T>
void combine_rows(const int32_t* sums, int64_t M, int64_t nt, const float* dx, const float* s, T* y, int64_t N,
                  bool wide, int64_t m0, int64_t m1, bool split = true) {
  static const int32_t zeros[16] = {0};
  for (int64_t m = m0; m < m1; ++m) {
    const int32_t* h = sums + m * nt;
    const int32_t* l = split ? sums + (M + m) * nt : nullptr;
    const int shift = split ? 7 : 0;
    T* o = y + m * N;
    const __m512 d = _mm512_set1_ps(dx[m]);
    int64_t j = 0;
    if (!wide) {
      for (; j + 16 <= nt; j += 16) {
        const __m512i lo = l ? _mm512_loadu_si512(l + j) : _mm512_loadu_si512(zeros);
        const __m512i isum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(h + j), shift), lo);
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), d), _mm512_loadu_ps(s + j));
        if constexpr (std::is_same_v<T, float>) {
          _mm512_storeu_ps(o + j, v);
        } else {
          _mm256_storeu_si256((__m256i*)(o + j), (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
    for (; j < nt; ++j) {  // (wide: in int64, rounded to float once, as the twin's double sum is)
      const float isum = static_cast<float>(l ? static_cast<int64_t>(h[j]) * 128 + l[j] : static_cast<int64_t>(h[j]));
      o[j] = static_cast<T>(isum * dx[m] * s[j]);
    }
  }
}

}  // namespace q8split

// The activations as INT8 part rows [R, K]: each row's hi and lo halves of its 14-bit integers
// (rows M.. the lo parts: R = 2M), or with `levels` <= 127 the row itself (R = M); dx the row scales.
template <typename T>
torch::Tensor activation_parts(const torch::Tensor& x, int64_t levels, std::vector<float>& dx) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool split = levels > 127;
  auto parts = torch::empty({split ? 2 * M : M, K}, x.options().dtype(torch::kChar));
  dx.resize(M);
  int8_t* pp = parts.data_ptr<int8_t>();
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (split) {
        q8split::split_row(xp + m * K, K, dx[m], pp + m * K, pp + (M + m) * K);
      } else {
        q8split::quantize_row8(xp + m * K, K, dx[m], pp + m * K, levels);
      }
    }
  });
  return parts;
}

template <typename T>
torch::Tensor q8_gemm_int_impl(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                               int64_t levels) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool split = levels > 127;  // 8-bit activations (W8A8) are one INT8 part: M rows, not 2M
  const int64_t R = split ? 2 * M : M;
  std::vector<float> dx;
  const torch::Tensor parts = activation_parts<T>(x, levels, dx);
  const auto s = scales.to(torch::kFloat32).contiguous();
  const float* sp = s.data_ptr<float>();
  auto y = torch::empty({M, N}, x.options());
  T* yp = y.data_ptr<T>();
  const bool wide = K * levels * 127 >= (int64_t{1} << 31);
  // the sums of a call at most 16 MB (a vocabulary-wide head at 128 rows ran 1.6x slower in one call)
  const int64_t nt_max = std::max<int64_t>(1024, ((int64_t{4} << 20) / R) / 64 * 64);
  for (int64_t n0 = 0; n0 < N; n0 += nt_max) {
    const int64_t nt = std::min(nt_max, N - n0);
    const auto sums = at::_int_mm(parts, w.narrow(0, n0, nt).t());  // [R, nt] int32
    const int32_t* sm = sums.data_ptr<int32_t>();
    at::parallel_for(0, M, 8, [&](int64_t m0, int64_t m1) {
      q8split::combine_rows<T>(sm, M, nt, dx.data(), sp + n0, yp + n0, N, wide, m0, m1, split);
    });
  }
  return y;
}

torch::Tensor q8_gemm_int(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales, int64_t levels) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "q8_gemm_int: x [M, K], w [N, K]");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kChar, "q8_gemm_int: w int8, contiguous");
  TORCH_CHECK(levels == Q16 || (levels >= 1 && levels <= 127), "q8_gemm_int: levels 8191 or 1..127");
  if (x.size(0) == 0) return torch::empty({0, w.size(0)}, x.options());
  if (x.scalar_type() == torch::kFloat32) return q8_gemm_int_impl<float>(x.contiguous(), w, scales, levels);
  return q8_gemm_int_impl<at::BFloat16>(x.to(torch::kBFloat16).contiguous(), w, scales, levels).to(x.scalar_type());
}

// ---- INT8 weights packed once for VNNI, times up to a few hundred rows -------------------------
//
// oneDNN's INT8 GEMM (q8_gemm_int) re-lays out the weight at every call; out of cache that pass,
// not the products, sets its speed at decode sizes (a 2-core Zen 4, 64 rows, 30 distinct weights
// per round: 380-534 GOPS against 578-628 here). So the weight is laid out once for vpdpbusd
// (q8_pack_vnni): per 16 output rows, K/4 lines of 16 x 4 consecutive inputs, each stored as
// w + 128 (vpdpbusd multiplies unsigned by signed bytes: the weight takes the unsigned side so that
// an activation dword can be broadcast from memory). sum((w + 128) a) - 128 sum(a) = sum(w a)
// exactly in int32 (K below 66,000), so the sums are q8_gemm_int's and the GEMV's, bit for bit.
// A register tile is 6 activation rows x 32 outputs (12 accumulators); 96 rows at a time are swept
// over a chunk of 16 panels of 32 outputs, so the chunk's weights stay in L2 while the rows stream.
namespace q8vnni {

constexpr int NR = 2, MR = 6;  // 16-output vectors and activation rows of a register tile
constexpr int64_t MB = 96;     // activation rows swept over a chunk of panels at a time
constexpr int64_t PC = 16;     // panels a chunk: 512 outputs, their weights (K x 512 bytes) held in L2

template <int R>
inline void tile(const uint8_t* wp, int64_t bstride, const int8_t* a, int64_t K, int32_t* c, int64_t ldc) {
  __m512i acc[R][NR];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 4) {
    __m512i wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm512_loadu_si512(wp + j * bstride + k * 16);
    for (int r = 0; r < R; ++r) {
      int32_t dword;
      std::memcpy(&dword, a + r * K + k, 4);
      const __m512i av = _mm512_set1_epi32(dword);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wv[j], av);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NR; ++j) _mm512_storeu_si512(c + r * ldc + j * 16, acc[r][j]);
}

inline void rows(int64_t r, const uint8_t* wp, int64_t bstride, const int8_t* a, int64_t K, int32_t* c, int64_t ldc) {
  switch (r) {
    case 1: tile<1>(wp, bstride, a, K, c, ldc); break;
    case 2: tile<2>(wp, bstride, a, K, c, ldc); break;
    case 3: tile<3>(wp, bstride, a, K, c, ldc); break;
    case 4: tile<4>(wp, bstride, a, K, c, ldc); break;
    case 5: tile<5>(wp, bstride, a, K, c, ldc); break;
    default: tile<6>(wp, bstride, a, K, c, ldc); break;
  }
}

}  // namespace q8vnni

bool vnni_packable(int64_t N, int64_t K) { return N % (16 * q8vnni::NR) == 0 && K % 4 == 0 && K < 66000; }

torch::Tensor q8_pack_vnni(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kChar, "q8_pack_vnni: w int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(vnni_packable(N, K), "q8_pack_vnni: N a multiple of 32, K of 4 (below 66,000)");
  const auto wc = w.contiguous();
  auto p = torch::empty({N / 16, K / 4, 16, 4}, w.options().dtype(torch::kByte));
  const int8_t* src = wc.data_ptr<int8_t>();
  uint8_t* dst = p.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[(((n / 16) * (K / 4) + k / 4) * 16 + n % 16) * 4 + k % 4] = static_cast<uint8_t>(src[n * K + k] + 128);
  });
  return p;
}

template <typename T>
torch::Tensor q8_gemm_vnni_impl(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                int64_t levels) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  const bool split = levels > 127;
  const int64_t R = split ? 2 * M : M, PW = 16 * q8vnni::NR;
  std::vector<float> dx;
  const torch::Tensor parts = activation_parts<T>(x, levels, dx);
  const int8_t* pp = parts.data_ptr<int8_t>();
  std::vector<int32_t> rsum(R);  // each part row's sum: the unsigned weights' offset, 128 of each
  for (int64_t r = 0; r < R; ++r) {
    int32_t s = 0;
    for (int64_t k = 0; k < K; ++k) s += pp[r * K + k];
    rsum[r] = 128 * s;
  }
  const auto s = scales.to(torch::kFloat32).contiguous();
  const float* sp = s.data_ptr<float>();
  auto y = torch::empty({M, N}, x.options());
  T* yp = y.data_ptr<T>();
  const bool wide = K * levels * 127 >= (int64_t{1} << 31);
  const uint8_t* wq = packed.data_ptr<uint8_t>();
  const int64_t bstride = K * 16;  // bytes of one 16-output block
  at::parallel_for(0, N / PW, 1, [&](int64_t p0, int64_t p1) {
    std::vector<int32_t> sums(R * PW * q8vnni::PC);  // [panel][R][PW]
    for (int64_t c0 = p0; c0 < p1; c0 += q8vnni::PC) {
      const int64_t c1 = std::min(p1, c0 + q8vnni::PC);
      for (int64_t mb = 0; mb < R; mb += q8vnni::MB) {
        const int64_t me = std::min(R, mb + q8vnni::MB);
        for (int64_t p = c0; p < c1; ++p) {
          int32_t* c = sums.data() + (p - c0) * R * PW;
          for (int64_t m = mb; m < me; m += q8vnni::MR)
            q8vnni::rows(std::min<int64_t>(q8vnni::MR, me - m), wq + p * PW * K, bstride, pp + m * K, K, c + m * PW, PW);
        }
      }
      for (int64_t p = c0; p < c1; ++p) {
        int32_t* c = sums.data() + (p - c0) * R * PW;
        for (int64_t r = 0; r < R; ++r) {
          const __m512i off = _mm512_set1_epi32(rsum[r]);
          for (int64_t j = 0; j < PW; j += 16)
            _mm512_storeu_si512(c + r * PW + j, _mm512_sub_epi32(_mm512_loadu_si512(c + r * PW + j), off));
        }
        q8split::combine_rows<T>(c, M, PW, dx.data(), sp + p * PW, yp + p * PW, N, wide, 0, M, split);
      }
    }
  });
  return y;
}

torch::Tensor q8_gemm_vnni(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                           int64_t levels) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 &&
                  x.size(1) == packed.size(1) * 4 && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "q8_gemm_vnni: x [M, K], packed as q8_pack_vnni lays it out");
  TORCH_CHECK(levels == Q16 || (levels >= 1 && levels <= 127), "q8_gemm_vnni: levels 8191 or 1..127");
  if (x.size(0) == 0) return torch::empty({0, packed.size(0) * 16}, x.options());
  if (x.scalar_type() == torch::kFloat32) return q8_gemm_vnni_impl<float>(x.contiguous(), packed, scales, levels);
  return q8_gemm_vnni_impl<at::BFloat16>(x.to(torch::kBFloat16).contiguous(), packed, scales, levels)
      .to(x.scalar_type());
}
#endif

// ---- INT8 weights times many rows on AMX tiles --------------------------------------------
//
// The same integer sums as the GEMV (activations as 14-bit integers, one scale a row), on the
// INT8 tiles: each 14-bit activation is split as hi * 128 + lo (hi in -64..63, lo in 0..127), two
// INT8 products summed exactly in int32, so the result is the GEMV's, bit for bit up to the
// order of the last float multiplications, at any number of rows. y^T = q . x^T on the tiles: the
// weight is the left operand, loaded as it is stored (no conversion, no copy), and only the
// activations, a few rows shared by every weight block, are laid out as the tiles want them
// (per 16 rows, K/4 rows of 16 groups of 4 consecutive inputs).
#ifdef SERVELAB_AMX
namespace q8amx {  // the shared tile helpers are ::amx (csrc/cpu_amx.cpp)

// tiles (::amx::configure_full): 0-3 int32 sums [16 weight rows][16 x rows] (hi and lo, two weight
// blocks); 4-5 weight rows (16 x 64 INT8); 6-7 the activations' hi and lo parts (16 rows of 16 x 4 INT8)

// 16 activations as fp32
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One activation row as quantize_rows16 makes it (14-bit integers, scale amax / Q16, rounded half
// to even), split into its hi and lo INT8 parts, each group of 4 inputs to its place in the tiles'
// layout: row m is column m % 16 of tile m / 16, whose row p holds inputs 4p..4p+3.
template <typename T>
void pack_row(const T* x, int64_t K, float& dx, int8_t* hi, int8_t* lo, int64_t m, int64_t KQ) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + k)));
  const float amax = _mm512_reduce_max_ps(vmax);
  const float inv = amax > 0.f ? static_cast<float>(Q16) / amax : 0.f;
  dx = amax / static_cast<float>(Q16);
  const __m512 iv = _mm512_set1_ps(inv);
  uint32_t* h32 = reinterpret_cast<uint32_t*>(hi) + (m / 16) * KQ * 16 + m % 16;
  uint32_t* l32 = reinterpret_cast<uint32_t*>(lo) + (m / 16) * KQ * 16 + m % 16;
  for (int64_t k = 0; k < K; k += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + k), iv));
    alignas(16) uint32_t hq[4], lq[4];
    _mm_store_si128((__m128i*)hq, _mm512_cvtepi32_epi8(_mm512_srai_epi32(v, 7)));  // floor(v / 128): -64..63
    _mm_store_si128((__m128i*)lq, _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(127))));
    for (int j = 0; j < 4; ++j) {
      h32[(k / 4 + j) * 16] = hq[j];
      l32[(k / 4 + j) * 16] = lq[j];
    }
  }
}

// sums [16 n][16 m] of one weight block -> y rows m0.. (m_valid of them), columns n0..n0+15:
// (hi * 128 + lo) * dx[m] * s[n], as the twin multiplies
template <typename T>
inline void write_tile(const int32_t* hi, const int32_t* lo, const float* dx, const float* s, T* y, int64_t N,
                       int64_t m_valid) {
  const __m512 sv = _mm512_loadu_ps(s);
  const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(16));
  for (int64_t m = 0; m < m_valid; ++m) {
    const __m512i h = _mm512_i32gather_epi32(col, hi + m, 4), l = _mm512_i32gather_epi32(col, lo + m, 4);
    const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(isum, _mm512_set1_ps(dx[m])), sv);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_storeu_ps(y + m * N, v);
    } else {
      _mm256_storeu_si256((__m256i*)(y + m * N), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

}  // namespace q8amx

template <typename T>
torch::Tensor q8_gemm_amx_impl(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t MT = (M + 15) / 16, KQ = K / 4;
  std::vector<float> dx(MT * 16, 0.f);
  std::vector<int8_t> xhi(MT * KQ * 64, 0), xlo(MT * KQ * 64, 0);  // rows past M stay 0
  // (a parallel region costs more than a few rows take to pack)
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) q8amx::pack_row(xp + m * K, K, dx[m], xhi.data(), xlo.data(), m, KQ);
  });
  const auto s = scales.to(torch::kFloat32).contiguous();
  const float* sp = s.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  auto y = torch::empty({M, N}, x.options());
  T* yp = y.data_ptr<T>();
  const int64_t NB = (N + 31) / 32;  // blocks of 32 weight rows (the last may be 16)
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    ::amx::configure_full();
    alignas(64) int32_t c[4][256];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 32;
      const bool two_n = N - n0 >= 32;
      const int8_t* w0 = wp + n0 * K;
      const int8_t* w1 = w0 + 16 * K;
      for (int64_t mt = 0; mt < MT; ++mt) {
        const int8_t* hp = xhi.data() + mt * KQ * 64;
        const int8_t* lp = xlo.data() + mt * KQ * 64;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 64) {
          _tile_loadd(4, w0 + k, K);
          _tile_loadd(6, hp + k * 16, 64);
          _tile_loadd(7, lp + k * 16, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_dpbssd(1, 4, 7);
          if (two_n) {
            _tile_loadd(5, w1 + k, K);
            _tile_dpbssd(2, 5, 6);
            _tile_dpbssd(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        const int64_t m0 = mt * 16, m_valid = std::min<int64_t>(16, M - m0);
        q8amx::write_tile<T>(c[0], c[1], dx.data() + m0, sp + n0, yp + m0 * N + n0, N, m_valid);
        if (two_n) q8amx::write_tile<T>(c[2], c[3], dx.data() + m0, sp + n0 + 16, yp + m0 * N + n0 + 16, N, m_valid);
      }
    }
    _tile_release();
  });
  return y;
}

torch::Tensor q8_gemm_amx(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(1) % 64 == 0 && w.size(0) % 16 == 0,
              "q8_gemm_amx: x [M, K], w [N, K], K a multiple of 64, N of 16");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kChar, "q8_gemm_amx: w int8, contiguous");
  TORCH_CHECK(::amx::permitted(), "q8_gemm_amx: Linux did not grant this process the AMX tile state");
  if (x.scalar_type() == torch::kFloat32) return q8_gemm_amx_impl<float>(x.contiguous(), w, scales);
  return q8_gemm_amx_impl<at::BFloat16>(x.to(torch::kBFloat16).contiguous(), w, scales).to(x.scalar_type());
}
#endif

bool amx_ready() {
#ifdef SERVELAB_AMX
  return ::amx::permitted();
#else
  return false;
#endif
}

// ---- INT8 weights times bf16 rows on bf16 dot products (W8A16 steps of many rows) -------------
//
// With 14-bit activations the VNNI GEMM multiplies two INT8 part rows a row: on a Zen 4 its u8 x s8
// products run 1.4-1.5x the rate of bf16's, so two of them lose to bf16's packed GEMM of the same
// rows. An INT8 weight is exact in bf16 (integers to 256 are), so the same packed copy is turned
// into bf16 pairs once a panel (16 x NR outputs, all K) per call and the rows multiply by it with
// vdpbf16ps, summing in fp32, the row scale applied once at the end: bf16's own GEMM speed at half its
// weight bytes (register tiles: csrc/cpu_bf16_tile.cpp). The products are exact, so the result
// differs from the 14-bit sums only by their rounding (finer here); the twin is q8_bf16_ref.
#if defined(SERVELAB_VNNI) && defined(SERVELAB_BF16_TILES)
#define SERVELAB_Q8_BF16 1
namespace q8bf16 {

// One 16-output block of the VNNI layout (K/4 lines of 16 outputs x 4 inputs, stored w + 128) as
// K/2 lines of 16 outputs x 2 inputs in bf16, the layout vdpbf16ps multiplies.
inline void widen_block(const uint8_t* src, int64_t K, __m512i* dst) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i off = _mm512_set1_epi16(128);
  auto to_bf16 = [](__m512i w16) {  // 32 int16 -> 32 bf16, in order
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w16)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w16, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  };
  for (int64_t l = 0; l < K / 4; ++l) {
    // outputs 0-7 and 8-15, each 4 inputs as int16: dword 2o is output o's inputs 0-1, 2o + 1 its 2-3
    const __m512i a = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(src + l * 64))), off);
    const __m512i b = _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(src + l * 64 + 32))), off);
    dst[2 * l] = to_bf16(_mm512_permutex2var_epi32(a, even, b));
    dst[2 * l + 1] = to_bf16(_mm512_permutex2var_epi32(a, odd, b));
  }
}

}  // namespace q8bf16

// K must be even for bf16 pairs: q8_pack_vnni already asks a multiple of 4.
torch::Tensor q8_gemm_bf16(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 4 &&
                  x.size(1) == packed.size(1) * 4 && packed.scalar_type() == torch::kByte && packed.is_contiguous(),
              "q8_gemm_bf16: x [M, K], packed as q8_pack_vnni lays it out");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * 16;
  auto xb = x.to(torch::kBFloat16).contiguous();
  auto y = torch::empty({M, N}, xb.options());
  if (M == 0) return y.to(x.scalar_type());
  const auto s = scales.to(torch::kFloat32).contiguous();
  const float* sp = s.data_ptr<float>();
  const uint8_t* wq = packed.data_ptr<uint8_t>();
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  constexpr int64_t NR = bf16tile::NR;
  const int64_t panels = (blocks + NR - 1) / NR;  // the last may hold 1 or 2 blocks
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<__m512i> wide(NR * K / 2);  // one panel in bf16: NR blocks of K/2 lines
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b0 = p * NR, nb = std::min(NR, blocks - b0);
      for (int64_t j = 0; j < nb; ++j) q8bf16::widen_block(wq + (b0 + j) * 16 * K, K, wide.data() + j * K / 2);
      bf16tile::panel(wide.data(), nb, M, K, xp, sp + b0 * 16, nullptr, yp + b0 * 16, N);
    }
  });
  return y.to(x.scalar_type());
}
#endif

// Whether q8_matmul takes the AMX GEMM: bf16 activations (fp32 ones keep the fp32 GEMM over the
// dequantized weight, their precision), K a multiple of 64, N of 16.
bool use_amx(const torch::Tensor& x, const torch::Tensor& w) {
  return x.scalar_type() == torch::kBFloat16 && w.size(1) % 64 == 0 && w.size(0) % 16 == 0 && amx_ready();
}

// Where `int_gemm` allows it, the AMX GEMM where it serves (at any number of rows: it is faster than
// the GEMV from one row on); else the GEMV up to `gemv_rows` rows; else, for bf16 rows on an
// AVX512-VNNI build, the INT8 GEMM of the split activations (the GEMV's sums): over the weight
// `packed` by q8_pack_vnni up to VNNI_ROWS part rows (2 a row), oneDNN's (q8_gemm_int) above or
// without it; else a GEMM in x's precision over the weight dequantized for this call (bf16 unless x
// is fp32: an AVX2-only CPU runs bf16 GEMMs 8x slower than fp32).
// On AVX2 builds a copy `packed` by q8_pack_madd takes more than MADD_GEMV_ROWS rows (q8_gemm_madd: the GEMV's sums).
// Coarser activations (`levels` < 8191, W8A8) take the GEMV and the INT8 GEMMs only (one part row
// a row), with those levels: no AMX split, and never a float GEMM, whose numbers would be another model's.
// With a packed copy the GEMV serves up to VNNI_GEMV_ROWS rows only, and from BF16_DOT_ROWS rows of
// 14-bit activations the bf16 dot GEMM over it (exact bf16 activations: finer sums, not the GEMV's).
// On a 2-core Zen 4, each SmolLM2 shape, 30 distinct weights a round (medians of 5): the packed GEMM ran 0.9-1.0x the GEMV at 1 row
// of 14-bit activations, 1.0-1.3x at 4, 1.2-1.8x at 8 (INT8 activations 1.0-1.2x at 1 row, 1.3-1.4x at
// 4); against oneDNN's 1.2-1.8x at 32-64 part rows, 1.0-1.1x at 128-384, 1.0x at 512, 0.9-1.06x at
// 768; the head (49,152 x 576) 1.2-2.3x oneDNN's at 1-128 rows. In engine steps (medians of 9
// alternating rounds) 64 decodes with a 192-token chunk ran 0.92x and 0.96x unpacked at 512 part
// rows of 14-bit activations, and 1.10x with INT8 activations (256), hence 256.
constexpr int64_t VNNI_ROWS = 256, VNNI_GEMV_ROWS = 3;
// From this many bf16 rows of 14-bit activations the packed copy is multiplied on bf16 dot products
// instead (q8_gemm_bf16, built with AVX512-BF16). The same 2-core Zen 4, SmolLM2's four layer shapes,
// 6 distinct weights a round (medians of 15): 0.91x the split VNNI GEMM's speed at 32 rows, 1.01x at
// 64, 1.07x at 128, 1.10x at 256, 1.16x at 512 (1.10-1.29x oneDNN's INT8 GEMM of 2M rows, 0.98-1.02x
// bf16's packed GEMM of the same rows); the head 0.84x at 32 rows, 0.99-1.16x at 64-512.
constexpr int64_t BF16_DOT_ROWS = 64;
// Up to this many rows the GEMV keeps INT8 layers with an AVX2 copy; from the next the vpmaddwd GEMM.
// On a 2-core Zen 3, SmolLM2's shapes, 8 distinct weights a shape (benchmarks.int8_gemm, medians of
// 7 rounds): the GEMM 0.82-0.97x the GEMV's speed at 1 row, 0.91-1.03x at 2, 1.03-1.19x at 3,
// 1.11-1.16x at 4, 1.3-1.9x at 8-64.
constexpr int64_t MADD_GEMV_ROWS = 2;

torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales,
                        int64_t gemv_rows, bool int_gemm, int64_t levels, const c10::optional<torch::Tensor>& packed,
                        bool bf16_dot) {
  const int64_t rows = x.size(0);
#ifdef SERVELAB_VNNI
  const bool int_rows = int_gemm && x.scalar_type() == torch::kBFloat16;
  if (int_rows && packed.has_value() && packed->defined() && rows > std::min(gemv_rows, VNNI_GEMV_ROWS)) {
#ifdef SERVELAB_AMX
    const bool amx = levels == Q16 && use_amx(x, w);
#else
    constexpr bool amx = false;
#endif
#ifdef SERVELAB_Q8_BF16
    if (bf16_dot && !amx && levels == Q16 && rows >= BF16_DOT_ROWS) return q8_gemm_bf16(x, *packed, scales);
#endif
    if (!amx && (levels == Q16 ? 2 * rows : rows) <= VNNI_ROWS) return q8_gemm_vnni(x, *packed, scales, levels);
  }
#endif
#ifdef SERVELAB_MADD
  if (int_gemm && packed.has_value() && packed->defined() && rows > std::min(gemv_rows, MADD_GEMV_ROWS))
    return q8_gemm_madd(x, *packed, scales, levels);
#endif
  if (levels != Q16) {
#ifdef SERVELAB_VNNI
    if (int_rows && rows > gemv_rows) return q8_gemm_int(x, w, scales, levels);
#endif
    return q8_linear(x, w, scales, levels);
  }
#ifdef SERVELAB_AMX
  if (int_gemm && rows > 0 && use_amx(x, w)) return q8_gemm_amx(x, w, scales);
#endif
  if (rows <= gemv_rows) return q8_linear(x, w, scales, levels);
#ifdef SERVELAB_VNNI
  if (int_rows) return q8_gemm_int(x, w, scales, levels);
#endif
  if (x.scalar_type() == torch::kFloat32) return q8_gemm<float>(x.contiguous(), w, scales, int_gemm);  // fp32 panels
  return q8_gemm<at::BFloat16>(x.to(torch::kBFloat16).contiguous(), w, scales).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(SERVELAB_NS, m) {
  m.def("q4_linear(Tensor x, Tensor w, Tensor dm) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor w, Tensor scales, int levels=8191) -> Tensor");
  m.def("q4_dequantize(Tensor w, Tensor dm, ScalarType dtype) -> Tensor");
  m.def("q8_dequantize(Tensor w, Tensor scales) -> Tensor");
  m.def("q4_matmul(Tensor x, Tensor w, Tensor dm, int gemv_rows, bool int_gemm) -> Tensor");
  m.def("q8_matmul(Tensor x, Tensor w, Tensor scales, int gemv_rows, bool int_gemm, int levels=8191, "
        "Tensor? packed=None, bool bf16_dot=True) -> Tensor");
  m.def("portable() -> bool", &portable_build);
  m.def("amx_ready() -> bool", &amx_ready);
#ifdef SERVELAB_AMX
  m.def("q8_gemm_amx(Tensor x, Tensor w, Tensor scales) -> Tensor");
#endif
#ifdef SERVELAB_VNNI
  m.def("q8_gemm_int(Tensor x, Tensor w, Tensor scales, int levels=8191) -> Tensor");
  m.def("q4_gemm_int(Tensor x, Tensor w, Tensor dm) -> Tensor");
  m.def("q8_pack_vnni(Tensor w) -> Tensor");
  m.def("q8_gemm_vnni(Tensor x, Tensor packed, Tensor scales, int levels=8191) -> Tensor");
#endif
#ifdef SERVELAB_MADD
  m.def("q8_pack_madd(Tensor w) -> Tensor");
  m.def("q8_gemm_madd(Tensor x, Tensor packed, Tensor scales, int levels=8191) -> Tensor");
#endif
#ifdef SERVELAB_Q8_BF16
  m.def("q8_gemm_bf16(Tensor x, Tensor packed, Tensor scales) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(SERVELAB_NS, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("q4_dequantize", &q4_dequantize);
  m.impl("q8_dequantize", &q8_dequantize);
  m.impl("q4_matmul", &q4_matmul);
  m.impl("q8_matmul", &q8_matmul);
#ifdef SERVELAB_AMX
  m.impl("q8_gemm_amx", &q8_gemm_amx);
#endif
#ifdef SERVELAB_VNNI
  m.impl("q8_gemm_int", &q8_gemm_int);
  m.impl("q4_gemm_int", &q4_gemm_int);
  m.impl("q8_pack_vnni", &q8_pack_vnni);
  m.impl("q8_gemm_vnni", &q8_gemm_vnni);
#endif
#ifdef SERVELAB_MADD
  m.impl("q8_pack_madd", &q8_pack_madd);
  m.impl("q8_gemm_madd", &q8_gemm_madd);
#endif
#ifdef SERVELAB_Q8_BF16
  m.impl("q8_gemm_bf16", &q8_gemm_bf16);
#endif
}
