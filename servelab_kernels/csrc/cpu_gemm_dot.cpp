// bf16 x bf16 -> bf16 matmul on bf16 dot products (vdpbf16ps) over a weight packed once, for CPUs
// with AVX512-BF16 and no AMX: see servelab_kernels/dot_linear.py. Built with cpu_ops, after the
// register tiles (csrc/cpu_bf16_tile.cpp).
//
// y[M, N] = x[M, K] . W[N, K]^T (+ bias). The weight is laid out once (`dot_linear.pack`: per 16
// outputs, K/2 lines of 16 outputs x 2 inputs), each panel of 48 outputs (all K, in L2) is multiplied
// by every row of the step in tiles of 8 rows x 48 outputs, and the panels are shared out between
// the threads. Sums are fp32, rounded to bf16 once after the bias, as oneDNN rounds them; their
// order differs from oneDNN's and the GEMV's, so results agree with those to a bf16 rounding.

bool dot_linear_ready() {
#ifdef SERVELAB_BF16_TILES
  return true;
#else
  return false;
#endif
}

torch::Tensor dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "dot_linear: x bf16 [M, K] with contiguous columns");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(1) * 2 == x.size(1),
              "dot_linear: packed must be dot_linear.pack of a bf16 weight [N, K] with x's K");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * 16;
  TORCH_CHECK(!bias || bias->numel() == N, "dot_linear: bias [N]");
#ifdef SERVELAB_BF16_TILES
  const auto xc = x.stride(0) == K ? x : x.contiguous();  // rows back to back, as the tiles read them
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor b;
  if (bias) b = bias->to(at::kFloat).contiguous();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const __m512i*>(packed.data_ptr<at::BFloat16>());
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  constexpr int64_t NR = bf16tile::NR;
  const int64_t lines = K / 2;  // 64-byte lines a block
  at::parallel_for(0, (blocks + NR - 1) / NR, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b0 = p * NR;
      bf16tile::panel(wp + b0 * lines, std::min(NR, blocks - b0), M, K, xp, nullptr, bp ? bp + b0 * 16 : nullptr,
                      yp + b0 * 16, N);
    }
  });
  return y;
#else
  (void)M, (void)K;
  TORCH_CHECK(false, "dot_linear: this build has no AVX512-BF16");
#endif
}

TORCH_LIBRARY_FRAGMENT(SERVELAB_NS, m) {
  m.def("dot_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(SERVELAB_NS, CPU, m) {
  m.impl("dot_linear", &dot_linear);
}
