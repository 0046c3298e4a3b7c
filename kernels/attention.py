"""Attention over a block-structured KV cache: the torch reference implementation.

Layout: per layer, `k_cache` and `v_cache` are [num_blocks, num_kv_heads, block_size, head_dim]
(head-major inside a block, so a gathered block is already in matmul layout). A sequence's
tokens live in the blocks its row of `block_tables` lists, in order. The contiguous allocator is
the special case block_size = max_model_len with one block per sequence. An int8 cache comes
with fp16 scales [num_blocks, num_kv_heads, block_size], one per token and head.

Decode queries (one token per sequence) are computed together over the packed blocks of all
their sequences, with no padding: scores per block, a softmax over each sequence's segment of
blocks, then the weighted values summed per sequence. Prefill chunks go one sequence at a time
through scaled_dot_product_attention with a causal mask offset by the cached prefix.

Every function takes tensors (plus optional host copies a caller already has), so a Triton twin
can take the same arguments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def allocate_kv_layer(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                      device=None) -> tuple[torch.Tensor, ...]:
    """One layer's cache: (k, v), plus (k_scale, v_scale) per token and head when dtype is int8."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)  # head-major blocks
    kv = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
    if dtype == torch.int8:
        kv += (torch.zeros(shape[:3], dtype=torch.float16, device=device),
               torch.zeros(shape[:3], dtype=torch.float16, device=device))
    return kv


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 KV: one fp16 scale per token and head, x ~ q * scale. x [..., head_dim]."""
    scale = (x.float().abs().amax(dim=-1) / 127.0).clamp(min=1e-8)
    q = torch.clamp(torch.round(x.float() / scale[..., None]), -127, 127).to(torch.int8)
    return q, scale.to(torch.float16)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Store new tokens' K and V ([num_tokens, kv_heads, head_dim]) at their flat slots
    (slot = block * block_size + offset), quantizing for an int8 cache."""
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if k_cache.dtype == torch.int8:
        for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
            q, s = quantize_kv(x)
            cache[blocks, :, offsets] = q
            scales[blocks, :, offsets] = s
        return
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def _blocks(cache: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gather whole blocks [n, kvh, bs, d], dequantized to `dtype` when the cache is int8."""
    x = torch.index_select(cache, 0, ids)
    if scales is None:
        return x
    return x.to(dtype) * torch.index_select(scales, 0, ids).to(dtype)[..., None]


def pack_decode_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks decode attention reads, packed: (block ids, owning sequence, first position of
    each block). Depends only on the step's metadata, so a caller computes it once per step."""
    counts = (context_lens + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < counts[:, None]
    owner, col = used.nonzero(as_tuple=True)
    return block_tables[owner, col].long(), owner, col * block_size


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, packed: tuple | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, num_heads, head_dim], over each sequence's cached
    tokens; `packed` is pack_decode_blocks' result when the caller already has it."""
    b, num_heads, d = q.shape
    kvh, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kvh
    ids, owner, first_pos = packed if packed is not None else pack_decode_blocks(block_tables, context_lens, block_size)
    n = ids.numel()
    dtype = q.dtype if k_cache.dtype == torch.int8 else k_cache.dtype
    keys = _blocks(k_cache, k_scale, ids, dtype).view(n * kvh, block_size, d)
    values = _blocks(v_cache, v_scale, ids, dtype).view(n * kvh, block_size, d)
    qb = q.to(keys.dtype).view(b, kvh, group, d).index_select(0, owner).view(n * kvh, group, d)
    scores = torch.bmm(qb, keys.transpose(1, 2)).float().view(n, kvh, group, block_size) * scale
    valid = first_pos[:, None] + torch.arange(block_size, device=q.device)[None, :] < context_lens[owner][:, None]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    # softmax over each sequence's blocks: a running max per sequence, then normalise by the sum
    seq_max = torch.full((b, kvh, group), float("-inf"), device=q.device)
    block_max = scores.amax(dim=-1)
    seq_max.scatter_reduce_(0, owner[:, None, None].expand_as(block_max), block_max, "amax")
    probs = torch.exp(scores - seq_max.index_select(0, owner)[..., None])
    denom = torch.zeros(b, kvh, group, device=q.device).index_add_(0, owner, probs.sum(dim=-1))
    partial = torch.bmm(probs.to(values.dtype).view(n * kvh, group, block_size), values)
    out = torch.zeros(b, kvh, group, d, device=q.device).index_add_(0, owner, partial.float().view(n, kvh, group, d))
    return (out / denom[..., None]).view(b, num_heads, d)


def _seq_kv(cache: torch.Tensor, table: torch.Tensor, length: int, scales: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """One sequence's first `length` cached tokens as [kv_heads, length, head_dim]."""
    block_size = cache.shape[2]
    n = -(-length // block_size)
    kv = _blocks(cache, scales, table[:n].long(), dtype)  # [n, kvh, bs, d]
    return kv.transpose(0, 1).reshape(cache.shape[1], n * block_size, cache.shape[3])[:, :length]


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, host: tuple[list[int], list[int]] | None = None,
) -> torch.Tensor:
    """Packed chunks q [num_tokens, heads, d]: sequence i's queries are rows
    query_start_loc[i]:query_start_loc[i+1], its last tokens of context_lens[i], causal over the
    cached prefix. `host` = (query_start_loc, context_lens) as lists, when the caller has them."""
    starts, ctxs = host if host is not None else (query_start_loc.tolist(), context_lens.tolist())
    dtype = q.dtype if k_cache.dtype == torch.int8 else k_cache.dtype
    out = torch.empty_like(q)
    for i, ctx in enumerate(ctxs):
        s, e = starts[i], starts[i + 1]
        keys = _seq_kv(k_cache, block_tables[i], ctx, k_scale, dtype)  # [kvh, ctx, d]
        values = _seq_kv(v_cache, block_tables[i], ctx, v_scale, dtype)
        q_pos = torch.arange(ctx - (e - s), ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0).to(keys.dtype), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask[None, None], scale=scale, enable_gqa=True,
        )
        out[s:e] = o[0].transpose(0, 1).to(out.dtype)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence with no cache: q [t, heads, d], k/v [t, kv_heads, d] (calibration passes)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
