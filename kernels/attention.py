"""Attention over a block-structured KV cache: the torch reference implementation.

Layout: per layer, `k_cache` and `v_cache` are [num_blocks, block_size, num_kv_heads, head_dim].
A sequence's tokens live in the blocks its row of `block_tables` lists, in order. The contiguous
allocator is the special case block_size = max_model_len with one block per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new tokens' K and V ([num_tokens, kv_heads, head_dim]) at their flat slots."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def _gather_padded(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Several sequences' first `length` tokens, padded: [B, length, h, d], copied block by block."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    if num_blocks == 1:  # one (possibly huge, e.g. contiguous) block each: copy only what is used
        return cache[block_tables[:, 0].long(), :length]
    return cache[block_tables[:, :num_blocks].long()].flatten(1, 2)[:, :length]


def _decode_batched(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """One query per sequence: q [B, h, d] over padded keys/values [B, T, kvh, d], `lens` valid each."""
    b, t, kvh, d = keys.shape
    qg = q.view(b, kvh, q.shape[1] // kvh, d).to(keys.dtype)
    scores = torch.einsum("bgqd,btgd->bgqt", qg, keys).float() * scale
    valid = torch.arange(t, device=q.device)[None, :] < lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.einsum("bgqt,btgd->bgqd", probs, values).reshape(q.shape)


def _seq_kv(cache: torch.Tensor, blocks: list[int], length: int) -> torch.Tensor:
    """One sequence's first `length` cached tokens [length, h, d]: a view when its blocks are
    consecutive in the pool (always, for the contiguous allocator), else a block gather."""
    block_size = cache.shape[1]
    blocks = blocks[: -(-length // block_size)]
    if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
        start = blocks[0] * block_size
        return cache.view(-1, *cache.shape[2:])[start : start + length]
    return cache[torch.tensor(blocks, device=cache.device)].flatten(0, 1)[:length]


def _decode_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token [h, d] over [ctx, kvh, d] keys and values, grouped-query aware."""
    kvh, d = keys.shape[1], keys.shape[2]
    qg = q.view(kvh, q.shape[0] // kvh, d).to(keys.dtype)
    scores = torch.einsum("gqd,tgd->gqt", qg, keys).float() * scale
    probs = scores.softmax(dim=-1).to(values.dtype)
    return torch.einsum("gqt,tgd->gqd", probs, values).reshape(q.shape)


# From this many one-token queries a step, one padded batched call beats a loop over sequences.
BATCHED_DECODE_MIN_SEQS = 2


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
) -> torch.Tensor:
    """Causal attention of packed queries over cached KV.

    q: [num_tokens, num_heads, head_dim], sequence i's queries are rows
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
    done: set[int] = set()
    if len(decode) >= BATCHED_DECODE_MIN_SEQS:
        # All one-token queries in one padded call: each sees every cached token of its own sequence.
        idx = torch.tensor(decode, device=q.device)
        rows = torch.tensor([starts[i] for i in decode], device=q.device)
        max_ctx = max(context_lens_cpu[i] for i in decode)
        keys = _gather_padded(k_cache, block_tables[idx], max_ctx)
        values = _gather_padded(v_cache, block_tables[idx], max_ctx)
        out[rows] = _decode_batched(q[rows], keys, values, context_lens[idx], scale).to(out.dtype)
        done = set(decode)
    for i, q_len in enumerate(query_lens_cpu):
        if q_len == 0 or i in done:
            continue
        ctx = context_lens_cpu[i]
        keys = _seq_kv(k_cache, block_tables_cpu[i], ctx)  # [ctx, kvh, d]
        values = _seq_kv(v_cache, block_tables_cpu[i], ctx)
        start = starts[i]
        if q_len == 1:
            out[start] = _decode_one(q[start], keys, values, scale).to(out.dtype)
            continue
        qi = q[start : start + q_len]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1).unsqueeze(0).to(keys.dtype),  # [1, h, q, d]
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask[None, None],
            scale=scale,
            enable_gqa=True,
        )
        out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)
    return out
