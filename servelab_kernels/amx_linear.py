"""bf16 linears on AMX tiles (csrc/cpu_gemm_amx.cpp, built with servelab_kernels.cpu_ops), for CPUs with
AMX-BF16 (Sapphire Rapids and later).

A decode step of a small model at batch 16-64 reads every weight once and multiplies it by a few
dozen rows. oneDNN's GEMM over its own packed weight spent twice the time the weights take to
stream from memory there, so steps of `GEMV_ROWS_TILES` + 1 to `TILE_ROWS` rows (servelab_kernels.linear)
multiply by a copy laid out for the tiles (`pack`: blocks of 32 output columns, each one
contiguous run of 1 KB tiles, so a block streams in one pass) with every row of the step while
the block sits in L1/L2: two weight tiles and two 16-row activation tiles, four `tdpbf16ps` per
32 inputs, fp32 sums rounded once to bf16 as oneDNN rounds them (their order differs, so the two
agree to a rounding; bit for bit on 99-100 % of the outputs measured). The activations are read in
place. Measured on a 2-core Xeon (`python -m benchmarks.amx_linear`, reports/amx-linear): 1.2-1.9x
oneDNN on SmolLM2's layers at 8-128 rows warm, and the 120 layer linears of a 64-row step out of
memory 1.2x faster.

`linear_ref` in servelab_kernels.linear (fp32 sums rounded once) is the kernel's twin, `pack_ref` the
layout's. `enabled(False)` turns the tiles off for A/B runs (`backend.amx_linear=false` does so for
one engine's steps): bf16 linears then take oneDNN's packed weights, as before.
"""

from __future__ import annotations

import torch

from servelab_kernels import cpu_ops
from servelab_kernels.cpp_build import has_amx
from servelab_kernels.dispatch import Switch

switch = Switch()
_READY: bool | None = None


def enabled(on: bool):
    """`with amx_linear.enabled(False):` bf16 linears take oneDNN's packed weights instead."""
    return switch.set(on)


def ready() -> bool:
    """Whether this build multiplies bf16 on AMX tiles here (the CPU has AMX-BF16, the build has the
    op, Linux granted the tile state); asked once."""
    global _READY
    if _READY is None:
        _READY = has_amx() and cpu_ops.load() is not None and bool(cpu_ops.load().amx_linear_ready())
    return _READY


def fits(weight: torch.Tensor) -> bool:
    """The tiles' shapes: out_features a multiple of 16, in_features of 32."""
    n, k = weight.shape
    return n % 16 == 0 and k % 32 == 0


def use(weight: torch.Tensor) -> bool:
    """Whether a bf16 Linear's packed copy is laid out for the tiles rather than by oneDNN."""
    return switch.on and fits(weight) and ready()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 laid out for the tiles (flat, N * K elements; `pack_ref` is its twin)."""
    return cpu_ops.load().amx_pack(weight.detach())


def pack_ref(weight: torch.Tensor) -> torch.Tensor:
    """The tiles' layout in torch: blocks of 32 output columns (the last may be 16), each its K / 32
    steps in order, a step the block's 16-column halves side by side, a half 16 input pairs x 16
    columns x the pair (element (r, c, e) = W[n0 + 16 h + c][32 kb + 2 r + e])."""
    n, k = weight.shape
    parts = []
    for n0 in range(0, n, 32):
        halves = weight[n0:n0 + 32].reshape(-1, 16, k // 32, 16, 2)  # [h, c, kb, r, e]
        parts.append(halves.permute(2, 0, 3, 1, 4).reshape(-1))  # [kb, h, r, c, e]
    return torch.cat(parts)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias, added before the rounding) on the tiles, `packed` = pack(W)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return cpu_ops.load().amx_linear(rows, packed, n, bias).view(*x.shape[:-1], n)
