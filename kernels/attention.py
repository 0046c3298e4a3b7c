"""Attention over a block-structured KV cache: the torch reference implementation.

Layout: per layer, `k_cache` and `v_cache` are [num_blocks, num_kv_heads, block_size, head_dim]
(head-major inside a block, so a gathered block is already in matmul layout). A sequence's
tokens live in the blocks its row of `block_tables` lists, in order. The contiguous allocator is
the special case block_size = max_model_len with one block per sequence.

Decode queries (one token per sequence) are computed together over the packed blocks of all
their sequences, with no padding: scores per block, a softmax over each sequence's segment of
blocks, then the weighted values summed per sequence. Prefill chunks go one sequence at a time
through scaled_dot_product_attention with a causal mask offset by the cached prefix.
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
    (slot = block * block_size + offset). An int8 cache also stores per-token, per-head scales
    in `k_scale`/`v_scale` [num_blocks, kv_heads, block_size]."""
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
    return (x.to(dtype) * torch.index_select(scales, 0, ids).to(dtype)[..., None])


def _seq_kv(cache: torch.Tensor, blocks: list[int], length: int, scales: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """One sequence's first `length` cached tokens as [kv_heads, length, head_dim]."""
    block_size = cache.shape[2]
    n = -(-length // block_size)
    ids = torch.tensor(blocks[:n], device=cache.device)
    kv = _blocks(cache, scales, ids, dtype or cache.dtype)  # [n, kvh, bs, d]
    return kv.transpose(0, 1).reshape(cache.shape[1], n * block_size, cache.shape[3])[:, :length]


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]], context_lens: list[int],
    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, num_heads, head_dim], over each sequence's cached tokens."""
    b, num_heads, d = q.shape
    kvh, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kvh
    counts = [-(-c // block_size) for c in context_lens]
    ids = torch.tensor([blk for t, n in zip(tables, counts) for blk in t[:n]], device=q.device)
    owner = torch.repeat_interleave(torch.arange(b, device=q.device), torch.tensor(counts, device=q.device))
    first_pos = torch.tensor([i * block_size for n in counts for i in range(n)], device=q.device)
    n = ids.numel()
    dtype = q.dtype if k_cache.dtype == torch.int8 else k_cache.dtype
    keys = _blocks(k_cache, k_scale, ids, dtype).view(n * kvh, block_size, d)
    values = _blocks(v_cache, v_scale, ids, dtype).view(n * kvh, block_size, d)
    qb = q.to(keys.dtype).view(b, kvh, group, d).index_select(0, owner).view(n * kvh, group, d)
    scores = torch.bmm(qb, keys.transpose(1, 2)).float().view(n, kvh, group, block_size) * scale
    ctx = torch.tensor(context_lens, device=q.device)
    valid = first_pos[:, None] + torch.arange(block_size, device=q.device)[None, :] < ctx[owner][:, None]
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


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: list[int], context_len: int, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk of q_len queries [q_len, heads, d], the last tokens of a sequence of context_len."""
    q_len = q.shape[0]
    dtype = q.dtype if k_cache.dtype == torch.int8 else k_cache.dtype
    keys = _seq_kv(k_cache, blocks, context_len, k_scale, dtype)  # [kvh, ctx, d]
    values = _seq_kv(v_cache, blocks, context_len, v_scale, dtype)
    q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
    mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(keys.dtype), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask[None, None], scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    query_lens_cpu: list[int] | None = None,
    context_lens_cpu: list[int] | None = None,
    block_tables_cpu: list[list[int]] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over cached KV (an int8 cache comes with its scales).

    q: [num_tokens, num_heads, head_dim]; sequence i's queries are rows
    query_start_loc[i]:query_start_loc[i+1], and they are its last tokens: query j of a sequence
    with q_len queries and ctx_len cached tokens sits at position ctx_len - q_len + j and sees keys
    0..that position. Returns [num_tokens, num_heads, head_dim]. The *_cpu arguments are host
    copies of the tensors, passed by callers that already have them.
    """
    if query_lens_cpu is None:
        query_lens_cpu = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    if context_lens_cpu is None:
        context_lens_cpu = context_lens.tolist()
    if block_tables_cpu is None:
        block_tables_cpu = block_tables.tolist()
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    decode = [i for i, n in enumerate(query_lens_cpu) if n == 1]
    if decode:
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        o = decode_attention(q.index_select(0, rows), k_cache, v_cache, [block_tables_cpu[i] for i in decode],
                             [context_lens_cpu[i] for i in decode], scale, k_scale, v_scale)
        out[rows] = o.to(out.dtype)
    for i, q_len in enumerate(query_lens_cpu):
        if q_len > 1:
            s = starts[i]
            o = prefill_attention(q[s : s + q_len], k_cache, v_cache, block_tables_cpu[i], context_lens_cpu[i], scale,
                                  k_scale, v_scale)
            out[s : s + q_len] = o.to(out.dtype)
    return out
