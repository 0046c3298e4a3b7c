// Register tiles of fp32 FMAs on AVX2 over a weight panel laid out as K lines of 16 outputs: the
// layout servelab_kernels.fp32_linear packs fp32 weights in once, and the one cpu_quant's fp32 path
// dequantizes INT8 / INT4 weights to a panel at a time. Built in front of both sources
// (servelab_kernels.cpp_build.build's `prelude`), for CPUs without AVX-512.
//
// A panel's lines may also hold bf16 weights (fp32_linear's bf16 copy: half the bytes to stream,
// which is all a step of few rows does). A line of 16 bf16 is stored in the column order 0-3, 8-11,
// 4-7, 12-15, so that interleaving it with zeros (one unpack each, no lane crossing) gives columns
// 0-7 and 8-15 as fp32: a bf16 is the top half of the fp32 with its bits.
//
// A tile is 6 rows x 16 outputs: 12 accumulators, 2 weight vectors and a broadcast in the 16 vector
// registers, each weight load feeding 6 FMAs. Sums run over k in order, one FMA a product; the bias
// is added once at the end. The loops over rows are unrolled by pragma: without it gcc 12 keeps the
// accumulator arrays on the stack and stores all 12 every k (0.4x the FMA rate).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(SERVELAB_PORTABLE)
#include <immintrin.h>
#define SERVELAB_FP32_TILES 1
namespace fp32tile {

constexpr int MR = 6;  // rows of a full tile

// Line k of a panel as two vectors of fp32: outputs 0-7 and 8-15.
inline void line(const float* wp, int64_t k, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(wp + 16 * k);
  w1 = _mm256_loadu_ps(wp + 16 * k + 8);
}

inline void line(const uint16_t* wp, int64_t k, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * k)), zero = _mm256_setzero_si256();
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

template <int R, typename W>
inline void tile(const W* wp, int64_t K, const float* a, const float* bias, float* y, int64_t ldy) {
  __m256 lo[R], hi[R];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) lo[r] = _mm256_setzero_ps(), hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    line(wp, k, w0, w1);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * K + k);
      lo[r] = _mm256_fmadd_ps(av, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(av, w1, hi[r]);
    }
  }
  const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, bias ? _mm256_add_ps(lo[r], b0) : lo[r]);
    _mm256_storeu_ps(y + r * ldy + 8, bias ? _mm256_add_ps(hi[r], b1) : hi[r]);
  }
}

// All M rows of x [M, K] (contiguous) times one panel of 16 outputs (fp32 or bf16 lines): y's 16
// columns from y on.
template <typename W>
inline void panel(const W* wp, int64_t M, int64_t K, const float* x, const float* bias, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR>(wp, K, x + m * K, bias, y + m * ldy, ldy);
  const float* xm = x + m * K;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 0: break;
    case 1: tile<1>(wp, K, xm, bias, ym, ldy); break;
    case 2: tile<2>(wp, K, xm, bias, ym, ldy); break;
    case 3: tile<3>(wp, K, xm, bias, ym, ldy); break;
    case 4: tile<4>(wp, K, xm, bias, ym, ldy); break;
    default: tile<5>(wp, K, xm, bias, ym, ldy); break;
  }
}

}  // namespace fp32tile
#endif

