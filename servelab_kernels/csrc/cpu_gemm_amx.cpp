// bf16 x bf16 -> bf16 matmul on AMX tiles, for steps of a few to a few hundred rows: see
// servelab_kernels/linear.py. Built with cpu_ops, after the AMX prelude (csrc/cpu_amx.cpp).
//
// y[M, N] = x[M, K] . W[N, K]^T (+ bias). A decode step of a small model at batch 16-64 reads every
// weight once and multiplies it by a few dozen rows: oneDNN's GEMM over its own packed weight ran
// that at 7.6-10.7 GB/s of weights on a 2-core Xeon, half the machine's reads. Here the weight is
// laid out once as the tiles take it (`amx_pack`: blocks of 32 output columns, each a run of K / 32
// pairs of 1 KB tiles, so a block streams from memory in one contiguous pass), and every block is
// multiplied by all the rows while it is in L1/L2: two weight tiles and two 16-row activation
// tiles give four `tdpbf16ps` per 32 inputs (products of bf16 pairs, exact in fp32, summed in
// fp32). The activations are read in place (any row stride). Each sum is rounded to bf16 once, as
// oneDNN rounds it; the summation order differs from oneDNN's and from the GEMV's, so results
// agree with them to a bf16 rounding, not bit for bit.
#if defined(SERVELAB_AMX_TILES) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SERVELAB_AMX_GEMM 1
#endif

namespace amx_gemm {

constexpr int64_t BLOCK_N = 32;  // output columns per block: two tiles of 16
constexpr int64_t TILE_K = 32;   // inputs per tile: 16 pairs

// The packed layout's offset (in elements) of the tile (block n0, input tile kb, half s): blocks are
// BLOCK_N columns (the last may be 16), each nw * K elements, its tiles in input order, the two
// halves of a step side by side. Element (r, c, e) of a tile is W[n0 + 16 s + c][32 kb + 2 r + e].
inline int64_t tile_offset(int64_t n0, int64_t nw, int64_t K, int64_t kb, int64_t s) {
  return n0 * K + kb * nw * TILE_K + s * 512;
}

bool fits(int64_t N, int64_t K) { return N > 0 && K > 0 && N % 16 == 0 && K % TILE_K == 0; }

}  // namespace amx_gemm

// W [N, K] bf16 in the tiles' layout (a flat tensor of N * K elements): once per weight.
torch::Tensor amx_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "amx_pack: a bf16 weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(amx_gemm::fits(N, K), "amx_pack: N a multiple of 16 and K of 32, got [", N, ", ", K, "]");
  auto wc = w.contiguous();
  auto out = torch::empty({N * K}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, (N + amx_gemm::BLOCK_N - 1) / amx_gemm::BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * amx_gemm::BLOCK_N, nw = std::min(amx_gemm::BLOCK_N, N - n0);
      for (int64_t kb = 0; kb < K / amx_gemm::TILE_K; ++kb)
        for (int64_t s = 0; s < nw / 16; ++s) {
          uint16_t* t = dst + amx_gemm::tile_offset(n0, nw, K, kb, s);
          for (int64_t r = 0; r < 16; ++r)
            for (int64_t c = 0; c < 16; ++c)
              for (int64_t e = 0; e < 2; ++e)
                t[r * 32 + c * 2 + e] = src[(n0 + 16 * s + c) * K + kb * amx_gemm::TILE_K + 2 * r + e];
        }
    }
  });
  return out;
}

bool amx_linear_ready() {
#ifdef SERVELAB_AMX_GEMM
  return ::amx::permitted();
#else
  return false;
#endif
}

#ifdef SERVELAB_AMX_GEMM
namespace amx_gemm {

// The next weight block, asked for into L2 a few lines per k step while this block's passes run: the
// blocks lie back to back, but at 64 rows a block's passes take long enough that the hardware prefetcher
// falls behind, and a burst into L1 at a block's start evicts the activation tiles in use. Spread over the
// block's steps (T1), a 64-row decode step at context 384 ran 2.5-5 % faster on the AMX Xeon; T0, T2
// and no prefetch were slower.
struct Prefetch {
  const char* next = nullptr;  // the next line of the next block to ask for
  const char* end = nullptr;
  int64_t lines = 0;  // lines a step
};

inline void prefetch_step(Prefetch& pf) {
  for (int64_t i = 0; i < pf.lines && pf.next < pf.end; ++i, pf.next += 64) _mm_prefetch(pf.next, _MM_HINT_T1);
}

// One block of output columns [n0, n0 + nw) for one or two 16-row activation tiles (a1 null: one;
// s0, s1 their row strides in bytes). Tiles 0-3: the sums [16 rows][16 columns] (tile t: rows of
// activation tile t / 2, columns of weight half t % 2); 4-5 the activations; 6-7 the weight halves.
// `between` runs after the products are issued and before the sums are stored (the caller rounds the
// previous pass's sums there, while the tiles compute); `pf` asks for a slice of the next block each k step.
template <typename Between>
inline void block_pass(const uint16_t* a0, int64_t s0, const uint16_t* a1, int64_t s1, const uint16_t* w, int64_t nw,
                       int64_t K, float (*c)[256], Prefetch& pf, Between between) {
  const bool two_m = a1 != nullptr;
  const bool two_n = nw == BLOCK_N;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < K / TILE_K; ++kb) {
    const uint16_t* wt = w + kb * nw * TILE_K;
    prefetch_step(pf);
    _tile_loadd(4, a0 + kb * TILE_K, s0);
    _tile_loadd(6, wt, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two_n) {
      _tile_loadd(7, wt + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_m) {
      _tile_loadd(5, a1 + kb * TILE_K, s1);
      _tile_dpbf16ps(2, 5, 6);
      if (two_n) _tile_dpbf16ps(3, 5, 7);
    }
  }
  between();
  _tile_stored(0, c[0], 64);
  if (two_n) _tile_stored(1, c[1], 64);
  if (two_m) _tile_stored(2, c[2], 64);
  if (two_m && two_n) _tile_stored(3, c[3], 64);
}

// Rows [m0, m0 + rows) of a tile pair's sums (+ bias) rounded to bf16 into y's columns n0...
inline void store_rows(const float (*c)[256], int tile, int64_t rows, const float* bias, uint16_t* y, int64_t N) {
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c[tile] + m * 16), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

}  // namespace amx_gemm
#endif

// x [M, K] bf16 (rows may be strided, columns contiguous), packed: amx_pack(W) of W [N, K], bias
// [N] or None -> y [M, N] bf16.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "amx_linear: x bf16 [M, K] with contiguous columns");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(amx_gemm::fits(N, K) && packed.numel() == N * K && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous(),
              "amx_linear: packed must be amx_pack of a bf16 weight [N, K] with x's K");
  TORCH_CHECK(!bias || (bias->numel() == N), "amx_linear: bias [N]");
#ifdef SERVELAB_AMX_GEMM
  TORCH_CHECK(::amx::permitted(), "amx_linear: Linux did not grant this process the AMX tile state");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t MT = (M + 15) / 16;
  // a last tile of fewer than 16 rows is read from a zero-padded copy (a tile load reads 16 rows)
  torch::Tensor tail;
  if (M % 16) {
    tail = torch::zeros({16, K}, x.options());
    tail.narrow(0, 0, M % 16).copy_(x.narrow(0, M - M % 16, M % 16));
  }
  torch::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : torch::Tensor();
  const float* bp = bias ? bias_f.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* tp = M % 16 ? reinterpret_cast<const uint16_t*>(tail.data_ptr<at::BFloat16>()) : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0);
  auto a_tile = [&](int64_t mt) { return mt * 16 + 16 <= M ? xp + mt * 16 * xs : tp; };
  auto a_stride = [&](int64_t mt) { return (mt * 16 + 16 <= M ? xs : K) * 2; };
  const int64_t NB = (N + amx_gemm::BLOCK_N - 1) / amx_gemm::BLOCK_N;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    ::amx::configure_full();
    // The sums of a pass go out to one of two buffers and are rounded into y after the next pass's
    // products are issued: vector loads of lines a tile store has not yet drained wait for it, and
    // the wait, once a pass, cost the kernel about a tenth of its time
    alignas(64) float c[2][4][256];
    struct Pass { int64_t n0 = -1, nw = 0, mt = 0; bool two_m = false; } done[2];
    int cur = 0;
    auto round_out = [&](int buf) {
      const Pass& p = done[buf];
      if (p.n0 < 0) return;
      for (int64_t h = 0; h < (p.two_m ? 2 : 1); ++h) {
        const int64_t m0 = (p.mt + h) * 16, rows = std::min<int64_t>(16, M - m0);
        for (int64_t s = 0; s < p.nw / 16; ++s)
          amx_gemm::store_rows(c[buf], int(2 * h + s), rows, bp ? bp + p.n0 + 16 * s : nullptr,
                               yp + m0 * N + p.n0 + 16 * s, N);
      }
      done[buf].n0 = -1;
    };
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * amx_gemm::BLOCK_N, nw = std::min(amx_gemm::BLOCK_N, N - n0);
      const uint16_t* w = wp + amx_gemm::tile_offset(n0, nw, K, 0, 0);
      amx_gemm::Prefetch pf;
      if (b + 1 < b1) {
        const int64_t next_nw = std::min(amx_gemm::BLOCK_N, N - n0 - amx_gemm::BLOCK_N);
        pf.next = reinterpret_cast<const char*>(wp + amx_gemm::tile_offset(n0 + nw, next_nw, K, 0, 0));
        pf.end = pf.next + next_nw * K * 2;
        const int64_t steps = (MT + 1) / 2 * (K / amx_gemm::TILE_K);
        pf.lines = (next_nw * K * 2 / 64 + steps - 1) / steps;
      }
      for (int64_t mt = 0; mt < MT; mt += 2) {
        const bool two_m = mt + 1 < MT;
        amx_gemm::block_pass(a_tile(mt), a_stride(mt), two_m ? a_tile(mt + 1) : nullptr, two_m ? a_stride(mt + 1) : 0,
                             w, nw, K, c[cur], pf, [&] { round_out(cur ^ 1); });
        done[cur] = Pass{n0, nw, mt, two_m};
        cur ^= 1;
      }
    }
    round_out(cur ^ 1);
    _tile_release();
  });
  return y;
#else
  (void)M, (void)K;
  TORCH_CHECK(false, "amx_linear: this build has no AMX-BF16 tiles");
#endif
}

TORCH_LIBRARY_FRAGMENT(SERVELAB_NS, m) {
  m.def("amx_linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(SERVELAB_NS, CPU, m) {
  m.impl("amx_linear", &amx_linear);
}
