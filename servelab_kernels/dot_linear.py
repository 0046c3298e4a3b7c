"""bf16 linears on bf16 dot products over a weight packed once (csrc/cpu_gemm_dot.cpp, built with
servelab_kernels.cpu_ops), for CPUs with AVX512-BF16 and no AMX tiles (AMD Zen 4 and later).

A bf16 Linear multiplied by the C++ GEMV up to 16 rows and above by a copy of its weight that oneDNN
packed once. On a 2-core Zen 4 oneDNN's GEMM reaches 280-350 GFLOP/s on SmolLM2's layers at 17-64
rows, where the CPU's bf16 dot products give about 430, and the GEMV streamed weights out of cache
at 14-18 GB/s. Here the copy is laid out for `vdpbf16ps` (`pack`: per 16
outputs, K/2 lines of 16 outputs x 2 inputs) and each panel of 48 outputs, held in L2, is
multiplied by every row of the step in register tiles of 8 rows x 48 outputs (csrc/cpu_bf16_tile.cpp,
shared with cpu_quant's W8A16 GEMM). Sums are fp32, rounded once to bf16 after the bias, as oneDNN
rounds them; the order differs, so the two agree to a bf16 rounding. Measured on that Zen 4, 8
distinct weights of each layer shape a round (medians of 7 rounds): 1.27-1.35x oneDNN's packed GEMM
at 17-48 rows, 1.18x at 64, 1.13x at 96, 1.06x at 128, 1.0-1.15x at 256-1,024; the head (49,152 x
576) 1.15x at 17-24 rows, 1.04x at 64, 0.97-0.99x at 128-512. It takes every row count, one row
too: against the GEMV, 6 distinct weights a shape, 1.5-1.8x on the gate/up and head weights at 1-4
rows, 1.2-1.45x on all at 8-24, 0.86-0.95x only on the small q/k/v and o weights at 1-2 rows (warm in
L3 in that test); a batch-1 decode step of the embedded model 10.7 ms against 19.0 (1.76x), 8 rows
1.30x, 16 rows 1.23x (medians of 7 alternating rounds). `python -m benchmarks.packed_linear --dot`
has the engine-level A/B.

`linear_ref` in servelab_kernels.linear is the kernel's twin. `enabled(False)` turns it off for A/B runs: bf16 linears then take oneDNN's packed weights, as before.
"""

from __future__ import annotations

import torch

from servelab_kernels import cpu_ops
from servelab_kernels.cpp_build import has_amx
from servelab_kernels.dispatch import Switch

switch = Switch()
_READY: bool | None = None


def enabled(on: bool):
    """`with dot_linear.enabled(False):` bf16 linears take oneDNN's packed weights instead."""
    return switch.set(on)


def ready() -> bool:
    """Whether bf16 linears multiply on this kernel here: the build has AVX512-BF16, the CPU no AMX
    tiles (oneDNN's GEMM runs on those, and amx_linear where it serves); asked once."""
    global _READY
    if _READY is None:
        _READY = not has_amx() and cpu_ops.load() is not None and bool(cpu_ops.load().dot_linear_ready())
    return _READY


def fits(weight: torch.Tensor) -> bool:
    """The layout's shapes: out_features a multiple of 16, in_features even."""
    n, k = weight.shape
    return n % 16 == 0 and k % 2 == 0


def use(weight: torch.Tensor) -> bool:
    """Whether a bf16 Linear's packed copy is laid out for this kernel rather than by oneDNN."""
    return switch.on and fits(weight) and ready()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 as [N/16, K/2, 16, 2]: element (b, l, c, e) = W[16 b + c][2 l + e]."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias, added before the rounding), `packed` = pack(W)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = packed.shape[0] * 16
    return cpu_ops.load().dot_linear(rows, packed, bias).view(*x.shape[:-1], n)
