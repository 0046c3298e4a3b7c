"""Rotary position embedding (rotate-half, the Hugging Face layout) of q and k together: the torch
reference and the dispatch to its Triton twin (CUDA) or its C++ twin (the eager CPU forward,
servelab_kernels.cpu_ops). cos/sin are fp32 tables [max_len, head_dim / 2]."""

from __future__ import annotations

import torch

from servelab_kernels.dispatch import use_triton


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim] -> rotated (q, k)."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    half = q.shape[-1] // 2
    if use_triton(q) and half & (half - 1) == 0:  # the kernel wants head_dim / 2 a power of two
        from servelab_kernels.triton_ops import rotary as triton_rotary

        return triton_rotary(q, k, positions, cos, sin)
    from servelab_kernels import cpu_ops

    if cpu_ops.use_cpu_ops(q, k) and cos.dtype == sin.dtype == torch.float32:
        return cpu_ops.rotary(q, k, positions.long(), cos, sin)
    return rotary_ref(q, k, positions, cos, sin)
