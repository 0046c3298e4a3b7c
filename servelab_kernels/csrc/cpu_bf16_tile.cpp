// Register tiles of bf16 dot products (vdpbf16ps) over a weight panel laid out as K/2 lines of 16
// outputs x 2 inputs per block of 16 outputs: the layout servelab_kernels.dot_linear packs bf16
// weights in once, and the one cpu_quant's q8_gemm_bf16 widens INT8 weights to a panel at a time.
// Built in front of both sources (servelab_kernels.cpp_build.build's `prelude`).
//
// A tile is R activation rows x NR blocks: 8 x 3 holds 24 accumulators, 3 weight vectors and one
// broadcast pair in the 32 vector registers, so each weight load feeds 8 products and each
// broadcast 3. Sums are fp32 over all of K; each output is scaled (per output, optional), given
// its bias (optional) and rounded to bf16 once, as oneDNN's bf16 GEMM rounds it.
#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(SERVELAB_PORTABLE)
#include <immintrin.h>
#include <ATen/ATen.h>
#include <cstring>
#define SERVELAB_BF16_TILES 1
namespace bf16tile {

constexpr int MR = 8, NR = 3;  // rows and 16-output blocks of a full tile

template <int R, int B>
inline void tile(const __m512i* wp, int64_t K, const at::BFloat16* a, const float* scale, const float* bias,
                 at::BFloat16* y, int64_t ldy) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t lines = K / 2;
  for (int64_t k = 0; k < lines; ++k) {
    __m512bh wv[B];
    for (int j = 0; j < B; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + j * lines + k);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * K + 2 * k, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < B; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], av);
    }
  }
  for (int j = 0; j < B; ++j) {
    const __m512 sv = scale ? _mm512_loadu_ps(scale + j * 16) : _mm512_set1_ps(1.0f);
    const __m512 bv = bias ? _mm512_loadu_ps(bias + j * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = scale ? _mm512_mul_ps(acc[r][j], sv) : acc[r][j];
      _mm256_storeu_si256((__m256i*)(y + r * ldy + j * 16), (__m256i)_mm512_cvtneps_pbh(bias ? _mm512_add_ps(v, bv) : v));
    }
  }
}

// All M rows of x [M, K] (contiguous) times one panel of B blocks: y's B * 16 columns from y on.
template <int B>
void panel_rows(const __m512i* wp, int64_t M, int64_t K, const at::BFloat16* x, const float* scale,
                const float* bias, at::BFloat16* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, B>(wp, K, x + m * K, scale, bias, y + m * ldy, ldy);
  const at::BFloat16* xm = x + m * K;
  at::BFloat16* ym = y + m * ldy;
  switch (M - m) {
    case 0: break;
    case 1: tile<1, B>(wp, K, xm, scale, bias, ym, ldy); break;
    case 2: tile<2, B>(wp, K, xm, scale, bias, ym, ldy); break;
    case 3: tile<3, B>(wp, K, xm, scale, bias, ym, ldy); break;
    case 4: tile<4, B>(wp, K, xm, scale, bias, ym, ldy); break;
    case 5: tile<5, B>(wp, K, xm, scale, bias, ym, ldy); break;
    case 6: tile<6, B>(wp, K, xm, scale, bias, ym, ldy); break;
    default: tile<7, B>(wp, K, xm, scale, bias, ym, ldy); break;
  }
}

// A panel of `blocks` (1 to NR) blocks, its scales and biases at its first output (either may be null).
inline void panel(const __m512i* wp, int64_t blocks, int64_t M, int64_t K, const at::BFloat16* x, const float* scale,
                  const float* bias, at::BFloat16* y, int64_t ldy) {
  if (blocks == 3) panel_rows<3>(wp, M, K, x, scale, bias, y, ldy);
  else if (blocks == 2) panel_rows<2>(wp, M, K, x, scale, bias, y, ldy);
  else panel_rows<1>(wp, M, K, x, scale, bias, y, ldy);
}

}  // namespace bf16tile
#endif
