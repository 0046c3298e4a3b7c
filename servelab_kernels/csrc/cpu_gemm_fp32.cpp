// fp32 x fp32 (or bf16) -> fp32 matmul on AVX2 FMA over a weight packed once, for CPUs without AVX-512 (where
// model.dtype=auto runs fp32): see servelab_kernels/fp32_linear.py. Built with cpu_ops, after
// csrc/cpu_fp32_tile.cpp (the register tiles).
//
// y[M, N] = x[M, K] . W[N, K]^T (+ bias). The weight is laid out once (`fp32_linear.pack`: per 16
// outputs, K lines of 16 floats), so a panel of 16 outputs is one sequential stream. Each panel
// (all K, in L1/L2) is multiplied by every row of the step in 6 x 16 register tiles; the panels are
// shared out between the threads.
bool fp32_linear_ready() {
#ifdef SERVELAB_FP32_TILES
  return true;
#else
  return false;
#endif
}

torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "fp32_linear: x fp32 [M, K] with contiguous columns");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == 16 && packed.is_contiguous() &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) &&
                  packed.size(1) == x.size(1),
              "fp32_linear: packed must be fp32_linear.pack of a weight [N, K] with x's K (fp32 or bf16 lines)");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = panels * 16;
  TORCH_CHECK(!bias || bias->numel() == N, "fp32_linear: bias [N]");
#ifdef SERVELAB_FP32_TILES
  const auto xc = x.stride(0) == K ? x : x.contiguous();  // rows back to back, as the tiles read them
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  at::Tensor b;
  if (bias) b = bias->to(at::kFloat).contiguous();
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  auto run = [&](auto* wp) {
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        fp32tile::panel(wp + p * 16 * K, M, K, xp, bp ? bp + p * 16 : nullptr, yp + p * 16, N);
    });
  };
  if (packed.scalar_type() == at::kBFloat16)  // widened as the tiles stream it (see cpu_fp32_tile.cpp)
    run(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()));
  else
    run(packed.data_ptr<float>());
  return y;
#else
  (void)M, (void)K;
  TORCH_CHECK(false, "fp32_linear: this build has no AVX2 FMA tiles (or the CPU has AVX-512, where oneDNN's serve)");
#endif
}

TORCH_LIBRARY_FRAGMENT(SERVELAB_NS, m) {
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(SERVELAB_NS, CPU, m) {
  m.impl("fp32_linear", &fp32_linear);
}
