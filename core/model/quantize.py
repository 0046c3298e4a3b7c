"""What every weight quantizer needs: module swaps with mixed precision, and calibration data.

Quantization is a module swap (gpt-fast's way): each `nn.Linear` whose qualified name matches no
`keep` pattern is replaced by the quantizer's module. Calibration runs the model itself over
real prompts and records what each linear layer sees, for activation-aware scaling.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch

import torch
from torch import nn

from core.runner.metadata import AttentionMetadata
from servelab_kernels.quant import Int8Linear
from servelab_kernels.quant_embedding import QuantEmbedding


def swap_linears(model: nn.Module, make: Callable[[str, nn.Linear], nn.Module], keep: list[str]) -> list[str]:
    """Replace every Linear not matched by a `keep` glob (e.g. "lm_head", "model.layers.0.*");
    returns the names swapped."""
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and not any(fnmatch(name, p) for p in keep):
                setattr(parent, child_name, make(name, child))
                swapped.append(name)
    return swapped


def quantize_tied_embedding(model: nn.Module, swapped: list[str], bits: int, group_size: int = 64) -> bool:
    """When lm_head was quantized and the embedding is tied to it, quantize the embedding rows too,
    so the shared matrix is not kept in full precision just for the lookup."""
    if "lm_head" not in swapped or not model.args.tie_word_embeddings:
        return False
    emb = model.model.embed_tokens
    shared = model.lm_head if bits == 8 and isinstance(model.lm_head, Int8Linear) else None
    model.model.embed_tokens = QuantEmbedding(None if shared else emb.weight.data, bits, group_size,
                                              out_dtype=emb.weight.dtype, shared=shared)
    return True


def forward_prompt(model: nn.Module, token_ids: list[int], attention=None, kv_spec=None) -> torch.Tensor:
    """Logits [len, vocab] in fp32 of one prompt through servelab's model. With an attention backend and a
    KVCacheSpec, through a throwaway one-block cache of that spec (an int8 cache quantizes what
    attention reads, as in serving); without, a plain causal pass (calibration)."""
    t = len(token_ids)
    device = model.model.norm.weight.device
    ids, positions = torch.tensor(token_ids, device=device), torch.arange(t, device=device)
    with torch.inference_mode():
        if attention is None:
            return model.compute_logits(model(ids, positions)).float()
        kv = attention.allocate_kv_cache(1, t, kv_spec, device)
        lens = torch.tensor([t], device=device)
        meta = AttentionMetadata(
            slot_mapping=positions, block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            context_lens=lens, query_lens=lens, query_start_loc=torch.tensor([0, t], device=device), block_size=t,
            max_query_len=t, max_context_len=t, query_lens_cpu=[t], context_lens_cpu=[t], query_start_loc_cpu=[0, t],
            block_tables_cpu=[[0]],
        )
        meta.plan = attention.plan(meta)
        return model.compute_logits(model(ids, positions, meta, kv, attention)).float()


def observe_linear_inputs(model: nn.Module, prompts: list[list[int]], names: set[str] | None,
                          observe: Callable[[str, torch.Tensor], None]) -> None:
    """Run the calibration prompts through the model, calling observe(name, x [rows, K] fp32) with
    what each Linear named in `names` (None: every Linear) reads."""
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and (names is None or name in names):
            def hook(_m, inputs, _out, name=name):
                observe(name, inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float())
            hooks.append(mod.register_forward_hook(hook))
    try:
        for p in prompts:
            forward_prompt(model, p)
    finally:
        for h in hooks:
            h.remove()


def capture_linear_inputs(model: nn.Module, prompts: list[list[int]], max_rows: int = 512) -> dict[str, torch.Tensor]:
    """Per Linear (by name): up to `max_rows` input rows seen over the calibration prompts (fp32)."""
    seen: dict[str, list[torch.Tensor]] = {}
    observe_linear_inputs(model, prompts, None, lambda name, x: seen.setdefault(name, []).append(x))
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, xs in seen.items():
        x = torch.cat(xs)
        if x.shape[0] > max_rows:
            x = x[torch.randperm(x.shape[0], generator=gen)[:max_rows]]
        out[name] = x
    return out
