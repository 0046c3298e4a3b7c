// A decode-only step of a Llama-family model in one call: see servelab_kernels/cpu_decode.py.
//
// Every layer runs the same kernels the eager forward calls (the C++ norms, rotary, silu-and-
// multiply, GEMVs, INT4/INT8 matmuls, oneDNN's packed GEMM and the paged decode attention), in
// the same order and on the same inputs, so the hidden states are the eager forward's bit for bit.
// What goes is Python around them: a batch-1 step of the 30-layer SmolLM2 makes about 400 calls,
// each costing a module call, a dispatch test or two and a few views in the interpreter, which on
// a 2-core CPU came to more than half the step. Here each is an unboxed call through the
// dispatcher (the kernels live in their own builds), whose op handles are looked up once.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include <string>
#include <vector>

namespace {

// The C++ signatures the ops were registered with (a typed call must name them exactly).
using RmsNormFn = std::vector<at::Tensor>(at::Tensor, at::Tensor, double, c10::optional<at::Tensor>);
using RotaryFn = at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor);
using SiluMulFn = at::Tensor(at::Tensor, at::Tensor);
using Bf16LinearFn = at::Tensor(at::Tensor, at::Tensor);
using WriteAndDecodeFn = at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                    at::Tensor, at::Tensor, double, c10::optional<at::Tensor>,
                                    c10::optional<at::Tensor>);
using Q4MatmulFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool);
using Q8MatmulFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, bool, int64_t,
                              const c10::optional<at::Tensor>&, bool);
using AmxLinearFn = at::Tensor(at::Tensor, at::Tensor, int64_t, c10::optional<at::Tensor>);
using DotLinearFn = at::Tensor(at::Tensor, at::Tensor, c10::optional<at::Tensor>);

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>();
}

// How one linear layer of the eager forward computes (servelab_kernels/linear.py, servelab_kernels/quant.py).
enum LinearKind : int64_t {
  DENSE = 0,  // servelab_kernels.linear.Linear: the GEMV up to gemv_rows (bf16, no bias), else oneDNN's packed
              // weight where there is one, else at::linear
  INT4 = 1,   // Int4Linear in the C++ kernel's layout: q4_matmul(x, nibbles, dm)
  INT8 = 2,   // Int8Linear on the C++ kernel: q8_matmul(x, q, scales)
  TILES = 3,  // servelab_kernels.linear.Linear on AMX CPUs: the GEMV up to gemv_rows, else amx_linear over the
              // weight laid out for the tiles up to tile_rows, else at::linear
  INT8_A8 = 4,  // Int8Linear with 8-bit activations (quant.w8a8): q8_matmul(x, q, scales, levels=127)
  DOT = 5,      // servelab_kernels.linear.Linear on AVX512-BF16 CPUs without AMX: dot_linear over the weight laid
                // out for bf16 dot products, at every number of rows
  FP32 = 6,     // servelab_kernels.linear.Linear, fp32 on AVX2 CPUs without AVX-512: fp32_linear over the weight
                // laid out for its FMA tiles, at every number of rows
};

constexpr int64_t Q8_LEVELS = 8191, A8_LEVELS = 127;  // csrc/cpu_quant.cpp's activation levels

struct Linear {
  int64_t kind = DENSE;
  int64_t levels = Q8_LEVELS;  // INT8: the activations' integer levels a side
  bool gemv = false;  // DENSE: the eager forward would take the GEMV at few rows
  at::Tensor weight, second, packed;  // DENSE / TILES: weight, -, packed | INT4: nibbles, dm, - | INT8: q, scales, VNNI copy
  c10::optional<at::Tensor> bias;
};

struct Layer {
  at::Tensor input_norm, post_norm, k_cache, v_cache;
  c10::optional<at::Tensor> k_scale, v_scale;  // an INT8 cache's fp16 scales
  Linear qkv, o, gate_up, down;
};

}  // namespace

struct DecodePlan : torch::CustomClassHolder {
  // sizes: [num_heads, num_kv_heads, head_dim, intermediate, gemv_rows, q4_gemv_rows, q8_gemv_rows, int_gemm,
  // tile_rows, bf16_dot]; ops: the qualified names of rms_norm, rotary, silu_mul, bf16_linear, the attention
  // backend's write-and-decode, q4_matmul, q8_matmul (those two "" where cpu_quant did not build),
  // amx_linear ("" where the build has no AMX tiles), dot_linear and fp32_linear ("" where they do not serve)
  DecodePlan(at::Tensor cos, at::Tensor sin, at::Tensor final_norm, std::vector<int64_t> sizes, double eps,
             double scale, std::vector<std::string> ops)
      : cos_(std::move(cos)), sin_(std::move(sin)), final_norm_(std::move(final_norm)), eps_(eps), scale_(scale),
        rms_norm_(op<RmsNormFn>(ops.at(0))),
        rotary_(op<RotaryFn>(ops.at(1))),
        silu_mul_(op<SiluMulFn>(ops.at(2))),
        bf16_linear_(op<Bf16LinearFn>(ops.at(3))),
        write_and_decode_(op<WriteAndDecodeFn>(ops.at(4))),
        linear_pointwise_(c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "")) {
    TORCH_CHECK(sizes.size() == 10 && ops.size() == 10, "DecodePlan: 10 sizes and 10 ops");
    heads_ = sizes[0], kv_heads_ = sizes[1], head_dim_ = sizes[2], inter_ = sizes[3];
    gemv_rows_ = sizes[4], q4_rows_ = sizes[5], q8_rows_ = sizes[6], int_gemm_ = sizes[7] != 0, tile_rows_ = sizes[8];
    bf16_dot_ = sizes[9] != 0;
    if (!ops[5].empty()) q4_matmul_ = op<Q4MatmulFn>(ops[5]);
    if (!ops[6].empty()) q8_matmul_ = op<Q8MatmulFn>(ops[6]);
    if (!ops[7].empty()) amx_linear_ = op<AmxLinearFn>(ops[7]);
    if (!ops[8].empty()) dot_linear_ = op<DotLinearFn>(ops[8]);
    if (!ops[9].empty()) fp32_linear_ = op<DotLinearFn>(ops[9]);
  }

  // k_scale, v_scale: an INT8 cache's scales (None for a bf16 / fp32 cache)
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache,
                 c10::optional<at::Tensor> k_scale, c10::optional<at::Tensor> v_scale) {
    TORCH_CHECK((k_cache.scalar_type() == at::kChar) == (k_scale.has_value() && v_scale.has_value()),
                "add_layer: an INT8 cache comes with its k_scale and v_scale, and only an INT8 cache");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(k_cache), std::move(v_cache),
                            std::move(k_scale), std::move(v_scale)});
  }

  // The last layer's linears, in order: qkv, o, gate_up, down.
  void add_linear(int64_t kind, bool gemv, at::Tensor weight, c10::optional<at::Tensor> second,
                  c10::optional<at::Tensor> packed, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers_.empty() && filled_ < 4 * int64_t(layers_.size()), "add_linear: add a layer first");
    TORCH_CHECK(kind == DENSE || (kind == INT4 && q4_matmul_.has_value() && second) ||
                    ((kind == INT8 || kind == INT8_A8) && q8_matmul_.has_value() && second) ||
                    (kind == TILES && amx_linear_.has_value() && packed) ||
                    (kind == DOT && dot_linear_.has_value() && packed) ||
                    (kind == FP32 && fp32_linear_.has_value() && packed),
                "add_linear: an INT4/INT8 layer needs its op and its second tensor, a TILES / DOT / FP32 layer "
                "amx_linear / dot_linear / fp32_linear and its packed weight");
    Layer& layer = layers_.back();
    Linear* slots[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    Linear& lin = *slots[filled_++ % 4];
    lin.kind = kind == INT8_A8 ? INT8 : kind, lin.levels = kind == INT8_A8 ? A8_LEVELS : Q8_LEVELS;
    lin.gemv = gemv, lin.weight = std::move(weight), lin.bias = std::move(bias);
    if (second) lin.second = *second;
    if (packed) lin.packed = *packed;
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // x: the embedded tokens [rows, hidden]; one new token a row, each its own sequence. Returns the
  // final norm's output [rows, hidden], having written every layer's K and V to the cache.
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor context_lens) {
    TORCH_CHECK(filled_ == 4 * int64_t(layers_.size()) && !layers_.empty(), "DecodePlan: incomplete layers");
    TORCH_CHECK(x.dim() == 2 && positions.size(0) == x.size(0), "DecodePlan: x [rows, hidden], a position a row");
    const int64_t rows = x.size(0), q_width = heads_ * head_dim_, kv_width = kv_heads_ * head_dim_;
    at::Tensor residual;
    for (Layer& layer : layers_) {
      if (!residual.defined()) {  // the first layer: its input is the residual stream
        residual = x;
        x = rms_norm_.call(x, layer.input_norm, eps_, c10::nullopt)[0];
      } else {
        auto normed = rms_norm_.call(x, layer.input_norm, eps_, residual);
        x = normed[0];
        residual = normed[1];
      }
      at::Tensor qkv = linear(layer.qkv, x);
      at::Tensor q = qkv.narrow(1, 0, q_width).view({rows, heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_width, kv_width).view({rows, kv_heads_, head_dim_});
      at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads_, head_dim_});
      q = rotary_.call(q, positions, cos_, sin_);
      k = rotary_.call(k, positions, cos_, sin_);
      at::Tensor o = write_and_decode_.call(q, k, v, layer.k_cache, layer.v_cache, slot_mapping, block_tables,
                                            context_lens, scale_, layer.k_scale, layer.v_scale);
      x = linear(layer.o, o.reshape({rows, q_width}));
      auto normed = rms_norm_.call(x, layer.post_norm, eps_, residual);
      x = normed[0];
      residual = normed[1];
      at::Tensor gate_up = linear(layer.gate_up, x);
      x = linear(layer.down, silu_mul_.call(gate_up.narrow(1, 0, inter_), gate_up.narrow(1, inter_, inter_)));
    }
    return rms_norm_.call(x, final_norm_, eps_, residual)[0];
  }

 private:
  at::Tensor linear(const Linear& lin, const at::Tensor& x) {
    const int64_t rows = x.size(0);
    at::Tensor y;
    switch (lin.kind) {
      case INT4:
        y = q4_matmul_->call(x, lin.weight, lin.second, q4_rows_, int_gemm_);
        break;
      case INT8:
        y = q8_matmul_->call(x, lin.weight, lin.second, q8_rows_, int_gemm_, lin.levels,
                             lin.packed.defined() ? c10::optional<at::Tensor>(lin.packed) : c10::nullopt, bf16_dot_);
        break;
      case TILES:
        if (lin.gemv && rows <= gemv_rows_) return bf16_linear_.call(x.stride(1) == 1 ? x : x.contiguous(), lin.weight);
        if (rows <= tile_rows_)
          return amx_linear_->call(x.stride(1) == 1 ? x : x.contiguous(), lin.packed, lin.weight.size(0), lin.bias);
        return at::linear(x, lin.weight, lin.bias);
      case DOT:
        return dot_linear_->call(x.stride(1) == 1 ? x : x.contiguous(), lin.packed, lin.bias);
      case FP32:
        return fp32_linear_->call(x.stride(1) == 1 ? x : x.contiguous(), lin.packed, lin.bias);
      default:
        if (lin.gemv && rows <= gemv_rows_) return bf16_linear_.call(x.stride(1) == 1 ? x : x.contiguous(), lin.weight);
        if (lin.packed.defined()) return packed_linear(x, lin);
        return at::linear(x, lin.weight, lin.bias);
    }
    if (y.scalar_type() != x.scalar_type()) y = y.to(x.scalar_type());
    return lin.bias ? y + *lin.bias : y;
  }

  // oneDNN's GEMM over the weight it packed once (servelab_kernels.linear.packed_linear); boxed, as aten
  // registers it: only steps of more than gemv_rows rows come here, where the GEMM dwarfs the call
  at::Tensor packed_linear(const at::Tensor& x, const Linear& lin) {
    torch::jit::Stack stack;
    stack.reserve(6);
    stack.emplace_back(x);
    stack.emplace_back(lin.packed);
    stack.emplace_back(lin.bias ? c10::IValue(*lin.bias) : c10::IValue());
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
    stack.emplace_back(std::string(""));
    linear_pointwise_.callBoxed(&stack);
    return stack.back().toTensor();
  }

  at::Tensor cos_, sin_, final_norm_;
  double eps_, scale_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, inter_ = 0, gemv_rows_ = 0, q4_rows_ = 0, q8_rows_ = 0,
          tile_rows_ = 0;
  bool int_gemm_ = false;  // the integer GEMMs of cpu_quant.int_gemm
  bool bf16_dot_ = true;   // W8A16's bf16 dot GEMM of cpu_quant.bf16_dot
  int64_t filled_ = 0;
  std::vector<Layer> layers_;
  c10::TypedOperatorHandle<RmsNormFn> rms_norm_;
  c10::TypedOperatorHandle<RotaryFn> rotary_;
  c10::TypedOperatorHandle<SiluMulFn> silu_mul_;
  c10::TypedOperatorHandle<Bf16LinearFn> bf16_linear_;
  c10::TypedOperatorHandle<WriteAndDecodeFn> write_and_decode_;
  c10::optional<c10::TypedOperatorHandle<Q4MatmulFn>> q4_matmul_;
  c10::optional<c10::TypedOperatorHandle<Q8MatmulFn>> q8_matmul_;
  c10::optional<c10::TypedOperatorHandle<AmxLinearFn>> amx_linear_;
  c10::optional<c10::TypedOperatorHandle<DotLinearFn>> dot_linear_;
  c10::optional<c10::TypedOperatorHandle<DotLinearFn>> fp32_linear_;
  c10::OperatorHandle linear_pointwise_;
};

TORCH_LIBRARY(SERVELAB_NS, m) {
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>, double, double,
                       std::vector<std::string>>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("add_linear", &DecodePlan::add_linear)
      .def("num_layers", &DecodePlan::num_layers)
      .def("forward", &DecodePlan::forward);
}
