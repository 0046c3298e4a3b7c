"""Triton twins of servelab_kernels.norm (RMSNorm fused with the residual add) and servelab_kernels.rotary."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, W, Y, RO, stride_x, stride_r, stride_y, stride_ro, n, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)  # the add rounds like torch's
        tl.store(RO + row * stride_ro + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    y = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * y).to(Y.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n = x2.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    ro = torch.empty_like(x2) if residual is not None else x2
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, y, ro, x2.stride(0), r2.stride(0), y.stride(0), ro.stride(0), n, eps,
                                  BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None)
    return y.view(shape), (ro.view(shape) if residual is not None else None)


@triton.jit
def _rotary_kernel(X, OUT, POS, COS, SIN, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                   HALF: tl.constexpr, H_PAD: tl.constexpr, NUM_HEADS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    h = tl.arange(0, H_PAD)
    hm = h < NUM_HEADS
    i = tl.arange(0, HALF)
    c = tl.load(COS + pos * stride_c + i)[None, :]
    s = tl.load(SIN + pos * stride_c + i)[None, :]
    base = X + t * stride_xt + h[:, None] * stride_xh
    x1 = tl.load(base + i[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + i[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
    out = OUT + t * stride_ot + h[:, None] * stride_oh
    tl.store(out + i[None, :], (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=hm[:, None])
    tl.store(out + HALF + i[None, :], (x2 * c + x1 * s).to(OUT.dtype.element_ty), mask=hm[:, None])


def _rotate(x: torch.Tensor, positions, cos, sin) -> torch.Tensor:
    tokens, heads, d = x.shape
    out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](x, out, positions, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                  cos.stride(0), HALF=d // 2, H_PAD=triton.next_power_of_2(heads), NUM_HEADS=heads)
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """head_dim / 2 must be a power of two (tl.arange's rule): 64- and 128-dim heads are."""
    return _rotate(q, positions, cos, sin), _rotate(k, positions, cos, sin)
