"""The MLP's activation, silu(gate) * up: the torch reference and the dispatch to its C++ twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from servelab_kernels import cpu_ops

    if cpu_ops.use_cpu_ops(gate, up):
        return cpu_ops.silu_mul(gate, up)
    return silu_mul_ref(gate, up)
