"""The block-table attention reference against a naive dense computation."""

import pytest
import torch

from kernels.attention import write_kv
from tests.tiny import attend as paged_attention


def dense_reference(q, keys_per_seq, values_per_seq, q_lens, scale):
    """Plain softmax attention per sequence, keys/values given densely, queries are the last q_len positions."""
    outs, start = [], 0
    for k, v, n in zip(keys_per_seq, values_per_seq, q_lens):
        ctx, kvh = k.shape[0], k.shape[1]
        qi = q[start : start + n]  # [n, h, d]
        group = qi.shape[1] // kvh
        kk = k.repeat_interleave(group, dim=1)  # [ctx, h, d]
        vv = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, kk) * scale
        pos = torch.arange(ctx - n, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        start += n
    return torch.cat(outs)


def _case(q_lens, ctx_lens, block_size, scattered, seed=0, heads=6, kv_heads=2, d=16):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, kv_heads, block_size, d)
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(num_blocks, generator=g).tolist() if scattered else list(range(num_blocks))
    tables, keys, values, slot_lists = [], [], [], []
    for ctx in ctx_lens:
        nb = -(-ctx // block_size)
        table, order = order[:nb], order[nb:]
        tables.append(table)
        k = torch.randn(ctx, kv_heads, d, generator=g)
        v = torch.randn(ctx, kv_heads, d, generator=g)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv(k, v, k_cache, v_cache, slots)
        keys.append(k), values.append(v), slot_lists.append(slots)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, d, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    return q, k_cache, v_cache, bt, torch.tensor(ctx_lens), qsl, keys, values


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_prefill_and_decode_match_dense(scattered, block_size):
    q_lens, ctx_lens = [5, 1, 1, 9, 1], [5, 17, 3, 30, 40]  # a fresh prefill, decodes, a chunk after a cached prefix
    if block_size == 4:
        q_lens, ctx_lens = [7, 1], [7, 21]  # a lone decode goes the per-sequence way
    q, kc, vc, bt, cl, qsl, keys, values = _case(q_lens, ctx_lens, block_size, scattered)
    out = paged_attention(q, kc, vc, bt, cl, qsl, scale=0.25)
    ref = dense_reference(q, keys, values, q_lens, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([1, 1, 1, 4], [7, 33, 2, 10]),  # decodes of very different lengths beside a chunk
    ([1], [1]),  # the first decode of a one-token prompt
    ([1] * 12, list(range(5, 65, 5))),  # many decodes, blocks of each sequence interleaved in the pool
])
def test_decodes_match_dense(q_lens, ctx_lens):
    q, kc, vc, bt, cl, qsl, keys, values = _case(q_lens, ctx_lens, 8, True, seed=3)
    out = paged_attention(q, kc, vc, bt, cl, qsl, scale=0.25)
    torch.testing.assert_close(out, dense_reference(q, keys, values, q_lens, 0.25), atol=1e-5, rtol=1e-5)


def test_bf16_cache_close_to_fp32():
    q_lens, ctx_lens = [3, 1], [11, 20]
    q, kc, vc, bt, cl, qsl, keys, values = _case(q_lens, ctx_lens, 4, True, seed=5)
    out = paged_attention(q, kc.bfloat16(), vc.bfloat16(), bt, cl, qsl, scale=0.25)
    torch.testing.assert_close(out, dense_reference(q, keys, values, q_lens, 0.25), atol=3e-2, rtol=3e-2)
