"""Attention backend `dense`: the plainest paged attention, one sequence at a time.

It owns its KV layout, token-major [blocks, block_size, kv_heads, head_dim] (servelab's own is
head-major), which no allocator or model code needs to know: they deal in block ids and slots.
"""

import torch
import torch.nn.functional as F

from core.api import AttentionConfig, AttentionMetadata, ConfigError, KVCacheSpec


class DenseAttention:
    def __init__(self, config: AttentionConfig, device=None) -> None:
        self.config = config

    def allocate_kv_cache(self, num_blocks: int, block_size: int, spec: KVCacheSpec, device) -> list[tuple]:
        if spec.dtype == torch.int8:
            raise ConfigError("attention=dense keeps K/V in the model dtype; use cache.dtype=auto")
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        return [(torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
                for _ in range(spec.num_layers)]

    def plan(self, meta: AttentionMetadata) -> None:
        return None

    def forward(self, q, k, v, kv_cache: tuple, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        k_cache.flatten(0, 1)[meta.slot_mapping] = k.to(k_cache.dtype)  # slot = block * block_size + offset
        v_cache.flatten(0, 1)[meta.slot_mapping] = v.to(v_cache.dtype)
        out, starts = torch.empty_like(q), meta.query_start_loc_cpu
        for i, ctx in enumerate(meta.context_lens_cpu):
            s, e = starts[i], starts[i + 1]
            blocks = meta.block_tables[i, : -(-ctx // k_cache.shape[1])].long()
            keys, values = (c[blocks].flatten(0, 1)[:ctx].transpose(0, 1)[None] for c in (k_cache, v_cache))
            pos = torch.arange(ctx, device=q.device)
            mask = pos[None, :] <= pos[ctx - (e - s):, None]  # causal, after the cached prefix
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None].to(keys.dtype), keys, values,
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = o[0].transpose(0, 1).to(out.dtype)
        return out

    def copy_blocks(self, kv_caches: list[tuple], src: torch.Tensor, dst: torch.Tensor) -> None:
        for k_cache, v_cache in kv_caches:
            k_cache[dst], v_cache[dst] = k_cache[src], v_cache[src]
