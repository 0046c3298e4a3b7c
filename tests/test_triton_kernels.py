"""Every Triton kernel against its torch reference twin (on the CPU: TRITON_INTERPRET=1, set in
conftest before triton is imported). Odd sizes, GQA ratios 1/3/8, scattered and shared blocks,
contexts across block boundaries, the INT8 cache; then the tiny model end to end."""

import pytest
import torch

from servelab_kernels import attention as ref
from servelab_kernels import norm, quant, rotary, triton_ops, triton_quant
from servelab_kernels import triton_attention as tri
from tests.tiny import empty_kv_cache, scattered_kv_cache

BLOCK = 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted elsewhere


def on(*xs):
    return [x.to(DEV) for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_store_kv_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    # odd token count, 3 kv heads, a head_dim that is not a power of two; K/V arrive in the cache's
    # dtype, as from the model (the interpreter truncates fp32 -> bf16 where a GPU rounds)
    act = torch.float32 if dtype == torch.int8 else dtype
    k, v = on(torch.randn(7, 3, 48, generator=g).to(act), torch.randn(7, 3, 48, generator=g).to(act))
    slots = torch.tensor([5, 16, 17, 40, -1, 3, 63], device=DEV)  # -1: a padded row, skipped
    out = []
    for store in (ref.write_kv, tri.write_kv):
        kc, vc, scales = empty_kv_cache(4, 3, BLOCK, 48, dtype, DEV)
        keep = slots >= 0
        if store is ref.write_kv:
            store(k[keep], v[keep], kc, vc, slots[keep], *scales)
        else:
            store(k, v, kc, vc, slots, *scales)
        out.append((kc, vc, *scales))
    for a, b in zip(*out):
        if a.dtype == torch.int8:  # rounding of x / scale may differ by one step at a tie
            assert (a.int() - b.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_decode_attention_matches_reference(group, dtype):
    kv_heads, d = 2, 64
    ctx_lens = [1, 17, 33, 100, 47]  # crossing block boundaries, one fresh token
    kc, vc, scales, bt = scattered_kv_cache(ctx_lens, kv_heads, d, dtype, group, BLOCK, DEV)
    bt = bt.int()
    q = torch.randn(len(ctx_lens), kv_heads * group, d, generator=torch.Generator().manual_seed(7)).to(DEV)
    ctx = torch.tensor(ctx_lens, device=DEV)
    want = ref.decode_attention(q, kc, vc, bt, ctx, 0.125, *scales)
    got = tri.decode_attention(q, kc, vc, bt, ctx, 0.125, *scales)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_decode_attention_splits_long_contexts_over_shared_blocks():
    # 1,100 tokens take three splits of 512; the second sequence shares the first one's 4 leading blocks
    g = torch.Generator().manual_seed(4)
    kc, vc = torch.zeros(80, 1, BLOCK, 64, device=DEV), torch.zeros(80, 1, BLOCK, 64, device=DEV)
    tables = [list(range(0, 69)), [0, 1, 2, 3] + list(range(69, 80))]
    for t, start in zip(tables, (0, 4 * BLOCK)):  # the shared blocks are written once
        n = len(t) * BLOCK
        slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, n)], device=DEV)
        ref.write_kv(*on(torch.randn(n - start, 1, 64, generator=g), torch.randn(n - start, 1, 64, generator=g)), kc,
                     vc, slots)
    bt = torch.tensor([tables[0], tables[1] + [0] * (69 - 15)], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 4, 64, generator=g).to(DEV)
    ctx = torch.tensor([1100, 230], device=DEV)
    torch.testing.assert_close(tri.decode_attention(q, kc, vc, bt, ctx, 0.125),
                               ref.decode_attention(q, kc, vc, bt, ctx, 0.125), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_prefill_attention_matches_reference(group, dtype):
    kv_heads, d = 2, 64
    q_lens, ctx_lens = [5, 40, 1, 9], [5, 70, 17, 9]  # a fresh prompt, a chunk after a cached prefix, ...
    kc, vc, scales, bt = scattered_kv_cache(ctx_lens, kv_heads, d, dtype, 10 + group, BLOCK, DEV)
    bt = bt.int()
    q = torch.randn(sum(q_lens), kv_heads * group, d, generator=torch.Generator().manual_seed(8)).to(DEV)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(DEV)
    ctx = torch.tensor(ctx_lens, device=DEV)
    want = ref.prefill_attention(q, kc, vc, bt, ctx, qsl, 0.125, *scales)
    got = tri.prefill_attention(q, kc, vc, bt, ctx, qsl, 0.125, *scales)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(residual, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 200, generator=g).to(DEV, dtype)  # 200: not a power of two
    r = torch.randn(5, 200, generator=g).to(DEV, dtype) if residual else None
    w = torch.randn(200, generator=g).to(DEV, dtype)
    (a, ra), (b, rb) = norm.rms_norm_ref(x, w, 1e-5, r), triton_ops.rms_norm(x, w, 1e-5, r)
    # bf16: within one bf16 step (2^-6 relative): the interpreter truncates fp32 -> bf16 where a GPU rounds
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -6)
    torch.testing.assert_close(b, a, **tol)
    if residual:  # the sum is rounded to the dtype once: exact in fp32
        torch.testing.assert_close(rb, ra, **(dict(atol=0, rtol=0) if dtype == torch.float32 else tol))


def test_rotary_matches_reference():
    g = torch.Generator().manual_seed(3)
    q, k = on(torch.randn(6, 9, 64, generator=g), torch.randn(6, 3, 64, generator=g))  # 9 heads: not a power of two
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)).to(DEV)
    pos = torch.tensor([0, 5, 6, 7, 100, 127], device=DEV)
    (qa, ka), (qb, kb) = rotary.rotary_ref(q, k, pos, freqs.cos(), freqs.sin()), \
        triton_ops.rotary(q, k, pos, freqs.cos(), freqs.sin())
    torch.testing.assert_close(qb, qa, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kb, ka, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("m", [1, 5, 33])
def test_int8_matmul_matches_reference(m):
    g = torch.Generator().manual_seed(m)
    w, x = on(torch.randn(80, 96, generator=g), torch.randn(m, 96, generator=g))
    q, s = quant.quantize_int8(w)
    torch.testing.assert_close(triton_quant.int8_matmul(x, q, s), quant.int8_matmul_ref(x, q, s), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m, group", [(1, 32), (5, 64), (33, 128)])
def test_int4_matmul_matches_reference(m, group):
    g = torch.Generator().manual_seed(m)
    w, x = on(torch.randn(72, 256, generator=g), torch.randn(m, 256, generator=g))
    q, s, z = quant.quantize_int4(w, group)
    got = triton_quant.int4_matmul(x, triton_quant.pack_int4_nibbles(q), s, z, group)
    torch.testing.assert_close(got, quant.int4_matmul_ref(x, q, s, z, group), atol=1e-4, rtol=1e-4)


# ---- the tiny model end to end -------------------------------------------------------------------

PROMPTS = [[5, 17, 99, 3, 42, 8, 61] * 3, [120, 7], list(range(30, 70)), [9] * 33]


def _engine(path, attention, cache_dtype="auto", max_num_seqs=8):
    from core.config import AttentionConfig
    from core.engine.engine import Engine
    from plugins.cache.paged import PagedCacheConfig
    from tests.tiny import tiny_config

    cfg = tiny_config(path, scheduler="continuous", max_num_batched_tokens=32, max_num_seqs=max_num_seqs)
    cfg.cache = PagedCacheConfig(name="paged", block_size=16, memory_gb=0.01, dtype=cache_dtype)
    cfg.attention = AttentionConfig(name=attention)
    return Engine(cfg)


def _greedy(engine, prompts=PROMPTS):
    from core.engine.types import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_tiny_model_greedy_tokens_are_the_same_with_the_triton_kernels(tiny_dirs, cache_dtype):
    from servelab_kernels.dispatch import force_triton

    want = _greedy(_engine(tiny_dirs["llama"], "torch", cache_dtype))
    with force_triton():  # norms and rotary too
        got = _greedy(_engine(tiny_dirs["llama"], "triton", cache_dtype))
    assert got == want


def test_decode_steps_through_the_padded_static_buffers_give_the_same_tokens(tiny_dirs):
    """The CUDA-graph path without the capture: decode steps padded to their bucket (slot -1,
    context 0 rows) and run from the static buffers."""
    from plugins.backends.cuda_graphs import DecodeGraphs, buckets
    from servelab_kernels.dispatch import force_triton

    assert buckets(8) == [1, 2, 4, 8] and buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    want = _greedy(_engine(tiny_dirs["llama"], "torch"))
    with force_triton():
        e = _engine(tiny_dirs["llama"], "triton", max_num_seqs=6)
        b = e.backend
        b.graphs = DecodeGraphs(b.model, b.attention, b.kv_caches, 6, e.allocator.block_size, e.max_model_len,
                                b.device, capture=False)
        runs = []
        real_run = b.graphs.run
        b.graphs.run = lambda batch: runs.append(batch.attn.num_seqs) or real_run(batch)
        got = _greedy(e, PROMPTS[:3])
    assert got == want[:3]
    assert runs and 3 in runs  # three decodes, padded to the bucket of 4


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_linears_take_the_triton_path_where_triton_runs(bits):
    """On CUDA (here: forced, interpreted) the modules keep their weights quantized and run the
    Triton matmuls; the outputs match the dequantize-and-multiply reference."""
    from servelab_kernels.dispatch import force_triton

    g = torch.Generator().manual_seed(bits)
    w, bias, x = on(torch.randn(40, 100, generator=g), torch.randn(40, generator=g), torch.randn(3, 100, generator=g))
    with force_triton():
        if bits == 8:
            lin = torch.nn.Linear(100, 40).to(DEV)
            lin.weight.data, lin.bias.data = w, bias
            fast, ref_mod = quant.Int8Linear.from_linear(lin), quant.Int8Linear.from_linear(lin, fast=False)
        else:
            fast = quant.Int4Linear.from_weight(w, bias, 32)
            ref_mod = quant.Int4Linear.from_weight(w, bias, 32, fast=False)
            assert fast.layout == "nibbles" and fast.weight_packed.dtype == torch.uint8
            torch.testing.assert_close(fast.dequantized_weight(), ref_mod.dequantized_weight())
        torch.testing.assert_close(fast(x), ref_mod(x), atol=1e-4, rtol=1e-4)
