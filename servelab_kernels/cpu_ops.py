"""The eager CPU forward's elementwise ops in C++, one pass each (csrc/cpu_ops.cpp).

A decode step of a small model on the CPU spends about a quarter of its time in small ops around
the matmuls: each RMSNorm is eight torch ops (the residual add, a cast, pow, mean, rsqrt, two
multiplies, a cast back), rotary a dozen, silu-and-multiply two, each a dispatch, an allocation
and a pass over memory for a few kilobytes of work. Here each is one call and one pass:

- `rms_norm`: norm(x), or norm(x + residual) with the sum returned as the new residual;
- `rotary`: rotate-half of q or k at their positions (strided views of the fused qkv output read
  in place);
- `silu_mul`: silu(gate) * up, the MLP's activation (the halves of the fused gate-up output);
- `argmax`: each row's first maximum, greedy sampling's pick (torch's `max(dim)` reads 64 bf16
  rows of 49,152 logits at about 5 GB/s on one thread).

The same build holds the bf16 GEMV of few-row linears (csrc/cpu_gemv.cpp) and the bf16 GEMMs of the
steps above it: on AMX tiles (csrc/cpu_gemm_amx.cpp) or, on AVX512-BF16 CPUs without them, on dot
products (csrc/cpu_gemm_dot.cpp), all used by servelab_kernels.linear.

Each rounds every intermediate its torch twin stores in the model's dtype (servelab_kernels.norm,
servelab_kernels.rotary, servelab_kernels.activation), so results match the twins exactly for rotary and to the
last bit of a row's summation order or of exp for the others (the tests hold them to that).
`backend.compile=true` keeps the twins, which inductor fuses itself (`use_cpu_ops`).
"""

from __future__ import annotations

import torch

from servelab_kernels.cpp_build import build
from servelab_kernels.dispatch import Switch

DTYPES = (torch.bfloat16, torch.float32)
_enabled = Switch()


def load():
    """The compiled module (built on first use, then cached per machine), or None if it cannot build."""
    return build("cpu_ops", fast_math=False, parts=("cpu_gemv", "cpu_gemm_amx", "cpu_gemm_dot", "cpu_gemm_fp32"),
                 prelude=("cpu_amx", "cpu_bf16_tile", "cpu_fp32_tile"),
                 functions=["rms_norm", "rotary", "silu_mul", "argmax", "bf16_linear", "bf16_dot_native", "amx_pack",
                            "amx_linear", "amx_linear_ready", "dot_linear", "dot_linear_ready",
                            "fp32_linear", "fp32_linear_ready"])


def use_cpu_ops(*tensors: torch.Tensor | None) -> bool:
    """Whether an op on these tensors (None: an absent optional one) runs here: CPU tensors of one
    dtype, bf16 or fp32, outside autograd and outside torch.compile's tracing, the build available."""
    given = [t for t in tensors if t is not None]
    if not _enabled.on or torch.compiler.is_compiling() or given[0].dtype not in DTYPES:
        return False
    grad = torch.is_grad_enabled()
    if any(t.device.type != "cpu" or t.dtype != given[0].dtype or (grad and t.requires_grad) for t in given):
        return False
    return load() is not None


def disabled():
    """The torch twins serve inside this block (benchmarks.eager_ops measures one against the other)."""
    return _enabled.set(False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """servelab_kernels.norm.rms_norm_ref: (normalized, new residual or None)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if residual is None:
        (out,) = load().rms_norm(rows, weight, float(eps), None)
        return out.view(shape), None
    out, res = load().rms_norm(rows, weight, float(eps), residual.reshape(-1, shape[-1]))
    return out.view(shape), res.view(shape)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """servelab_kernels.rotary.rotary_ref: q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] -> rotated."""
    module = load()
    return module.rotary(q, positions, cos, sin), module.rotary(k, positions, cos, sin)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.max(dim=-1).indices` for [rows, vocab] (the first maximum; NaN counts as the largest)."""
    return load().argmax(logits)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """servelab_kernels.activation.silu_mul_ref for rows of gate and up."""
    shape = gate.shape
    return load().silu_mul(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])).view(shape)
