"""Attention over a block-structured KV cache: the torch reference implementation.

Layout: per layer, `k_cache` and `v_cache` are [num_blocks, num_kv_heads, block_size, head_dim]
(head-major inside a block, so a gathered block is already in matmul layout). A sequence's
tokens live in the blocks its row of `block_tables` lists, in order. The contiguous allocator is
the special case block_size = max_model_len with one block per sequence. An int8 cache comes
with fp16 scales [num_blocks, num_kv_heads, block_size], one per token and head.

Decode queries (one token per sequence) are computed together over the packed blocks of all
their sequences, with no padding: scores per block, a softmax over each sequence's segment of
blocks, then the weighted values summed per sequence. Prefill chunks go together through one
scaled_dot_product_attention over a padded batch, with a causal mask offset by each cached prefix.

Every function takes tensors (plus optional host copies a caller already has), so a Triton twin
can take the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab_kernels import huge_pages


def allocate_kv_layer(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                      device=None) -> tuple[torch.Tensor, ...]:
    """One layer's cache: (k, v), plus (k_scale, v_scale) per token and head when dtype is int8."""
    shape = (num_blocks, num_kv_heads, block_size, head_dim)  # head-major blocks
    kv = (huge_pages.zeros(shape, dtype, device), huge_pages.zeros(shape, dtype, device))  # (2 MB pages: see there)
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
    """Gather whole blocks [n, kvh, bs, d] in `dtype`, dequantized when the cache is int8."""
    x = torch.index_select(cache, 0, ids)
    if scales is None:
        return x.to(dtype)
    return x.to(dtype) * torch.index_select(scales, 0, ids).to(dtype)[..., None]


def compute_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype attention multiplies in: the cache's, unless the cache only stores narrower values
    than the queries carry (INT8, or a bf16 cache under an fp32 model: `cache.dtype`), whose blocks
    are widened to the queries' dtype instead."""
    if k_cache.dtype == torch.int8 or k_cache.element_size() < q.element_size():
        return q.dtype
    return k_cache.dtype


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
    dtype = compute_dtype(q, k_cache)
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


@dataclass
class PrefillGroup:
    """Prefill chunks that share one padded SDPA call: [seqs, heads, max_query, keys]."""

    num_seqs: int
    max_query: int
    num_blocks: int  # blocks gathered per sequence (the longest context, rounded up)
    block_ids: torch.Tensor  # [num_seqs * num_blocks] the blocks to gather, padded with block 0
    query_rows: torch.Tensor  # [num_seqs * max_query] row of q for each padded query (padding repeats a row)
    mask: torch.Tensor  # [num_seqs, 1, max_query, num_blocks * block_size] causal over the cached prefix
    kept: torch.Tensor  # [real queries] which padded rows are real
    rows: torch.Tensor  # [real queries] where they go in the packed output


def plan_prefill(block_tables: torch.Tensor, starts: list[int], ctxs: list[int], block_size: int,
                 max_waste: float = 1.5) -> list[PrefillGroup]:
    """Group a step's prefill chunks into as few padded attention calls as keep the padded work
    (sequences x longest query x longest context) within `max_waste` of the real work: usually one
    call for the whole step. Index tensors and masks are made here, once per step, for every layer."""
    dev = block_tables.device
    qlens = [starts[i + 1] - starts[i] for i in range(len(ctxs))]
    order = sorted(range(len(ctxs)), key=lambda i: (-ctxs[i], -qlens[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            trial = groups[-1] + [i]
            padded = len(trial) * max(qlens[j] for j in trial) * max(ctxs[j] for j in trial)
            if padded <= max_waste * sum(qlens[j] * ctxs[j] for j in trial):
                groups[-1] = trial
                continue
        groups.append([i])
    out = []
    for members in groups:
        n, mq, mc = len(members), max(qlens[j] for j in members), max(ctxs[j] for j in members)
        nb = -(-mc // block_size)
        query_rows, kept, rows, q_pos = [], [], [], []
        for k, j in enumerate(members):
            ql, ctx = qlens[j], ctxs[j]
            query_rows += [starts[j] + min(t, ql - 1) for t in range(mq)]
            kept += [k * mq + t for t in range(ql)]
            rows += range(starts[j], starts[j] + ql)
            q_pos.append([ctx - ql + min(t, ql - 1) for t in range(mq)])  # padding rows repeat the last query
        q_pos_t = torch.tensor(q_pos, device=dev)
        mask = torch.arange(nb * block_size, device=dev)[None, None, :] <= q_pos_t[:, :, None]
        out.append(PrefillGroup(
            n, mq, nb, block_tables[torch.tensor(members, device=dev), :nb].reshape(-1).long(),
            torch.tensor(query_rows, device=dev), mask[:, None], torch.tensor(kept, device=dev),
            torch.tensor(rows, device=dev)))
    return out


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, host: tuple[list[int], list[int]] | None = None,
    groups: list[PrefillGroup] | None = None,
) -> torch.Tensor:
    """Packed chunks q [num_tokens, heads, d]: sequence i's queries are rows
    query_start_loc[i]:query_start_loc[i+1], its last tokens of context_lens[i], causal over the
    cached prefix. All chunks go through one scaled_dot_product_attention over a padded batch
    (PyTorch's fused CPU flash kernel), or a few when their lengths differ too much (plan_prefill).
    `host` = (query_start_loc, context_lens) as lists and `groups` = plan_prefill's result, when
    the caller has them."""
    if groups is None:
        starts, ctxs = host if host is not None else (query_start_loc.tolist(), context_lens.tolist())
        groups = plan_prefill(block_tables, starts, ctxs, k_cache.shape[2])
    dtype = compute_dtype(q, k_cache)
    kvh, bs, d = k_cache.shape[1:]
    out = torch.empty_like(q)
    for g in groups:
        keys, values = (_blocks(c, s, g.block_ids, dtype).view(g.num_seqs, g.num_blocks, kvh, bs, d)
                        .transpose(1, 2).reshape(g.num_seqs, kvh, g.num_blocks * bs, d)
                        for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
        queries = q.index_select(0, g.query_rows).view(g.num_seqs, g.max_query, -1, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(queries.to(dtype), keys, values, attn_mask=g.mask, scale=scale,
                                           enable_gqa=True)
        o = o.transpose(1, 2).reshape(g.num_seqs * g.max_query, -1, d).index_select(0, g.kept)
        out.index_copy_(0, g.rows, o.to(out.dtype))
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence with no cache: q [t, heads, d], k/v [t, kv_heads, d] (calibration passes)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
