"""RMSNorm, fused with the residual add: the torch reference and the dispatch to its Triton twin
(CUDA) or its C++ twin (the eager CPU forward, servelab_kernels.cpu_ops).

With a residual, `x + residual` becomes the new residual and is normalized, in one pass (the
pre-norm decoder layer's pattern), instead of an add and a norm that each read the row.
"""

from __future__ import annotations

import torch

from servelab_kernels.dispatch import use_triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Returns (normalized, new residual); the residual is None when none was given."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y, residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if use_triton(x):
        from servelab_kernels.triton_ops import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual)
    from servelab_kernels import cpu_ops

    if cpu_ops.use_cpu_ops(x, weight, residual):
        return cpu_ops.rms_norm(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
