"""The block-table attention reference against a naive dense computation."""

import pytest
import torch

from servelab_kernels.attention import plan_prefill, quantize_kv, write_kv
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


def test_several_chunks_go_through_one_padded_call_and_match_dense():
    # three chunks of unequal query and context lengths (fresh prompts and chunks after a cached
    # prefix) beside two decodes
    q_lens, ctx_lens = [6, 1, 9, 1, 7], [6, 12, 30, 25, 19]
    q, kc, vc, bt, cl, qsl, keys, values = _case(q_lens, ctx_lens, 4, True, seed=7)
    starts, ctxs = [0, 6, 15, 22], [6, 30, 19]
    groups = plan_prefill(bt[[0, 2, 4]], starts, ctxs, block_size=4, max_waste=10.0)
    assert len(groups) == 1 and groups[0].num_seqs == 3 and groups[0].max_query == 9
    assert groups[0].rows.tolist() == list(range(6, 15)) + list(range(15, 22)) + list(range(0, 6))  # longest first
    out = paged_attention(q, kc, vc, bt, cl, qsl, scale=0.25)
    torch.testing.assert_close(out, dense_reference(q, keys, values, q_lens, 0.25), atol=1e-5, rtol=1e-5)


def test_chunks_too_unequal_to_pad_together_are_split():
    # a 2-token tail over a 40-token prefix and a fresh 32-token prompt: padding both to 32 x 40
    # would do 2560 pairs of work for 80 + 1024 real ones
    groups = plan_prefill(torch.zeros(2, 10, dtype=torch.long), [0, 2, 34], [40, 32], block_size=4, max_waste=1.5)
    assert [(g.num_seqs, g.max_query) for g in groups] == [(1, 2), (1, 32)]
    # equal chunks always share a call
    groups = plan_prefill(torch.zeros(3, 10, dtype=torch.long), [0, 8, 16, 24], [8, 8, 8], block_size=4)
    assert [(g.num_seqs, g.max_query, g.num_blocks) for g in groups] == [(3, 8, 2)]


def test_grouped_prefill_on_an_int8_cache_matches_the_dequantized_cache():
    q_lens, ctx_lens = [5, 9, 3], [5, 20, 13]
    q, kc, vc, bt, cl, qsl, _, _ = _case(q_lens, ctx_lens, 4, True, seed=9)
    k8, ks = quantize_kv(kc)
    v8, vs = quantize_kv(vc)
    out = paged_attention(q, k8, v8, bt, cl, qsl, scale=0.25, k_scale=ks, v_scale=vs)
    deq = paged_attention(q, k8.float() * ks.float()[..., None], v8.float() * vs.float()[..., None], bt, cl, qsl,
                          scale=0.25)
    torch.testing.assert_close(out, deq, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens, ctx_lens", [
    ([5, 1, 5], [40, 17, 9]),  # speculative verifies beside a decode, no prefill chunk in the step
    ([5, 1, 20, 3], [40, 17, 20, 64]),  # and beside a fresh prefill
])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_short_query_rows_through_the_decode_kernel_match_dense(q_lens, ctx_lens, backend):
    """A verify row of a few queries goes to the decode kernel a query at a time, each over its
    own causal context; the result is the dense causal attention's."""
    from plugins.attention.cpu_attn import CPUAttention
    from plugins.attention.torch_ref import TorchAttention

    attn = CPUAttention(None) if backend == "cpu" else TorchAttention(None)
    attn.decode_max_query_len = 8
    q, kc, vc, bt, cl, qsl, keys, values = _case(q_lens, ctx_lens, 16, True, seed=5, heads=6, kv_heads=2, d=64)
    out = paged_attention(q, kc, vc, bt, cl, qsl, scale=0.125, backend=attn)
    torch.testing.assert_close(out, dense_reference(q, keys, values, q_lens, 0.125), atol=1e-5, rtol=1e-5)
