"""Fused projections: each layer's q/k/v as one matmul and gate/up as one, after quantization.

A decode step at small batch is one weight-streaming matmul after another, and each call has a
fixed cost (the call, the activations' quantization in the INT kernels, a thread fork) that is
large beside a 192-row k_proj. vLLM builds its models with merged QKV and gate-up layers; here the
model keeps Hugging Face's module names for loading and quantization, and this module swap (in
the manner of gpt-fast's quantization swaps) concatenates the matrices once they are final. It
applies where the three (or two) layers are the same kind and can be concatenated along their
outputs (`concat_rows`); anything else (a kept float layer beside quantized ones, the Triton INT4
layout) stays as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from servelab_kernels.quant import Int4Linear, Int8Linear


class FusedLinear(nn.Module):
    """One matmul whose output is split back into the layers it replaced."""

    def __init__(self, inner: nn.Module, sizes: list[int]) -> None:
        super().__init__()
        self.inner, self.sizes = inner, sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.inner(x).split(self.sizes, dim=-1)


def concat_rows(mods: list[nn.Module]) -> nn.Module | None:
    """One layer computing all of `mods` (same input, outputs side by side), or None."""
    kinds = {type(m) for m in mods}
    biased = {getattr(m, "bias", None) is not None for m in mods}
    if len(kinds) != 1 or len(biased) != 1:
        return None
    kind = kinds.pop()
    if issubclass(kind, nn.Linear):
        w = torch.cat([m.weight.data for m in mods])
        # no initialisation: the concatenated weights replace it at once
        lin = nn.utils.skip_init(kind, w.shape[1], w.shape[0], bias=biased.pop(), device=w.device, dtype=w.dtype)
        lin.weight.data = w
        if lin.bias is not None:
            lin.bias.data = torch.cat([m.bias.data for m in mods])
        return lin.requires_grad_(False)
    if kind in (Int4Linear, Int8Linear):
        return kind.concat(mods)
    return None


def fuse_projections(model: nn.Module) -> nn.Module:
    """Swap each layer's q/k/v and gate/up for fused layers where they concatenate (in place);
    `model.fused_projections` says how many were."""
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
            continue  # fused already (an engine built again on the same loaded model)
        qkv = concat_rows([attn.q_proj, attn.k_proj, attn.v_proj])
        if qkv is not None:
            sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
            attn.qkv_proj = FusedLinear(qkv, sizes)
            del attn.q_proj, attn.k_proj, attn.v_proj
            fused += 1
        gate_up = concat_rows([mlp.gate_proj, mlp.up_proj])
        if gate_up is not None:
            mlp.gate_up_proj = FusedLinear(gate_up, [mlp.gate_proj.out_features, mlp.up_proj.out_features])
            del mlp.gate_proj, mlp.up_proj
            fused += 1
    model.fused_projections = fused
    return model
