"""The torch twins of the C++ INT4 / INT8 kernels' activation rounding and sums (servelab_kernels.cpu_quant):
the tests hold each kernel to its twin within float summation order, and the twins document what the
kernels compute."""

from __future__ import annotations

import torch

from servelab_kernels.cpu_quant import GROUP, Q16, unpack_q4


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq int8-valued float [M, K/32, 32], scale dx [M, K/32], exact sums sx [M, K/32])."""
    xg = x.float().reshape(x.shape[0], -1, GROUP)
    amax = xg.abs().amax(dim=-1)
    # 127 / amax as the kernel divides (a scalar over a tensor is reciprocal-then-multiply in torch,
    # an ulp off, which moves bf16 inputs at rounding ties to the other side)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xg * inv[..., None]), amax / 127.0, xg.sum(dim=-1)


def q4_linear_ref(x: torch.Tensor, nibbles: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    xq, dx, sx = quantize_rows_ref(x)
    q, d, m = unpack_q4(nibbles, dm)
    isum = torch.einsum("mgi,ngi->mng", xq.double(), q.reshape(q.shape[0], -1, GROUP).double()).float()
    y = (isum * dx[:, None, :] * d[None]).sum(-1) + sx @ m.T
    return y.to(x.dtype)


def q4_gemm_ref(x: torch.Tensor, nibbles: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The INT4 GEMM's twin (`q4_gemm_int`): x to 14-bit integers per group of 32 (absmax / 8191),
    exact integer group sums, scaled per group."""
    xg = x.float().reshape(x.shape[0], -1, GROUP)
    amax = xg.abs().amax(dim=-1)
    inv = torch.where(amax > 0, torch.full_like(amax, Q16) / amax, torch.zeros_like(amax))  # as the kernel divides
    xq = torch.round(xg * inv[..., None])
    q, d, m = unpack_q4(nibbles, dm)
    isum = torch.einsum("mgi,ngi->mng", xq.double(), q.reshape(q.shape[0], -1, GROUP).double()).float()
    y = (isum * (amax / Q16)[:, None, :] * d[None]).sum(-1) + xg.sum(dim=-1) @ m.T
    return y.to(x.dtype)


def round_rows_ref(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x to integers of `levels` a side (one scale a row, half to even), as the INT8
    kernels round: (integer-valued fp32 rows, each row's largest magnitude)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # levels / amax as the kernel divides (a scalar over a tensor is reciprocal-then-multiply in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv), amax


def q8_linear_ref(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, levels: int = Q16) -> torch.Tensor:
    """The INT8 kernel's twin: x to 14-bit integers with one scale a row (absmax / 8191), or to
    INT8 (levels=A8: absmax / 127, W8A8)."""
    xq, amax = round_rows_ref(x, levels)
    isum = (xq.double() @ w.double().T).float()
    return (isum * (amax / levels) * scales.float()[None]).to(x.dtype)


def q8_bf16_ref(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`q8_gemm_bf16`'s twin: x times the INT8 weight, fp32 sums, each output scaled once, rounded."""
    return ((x.float() @ w.float().T) * scales.float()[None]).to(x.dtype)
