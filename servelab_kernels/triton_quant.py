"""Triton twins of the weight-only quantized matmuls in servelab_kernels.quant: the weights are read as
int8 (or two int4 nibbles a byte) and dequantized inside the matmul, never materialized as floats.

- int8: y = (x @ q^T) * scale[n]; the per-channel scale factors out of the K loop.
- int4: each K step is one quantization group, so its scale s and zero z are constant there and
  x . ((q - 8) s + z) = s (x . (q - 8)) + z (sum of x over the group); even and odd K positions
  (the low and high nibbles) are two half-width dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _int8_kernel(X, W, S, Y, M, N, K, sxm, sxk, swn, swk, sym, syn,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None].to(tl.int64) * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        w = tl.load(W + rn[None, :].to(tl.int64) * swn + kk[:, None] * swk, mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0).to(tl.float32)
        acc += tl.dot(x, w, input_precision=PRECISION)
    s = tl.load(S + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn, (acc * s[None, :]).to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] int8 * scales [N]).T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, 64))
    _int8_kernel[grid](x, q, scales, y, m, n, k, x.stride(0), x.stride(1), q.stride(0), q.stride(1), y.stride(0),
                       y.stride(1), BM=bm, BN=64, BK=64, PRECISION=_precision(x.dtype))
    return y


def pack_int4_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> uint8 [N, K/2]: the even position in the low nibble, the odd in the high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


@triton.jit
def _int4_kernel(X, P, S, Z, Y, M, N, K, sxm, sxk, spn, spk, ssg, ssn, sym, syn,
                 BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    j = tl.arange(0, GROUP // 2)
    mm = rm[:, None] < M
    nm = rn[None, :] < N
    acc = tl.zeros([BM, BN], tl.float32)
    for g in range(0, K // GROUP):
        k0 = g * GROUP
        xe = tl.load(X + rm[:, None].to(tl.int64) * sxm + (k0 + 2 * j)[None, :] * sxk, mask=mm, other=0.0).to(tl.float32)
        xo = tl.load(X + rm[:, None].to(tl.int64) * sxm + (k0 + 2 * j + 1)[None, :] * sxk, mask=mm,
                     other=0.0).to(tl.float32)
        p = tl.load(P + rn[None, :].to(tl.int64) * spn + (k0 // 2 + j)[:, None] * spk, mask=nm, other=0).to(tl.int32)
        lo = (p & 15).to(tl.float32) - 8.0
        hi = ((p >> 4) & 15).to(tl.float32) - 8.0
        s = tl.load(S + g * ssg + rn * ssn, mask=rn < N, other=0.0).to(tl.float32)
        z = tl.load(Z + g * ssg + rn * ssn, mask=rn < N, other=0.0).to(tl.float32)
        dots = tl.dot(xe, lo, input_precision=PRECISION) + tl.dot(xo, hi, input_precision=PRECISION)
        xsum = tl.sum(xe, 1) + tl.sum(xo, 1)
        acc += dots * s[None, :] + xsum[:, None] * z[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn, acc.to(Y.dtype.element_ty), mask=mm & nm)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(packed [N, K/2], scales/zeros [K/g, N]).T with w = (q - 8) * scale + zero."""
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, bm), triton.cdiv(n, 64))
    _int4_kernel[grid](x, packed, scales, zeros, y, m, n, k, x.stride(0), x.stride(1), packed.stride(0),
                       packed.stride(1), scales.stride(0), scales.stride(1), y.stride(0), y.stride(1), BM=bm, BN=64,
                       GROUP=group_size, PRECISION=_precision(x.dtype))
    return y
