// bf16 x bf16 -> bf16 matmul for steps of few rows: see servelab_kernels/linear.py. Built with cpu_ops
// (one translation unit: it uses that file's bf16 helpers, load_f and bf16_bits).
//
// y[M, N] = x[M, K] . W[N, K]^T with W as nn.Linear stores it. A decode step at small batch reads
// every weight once and does little with it, so what counts is streaming W at the memory's rate:
// each 32-wide slice of two weight rows is loaded once and dotted with up to 8 activation rows
// held in L1 (AVX512-BF16 `vdpbf16ps`: pairs of bf16 products, exact in fp32, summed in fp32).
// Every sum is rounded to bf16 once at the end, as the GEMM rounds it. The weights are prefetched
// 4 KB ahead of the loads: without it the core waits on each line in turn and reads 17-26 GB/s
// (9 GB/s at 8 rows), with it 38-40 GB/s at 1 to 8 rows of a 48 GB/s machine (2-core EPYC).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(SERVELAB_PORTABLE)
#include <immintrin.h>
#define SERVELAB_BF16_DOT 1
#endif

namespace {

constexpr int64_t GEMV_PREFETCH = 4096;  // bytes ahead on the weight stream (2 KB and 8 KB measured worse)
constexpr int64_t GEMV_MR = 8;  // activation rows per pass over a weight row (their sums stay in registers)

#ifdef SERVELAB_BF16_DOT
// Weight rows [n, n + NR) against activation rows [0, MR) of `x` (row stride xs), columns K.
template <int MR, int NR>
void gemv_tile(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t K, float* sums) {
  // fully unrolled over r and m, so that the accumulators live in registers
  __m512 acc[NR][MR];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? __mmask32(~0u) : __mmask32((1u << (K - k)) - 1);
    __m512bh wv[NR];
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + GEMV_PREFETCH, _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + k);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) sums[m * NR + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int NR>
void gemv_tile_mr(int64_t mr, const uint16_t* x, int64_t xs, const uint16_t* w, int64_t K, float* sums) {
  switch (mr) {
    case 1: return gemv_tile<1, NR>(x, xs, w, K, sums);
    case 2: return gemv_tile<2, NR>(x, xs, w, K, sums);
    case 3: return gemv_tile<3, NR>(x, xs, w, K, sums);
    case 4: return gemv_tile<4, NR>(x, xs, w, K, sums);
    case 5: return gemv_tile<5, NR>(x, xs, w, K, sums);
    case 6: return gemv_tile<6, NR>(x, xs, w, K, sums);
    case 7: return gemv_tile<7, NR>(x, xs, w, K, sums);
    default: return gemv_tile<8, NR>(x, xs, w, K, sums);
  }
}
#endif

// Output columns [n0, n1) for all M activation rows: a pair of weight rows at a time, every block
// of GEMV_MR activation rows against it while it is in L1.
void gemv_cols(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* w, int64_t K, uint16_t* y, int64_t N,
               int64_t n0, int64_t n1) {
#ifdef SERVELAB_BF16_DOT
  float sums[GEMV_MR * 2];
  for (int64_t n = n0; n < n1; n += 2) {
    const int nr = n + 2 <= n1 ? 2 : 1;
    for (int64_t m0 = 0; m0 < M; m0 += GEMV_MR) {
      const int64_t mr = std::min(GEMV_MR, M - m0);
      if (nr == 2) gemv_tile_mr<2>(mr, x + m0 * xs, xs, w + n * K, K, sums);
      else gemv_tile_mr<1>(mr, x + m0 * xs, xs, w + n * K, K, sums);
      for (int64_t m = 0; m < mr; ++m)
        for (int r = 0; r < nr; ++r) y[(m0 + m) * N + n + r] = bf16_bits(sums[m * nr + r]);
    }
  }
#else
  // portable: the same sums in plain fp32 loops (in another order within a row), widened by
  // cpu_ops.cpp's load_f
  const auto* xb = reinterpret_cast<const at::BFloat16*>(x);
  const auto* wb = reinterpret_cast<const at::BFloat16*>(w);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += load_f(xb, m * xs + k) * load_f(wb, n * K + k);
      y[m * N + n] = bf16_bits(s);
    }
#endif
}

}  // namespace

bool bf16_dot_native() {
#ifdef SERVELAB_BF16_DOT
  return true;
#else
  return false;
#endif
}

// x [M, K] bf16 (rows may be strided, columns contiguous), w [N, K] bf16 contiguous -> y [M, N] bf16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16_linear: bf16 only");
  TORCH_CHECK(x.stride(1) == 1 && w.is_contiguous(), "bf16_linear: contiguous columns of x, contiguous w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // about 32 KB of weights a task: enough to hide a fork, small enough to split a 576-row layer
  const int64_t grain = std::max<int64_t>(16, (32768 / std::max<int64_t>(K * 2, 1)) & ~int64_t(1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    gemv_cols(xp, x.stride(0), M, wp, K, yp, N, n0, n1);
  });
  return y;
}

// The same dispatch as servelab_kernels/linear.py's `linear`, as one torch op, so that torch.compile's graph
// can call it: the graph's number of rows is symbolic, and a branch on it in Python would guard
// on it and recompile for every step size. Up to `gemv_rows` rows the GEMV (when this build has
// the bf16 dot instruction), else the GEMM F.linear calls.
torch::Tensor bf16_matmul(torch::Tensor x, torch::Tensor w, int64_t gemv_rows) {
#ifdef SERVELAB_BF16_DOT
  if (x.size(0) <= gemv_rows && w.is_contiguous()) return bf16_linear(x.stride(1) == 1 ? x : x.contiguous(), w);
#endif
  return at::linear(x, w);
}

TORCH_LIBRARY(SERVELAB_NS, m) {
  m.def("bf16_matmul(Tensor x, Tensor w, int gemv_rows) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(SERVELAB_NS, CPU, m) {
  m.impl("bf16_matmul", &bf16_matmul);
  m.impl("bf16_linear", &bf16_linear);
}
