"""A decode-only step of a Llama-family model in one C++ call (csrc/cpu_decode.cpp).

At batch 1 a step of the eager CPU forward is mostly Python: SmolLM2's 30 layers make about 400
kernel calls, and each comes with a module call, the dispatch tests of servelab_kernels.linear and
servelab_kernels.cpu_ops and a few views, about 7 of a step's 11 ms on a 2-core EPYC (2026-12-02,
`python -m benchmarks.profile_step quant=gguf`). `DecodePlan` holds every layer's weights and
KV cache and runs the layers in C++, calling the very kernels the eager forward calls, with the
same inputs, in the same order, through the dispatcher (unboxed: the op handles are looked up
once). So its hidden states are the eager forward's bit for bit (tests/test_cpu_decode.py), and
each linear takes the path the eager one would at that number of rows.

`linear_spec` says how a linear layer computes in the eager forward (None where the plan cannot
reproduce it: AWQ input scales, the aten INT4 layout, fp32 INT8 fallbacks...); `settings()` is
what the plan bakes in from the process-wide switches, so its holder rebuilds it when they change
(A/B benchmarks turn them off and on).
"""

from __future__ import annotations

import torch
from torch import nn

from servelab_kernels import amx_linear, cpu_ops, cpu_quant, dot_linear, fp32_linear, linear
from servelab_kernels.cpp_build import build, namespace
from servelab_kernels.dispatch import _forced
from servelab_kernels.quant import Int4Linear, Int8Linear

DENSE, INT4, INT8, TILES, INT8_A8, DOT, FP32 = 0, 1, 2, 3, 4, 5, 6  # csrc/cpu_decode.cpp's LinearKind


def load():
    """The DecodePlan class (torch.classes), or None where a build it needs did not build."""
    if cpu_ops.load() is None:  # its ops must be registered before a plan looks them up
        return None
    ns = build("cpu_decode", fast_math=False)
    return None if ns is None else getattr(torch.classes, ns).DecodePlan


def new_plan(cos: torch.Tensor, sin: torch.Tensor, final_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, intermediate: int, eps: float, scale: float, attention_op: str):
    """An empty DecodePlan (add its layers, then their four linears each) with this process's
    thresholds and switches; `attention_op` writes a decode step's K/V and attends (the qualified
    name of a torch op with csrc/cpu_attention.cpp's write_and_decode signature)."""
    ops_ns, quant_ns = namespace("cpu_ops", portable=False), namespace("cpu_quant", portable=False)
    quant = cpu_quant.ops() is not None
    ops = [f"{ops_ns}::rms_norm", f"{ops_ns}::rotary", f"{ops_ns}::silu_mul", f"{ops_ns}::bf16_linear", attention_op,
           f"{quant_ns}::q4_matmul" if quant else "", f"{quant_ns}::q8_matmul" if quant else "",
           f"{ops_ns}::amx_linear" if amx_linear.ready() else "", f"{ops_ns}::dot_linear" if dot_linear.ready() else "",
           f"{ops_ns}::fp32_linear" if fp32_linear.ready() else ""]
    sizes = [num_heads, num_kv_heads, head_dim, intermediate, linear.gemv_rows(), cpu_quant.q4_gemv_rows(),
             cpu_quant.q8_gemv_rows(), int(cpu_quant._int_gemm.on), linear.TILE_ROWS, int(cpu_quant._bf16_dot.on)]
    return load()(cos, sin, final_norm, sizes, float(eps), float(scale), ops)


def settings() -> tuple:
    """The switches and thresholds a plan is built with: rebuild it when these change."""
    return (linear.gemv_rows(), linear._pack_weights.on, amx_linear.switch.on, dot_linear.switch.on, fp32_linear.switch.on,
            fp32_linear.bf16_lines.on,            cpu_ops._enabled.on, _forced.on, cpu_quant.q4_gemv_rows(), cpu_quant.q8_gemv_rows(),
            cpu_quant._int_gemm.on, cpu_quant._bf16_dot.on)


def unusable(dtype: torch.dtype) -> str | None:
    """Why the eager forward's elementwise ops would not be the C++ ones here, or None."""
    if _forced.on:
        return "the Triton kernels are forced"
    if not cpu_ops.use_cpu_ops(torch.empty(0, dtype=dtype)):
        return "the C++ elementwise ops are off (servelab_kernels.cpu_ops) or did not build"
    return None


def linear_spec(mod: nn.Module, dtype: torch.dtype) -> tuple | None:
    """(kind, gemv, weight, second, packed, bias) of `mod` as the eager forward computes it on
    activations of `dtype`, or None where the plan cannot."""
    bias = getattr(mod, "bias", None)
    if type(mod) is linear.Linear:
        w = mod.weight
        if w.dtype != dtype or w.device.type != "cpu":
            return None
        probe = w.new_empty(1, w.shape[1])  # the eager tests look at x's dtype and width only
        packed = mod.packed_weight() if linear.use_packed(probe, w) else None
        layout = linear._layout(w) if packed is not None else None  # the copy the eager Linear takes
        if layout in ("dot", "fp32", "fp32-bf16"):  # the eager Linear takes these tiles at every row count
            return DOT if layout == "dot" else FP32, False, w, None, packed, bias
        return TILES if layout == "tiles" else DENSE, linear.use_gemv(probe, w, bias), w, None, packed, bias
    if type(mod) is Int4Linear:
        if mod.layout != "cpu_q4" or mod.input_scale is not None or mod.padded_in != mod.in_features:
            return None
        return INT4, False, mod.weight_packed, mod.dm, None, bias
    if type(mod) is Int8Linear:
        if not mod.fast or mod.weight_q.device.type != "cpu" or mod.in_features % cpu_quant.GROUP or \
                not cpu_quant.available():
            return None
        return INT8_A8 if mod.a8 else INT8, False, mod.weight_q, mod.scales, mod.packed, bias
    return None
