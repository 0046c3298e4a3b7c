"""fp32 linears on AVX2 FMA over a weight packed once (csrc/cpu_gemm_fp32.cpp and the tiles of
csrc/cpu_fp32_tile.cpp, built with servelab_kernels.cpu_ops), for CPUs without AVX-512: where
`model.dtype=auto` runs fp32 (no native bf16).

There `F.linear` hands MKL/oneDNN a plain fp32 weight at every call. On a 2-core Zen 3 (AVX2 only) a
decode step's 120 layer linears of SmolLM2 took 39 ms at 1 row (weights read at 11 GB/s; a read probe
gives 33.5 idle) and 54-87 ms at 4-16 rows (12-53 GFLOP/s): small-row GEMMs pay for re-laying out the
weight. oneDNN's fp32 copy packed once helped (29-52 ms) but not to the memory floor. Here the copy is
laid out per 16 outputs as K lines of 16 floats (`pack`), one sequential stream a panel, and each
panel is multiplied by every row of the step in register tiles of 6 rows x 16 outputs, the panels
shared out between the threads. Measured there (30 distinct weights of each layer shape, medians):
18.4 ms at 1 row (425 MB of weights at 23 GB/s; 2.1x F.linear, 1.6x oneDNN's packed copy), 22-26 ms
at 4-8 rows (2.1-3.1x F.linear), 37 ms at 16 (1.7x), 55 ms at 32 (1.55x), 101 ms at 64 (1.31x), 1.2x
at 128-512 rows (170 GFLOP/s; F.linear reaches 177-187 at 2048^3). `python -m benchmarks.packed_linear
--fp32` has the engine-level A/B. cpu_quant's fp32 path runs the same tiles over INT8 / INT4 weights
dequantized a panel at a time.

Sums run over k in order, one FMA a product, the bias added last: the same products as F.linear in
another order, so the two agree to fp32 rounding. `enabled(False)` turns it off for A/B runs:
fp32 linears then take F.linear, as before.

The copy may be packed in bf16 instead (`weights("bf16")`, `backend.fp32_linear_weights`, which
`model.dtype=auto` takes where it ran fp32 for want of native bf16): the same tiles widen each line
as they stream it (two unpacks, no lane crossing), the products and sums stay fp32, and a step
streams half the bytes. Measured on the 2-core Zen 3 (30 layers of SmolLM2's four linear shapes plus
the head, fp32 activations, alternating, medians): 1.6-1.8x the fp32 copy at 1-4 rows, 1.3-1.4x at
8-24, 1.0-1.2x at 32-256 (compute-bound there; widening the panel once per call instead was no
better). The weights are then rounded to bf16, the products exact in fp32: `linear_ref(x, W.bf16())`.
"""

from __future__ import annotations

import torch

from servelab_kernels import cpu_ops
from servelab_kernels.dispatch import Switch

switch = Switch()
bf16_lines = Switch(False)  # the packed copies in bf16 (the layout "fp32-bf16" of servelab_kernels.linear)
_READY: bool | None = None


def enabled(on: bool):
    """`with fp32_linear.enabled(False):` fp32 linears take F.linear instead."""
    return switch.set(on)


def weights(dtype: str):
    """`with fp32_linear.weights("bf16"):` fp32 linears multiply by a copy packed in bf16 (half the
    bytes a step streams; the products still in fp32), "fp32" by one in fp32."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"fp32_linear.weights: 'fp32' or 'bf16', not {dtype!r}")
    return bf16_lines.set(dtype == "bf16")


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    return pack(weight, torch.bfloat16)


def ready() -> bool:
    """Whether fp32 linears multiply on this kernel here: the build has AVX2 and FMA and the CPU no
    AVX-512 (oneDNN's AVX-512 GEMM serves there); asked once."""
    global _READY
    if _READY is None:
        _READY = cpu_ops.load() is not None and bool(cpu_ops.load().fp32_linear_ready())
    return _READY


def fits(weight: torch.Tensor) -> bool:
    """The layout's shape: out_features a multiple of 16."""
    return weight.shape[0] % 16 == 0


def use(weight: torch.Tensor) -> bool:
    """Whether an fp32 Linear multiplies by a copy packed for this kernel."""
    return switch.on and weight.dtype == torch.float32 and fits(weight) and ready()


# A bf16 line's column order (csrc/cpu_fp32_tile.cpp): interleaved with zeros, its two halves
# give outputs 0-7 and 8-15 as fp32.
BF16_LINE = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] as [N/16, K, 16]: element (p, k, c) = W[16 p + c][k] in fp32; in bf16 (rounded to
    nearest) element (p, k, c) = W[16 p + BF16_LINE[c]][k]."""
    n, k = weight.shape
    lines = weight.detach().reshape(n // 16, 16, k)
    if dtype == torch.bfloat16:
        lines = lines[:, list(BF16_LINE)].to(torch.bfloat16)
    elif dtype != torch.float32:
        raise ValueError(f"fp32_linear.pack: fp32 or bf16 lines, not {dtype}")
    return lines.transpose(1, 2).contiguous()


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's twin: x @ W.T + bias in fp32."""
    y = x.float() @ weight.float().T
    return y + bias.float() if bias is not None else y


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias), `packed` = pack(W)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = packed.shape[0] * 16
    return cpu_ops.load().fp32_linear(rows, packed, bias).view(*x.shape[:-1], n)
