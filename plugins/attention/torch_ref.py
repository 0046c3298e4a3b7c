"""Attention backend `torch`: the reference kernels of `servelab_kernels.attention`, in eager PyTorch.

Once per step `plan` splits the batch into single-query rows (decode, done together over packed
blocks) and multi-query rows (prefill chunks, done together in one padded SDPA call), packs the
decode blocks and builds the prefill masks, so the layers reuse those index tensors instead of
rebuilding them thirty times. The `triton` backend shares the
split and swaps the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.api import AttentionConfig, AttentionMetadata, KVCacheSpec, hookimpl
from servelab_kernels import huge_pages
from servelab_kernels.attention import (
    PrefillGroup,
    allocate_kv_layer,
    decode_attention,
    pack_decode_blocks,
    plan_prefill,
    prefill_attention,
    write_kv,
)


@dataclass
class TorchAttentionPlan:
    all_decode: bool
    decode_rows: torch.Tensor | None = None  # packed rows of the single-query sequences
    decode_tables: torch.Tensor | None = None
    decode_ctx: torch.Tensor | None = None
    packed: tuple | None = None  # pack_decode_blocks of the decode sequences
    prefill_rows: torch.Tensor | None = None  # rows of the multi-query sequences, in order
    prefill_tables: torch.Tensor | None = None
    prefill_ctx: torch.Tensor | None = None
    prefill_starts: torch.Tensor | None = None  # their query_start_loc, re-based to the prefill rows
    prefill_host: tuple[list[int], list[int]] | None = None
    prefill_groups: list[PrefillGroup] | None = None  # plan_prefill's padded SDPA calls


def split_rows(meta: AttentionMetadata, pack: bool, group_prefill: bool = False,
               decode_max_query_len: int = 1) -> TorchAttentionPlan:
    """Rows the decode kernel serves apart from prefill chunks, once per step; a decode-only step
    makes no tensor at all. A row of up to `decode_max_query_len` queries (a speculative verify)
    goes to the decode kernel as one single-query row per position, each over its causal context,
    which beats a padded prefill call for a handful of queries. `pack`: also gather the decode
    rows' blocks (the torch reference's packed decode reads them); `group_prefill`: also plan the
    chunks' padded SDPA calls."""
    starts, qlens, ctxs = meta.query_start_loc_cpu, meta.query_lens_cpu, meta.context_lens_cpu
    plan = TorchAttentionPlan(all_decode=all(n == 1 for n in qlens))
    if plan.all_decode:
        if pack:
            plan.packed = pack_decode_blocks(meta.block_tables, meta.context_lens, meta.block_size)
        return plan
    dev = meta.slot_mapping.device
    dec_rows, dec_seqs, dec_ctx, pre = [], [], [], []
    for i, n in enumerate(qlens):
        if n > decode_max_query_len:
            pre.append(i)
            continue
        dec_rows += range(starts[i], starts[i] + n)
        dec_seqs += [i] * n
        dec_ctx += range(ctxs[i] - n + 1, ctxs[i] + 1)  # query j sees the keys up to its own position
    if dec_rows:
        plan.decode_rows = torch.tensor(dec_rows, device=dev)
        plan.decode_tables = meta.block_tables[torch.tensor(dec_seqs, device=dev)]
        plan.decode_ctx = torch.tensor(dec_ctx, device=dev)
        if pack:
            plan.packed = pack_decode_blocks(plan.decode_tables, plan.decode_ctx, meta.block_size)
    if not pre:
        return plan
    idx = torch.tensor(pre, device=dev)
    plan.prefill_rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in pre])
    rebased = [0]
    for i in pre:
        rebased.append(rebased[-1] + qlens[i])
    plan.prefill_tables, plan.prefill_ctx = meta.block_tables[idx], meta.context_lens[idx]
    plan.prefill_starts = torch.tensor(rebased, device=dev)
    plan.prefill_host = (rebased, [ctxs[i] for i in pre])
    if group_prefill:
        plan.prefill_groups = plan_prefill(plan.prefill_tables, *plan.prefill_host, meta.block_size)
    return plan


class TorchAttention:
    # the kernels this backend runs (a subclass swaps them, e.g. the C++ decode of `cpu`)
    decode_kernel = staticmethod(decode_attention)
    prefill_kernel = staticmethod(prefill_attention)
    pack_decodes = True  # the reference's packed decode reads pre-gathered block indices
    decode_max_query_len = 1  # rows of up to this many queries go to the decode kernel, a query each

    def __init__(self, config: AttentionConfig, device=None) -> None:
        self.config = config

    def allocate_kv_cache(self, num_blocks: int, block_size: int, spec: KVCacheSpec, device) -> list[tuple]:
        with huge_pages.enabled(getattr(self.config, "huge_pages", True)):  # attention.huge_pages (auto, cpu)
            return [allocate_kv_layer(num_blocks, spec.num_kv_heads, block_size, spec.head_dim, spec.dtype, device)
                    for _ in range(spec.num_layers)]

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        return split_rows(meta, pack=self.pack_decodes, group_prefill=True,
                          decode_max_query_len=self.decode_max_query_len)

    def forward(self, q, k, v, kv_cache: tuple, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache, *scales = kv_cache  # an int8 cache carries (k_scale, v_scale) too
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
        return self.attend(q, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: tuple, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of the packed queries over the cache as it stands (their own K/V included)."""
        k_cache, v_cache, *scales = kv_cache
        k_scale, v_scale = scales if scales else (None, None)
        plan: TorchAttentionPlan = meta.plan
        if plan.all_decode:
            return self.decode_kernel(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, k_scale,
                                      v_scale, packed=plan.packed).to(q.dtype)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            o = self.decode_kernel(q.index_select(0, plan.decode_rows), k_cache, v_cache, plan.decode_tables,
                                   plan.decode_ctx, scale, k_scale, v_scale, packed=plan.packed)
            out[plan.decode_rows] = o.to(out.dtype)
        if plan.prefill_rows is None:
            return out
        o = self.prefill_kernel(q.index_select(0, plan.prefill_rows), k_cache, v_cache, plan.prefill_tables,
                                plan.prefill_ctx, plan.prefill_starts, scale, k_scale, v_scale, host=plan.prefill_host,
                                groups=plan.prefill_groups)
        out[plan.prefill_rows] = o.to(out.dtype)
        return out

    def copy_blocks(self, kv_caches: list[tuple], src: torch.Tensor, dst: torch.Tensor) -> None:
        for layer in kv_caches:
            for t in layer:
                t[dst] = t[src]


@hookimpl
def servelab_attention_backends():
    return {"torch": TorchAttention}
