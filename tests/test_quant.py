"""Weight quantization: round-trip bounds, fast kernels against their references, odd shapes,
AWQ-style scaling, GGUF blocks served as they are."""

import numpy as np
import pytest
import torch
from torch import nn

from core.config import QuantConfig
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.model.quantize import swap_linears
from plugins.quant.gguf import q4_blocks
from plugins.quant.int4 import Int4QuantConfig, awq_scale
from plugins.quant.int8 import Int8QuantConfig
from servelab_kernels import cpu_quant
from servelab_kernels.cpu_quant_ref import q8_linear_ref
from servelab_kernels.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    int8_matmul,
    int8_matmul_ref,
    quantize_int4,
    quantize_int8,
)
from tests.tiny import tiny_config

g = torch.Generator().manual_seed(0)


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(48, 80, generator=g)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (48,)
    assert ((dequantize_int8(q, s) - w).abs() <= s[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step(group):
    w = torch.randn(16, 256, generator=g) * 3
    q, s, z = quantize_int4(w, group)
    assert q.min() >= 0 and q.max() <= 15 and s.shape == (256 // group, 16)
    err = (dequantize_int4(q, s, z, group) - w).abs()
    assert (err <= s.T.repeat_interleave(group, 1) / 2 + 1e-5).all()


@pytest.mark.parametrize("rows", [5, 100])  # the packed kernel, and the bf16 GEMM over the dequantized weight
def test_int8_fast_kernel_matches_reference(rows):
    assert (rows > cpu_quant.Q8_GEMV_ROWS) == (rows == 100)
    w = torch.randn(96, 64, generator=g)
    q, s = quantize_int8(w)
    x = torch.randn(rows, 64, generator=g).bfloat16()
    # few rows: the C++ GEMV, which rounds the activations to 14-bit integers (its twin does too)
    ref = q8_linear_ref(x, q, s) if rows == 5 else int8_matmul_ref(x, q, s)
    torch.testing.assert_close(int8_matmul(x, q, s).float(), ref.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("rows", [3, 60])
def test_w8a8_module_is_its_reference_and_fuses_only_with_its_kind(rows):
    lin = nn.Linear(64, 96, bias=True)
    fast, ref = Int8Linear.from_linear(lin, a8=True), Int8Linear.from_linear(lin, fast=False, a8=True)
    x = torch.randn(rows, 64, generator=g).bfloat16()
    torch.testing.assert_close(fast(x).float(), ref(x).float(), atol=1e-2, rtol=8e-3)  # bf16 outputs, one rounding
    want = q8_linear_ref(x, fast.weight_q, fast.scales, 127).float() + lin.bias.detach().bfloat16().float()
    torch.testing.assert_close(fast(x).float(), want, atol=1e-2, rtol=8e-3)
    plain = Int8Linear.from_linear(lin)
    assert Int8Linear.concat([fast, plain]) is None  # W8A8 and W8A16 layers do not share one matmul
    both = Int8Linear.concat([fast, fast])
    assert both.a8 and both.out_features == 192


def test_quant_w8a8_true_quantizes_the_activations_of_every_swapped_layer(tiny_dirs):
    cfg = tiny_config(tiny_dirs["llama"])
    cfg.model.dtype = "bf16"
    cfg.quant = Int8QuantConfig(name="int8", w8a8=True)
    e = Engine(cfg)
    mods = [m for m in e.model.modules() if isinstance(m, Int8Linear)]
    assert len(mods) == 2 * 4 + 1 and all(m.a8 for m in mods)
    out = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6


def test_quant_pack_false_serves_the_same_model_without_the_packed_copies(tiny_dirs):
    from servelab_kernels import int8_pack

    engines = {}
    for pack in (True, False):
        cfg = tiny_config(tiny_dirs["llama"])
        cfg.model.dtype = "fp32"
        cfg.quant = Int8QuantConfig(name="int8", pack=pack)
        engines[pack] = Engine(cfg)
    for pack, e in engines.items():
        copies = [m.packed is not None for m in e.model.modules() if isinstance(m, Int8Linear)]
        # the tiny model's layers: panels of 16 outputs and of 32 (but for its 3 x 16 kv projection), so
        # this build's layout (if any) packs some; quant.pack=false none
        assert any(copies) == (pack and int8_pack.layout() is not None), pack
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {p: e.generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids for p, e in engines.items()}
    assert outs[True] == outs[False]  # the same integer sums (the GEMV's at one row), the same greedy tokens
    with int8_pack.packing(False):  # an A/B run's switch holds under the default quant.pack=true
        cfg = tiny_config(tiny_dirs["llama"])
        cfg.model.dtype, cfg.quant = "fp32", Int8QuantConfig(name="int8")
        e = Engine(cfg)
    assert not any(m.packed is not None for m in e.model.modules() if isinstance(m, Int8Linear))


@pytest.mark.parametrize("n, k, group", [(64, 128, 32), (24, 100, 32), (16, 200, 64), (40, 576, 128), (13, 70, 32)])
def test_int4_module_matches_dequantized_reference_on_odd_shapes(n, k, group):
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    fast = Int4Linear.from_weight(w, bias, group, fast=True)
    ref = Int4Linear.from_weight(w, bias, group, fast=False)
    x = torch.randn(3, 7, k, generator=g)
    expect = x.float() @ ref.dequantized_weight().T + bias
    torch.testing.assert_close(ref(x).float(), expect, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fast(x.bfloat16()).float(), expect, atol=0.15, rtol=0.05)
    assert fast.layout == "cpu_q4"  # odd N and K are padded for the C++ kernel


def test_awq_beats_round_to_nearest_when_activations_have_outliers():
    w = torch.randn(32, 128, generator=g)
    x = torch.randn(256, 128, generator=g)
    x[:, :4] *= 30  # a few salient input channels, as in real LLM activations
    s, awq_err, rtn_err = awq_scale(w, x, 64)
    assert awq_err < 0.8 * rtn_err
    module = Int4Linear.from_weight(w, None, 64, s, fast=False)
    plain = Int4Linear.from_weight(w, None, 64, None, fast=False)
    ref = x @ w.T
    assert (module(x) - ref).pow(2).mean() < (plain(x) - ref).pow(2).mean()


def test_q4_blocks_are_the_ggml_formula():
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    for kind in ("Q4_0", "Q4_1"):
        raw = quantize(w, T[kind])
        q, s, z = q4_blocks(raw, 8, 64, kind)
        ours = dequantize_int4(q, s, z, 32).numpy()
        np.testing.assert_allclose(ours, dequantize(raw, T[kind]), atol=1e-6)
    assert gguf


def test_mixed_precision_keeps_matching_layers():
    model = nn.Sequential()
    model.add_module("a", nn.Linear(32, 32))
    model.add_module("lm_head", nn.Linear(32, 8))
    swapped = swap_linears(model, lambda name, lin: Int8Linear.from_linear(lin), keep=["lm_head"])
    assert swapped == ["a"] and isinstance(model.a, Int8Linear) and isinstance(model.lm_head, nn.Linear)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_engine_serves_quantized_tiny_model(tiny_dirs, quant):
    cfg = tiny_config(tiny_dirs["llama"])
    cfg.model.dtype = "bf16"
    cfg.quant = Int4QuantConfig(name=quant, group_size=32) if quant == "int4" else QuantConfig(name=quant)
    e = Engine(cfg)
    linears = [n for n, m in e.model.named_modules() if isinstance(m, (Int8Linear, Int4Linear))]
    # 7 quantized linears a layer, q/k/v and gate/up then fused into one each (core.model.fuse)
    assert len(linears) == 2 * 4 + 1 and "lm_head" in linears and e.model.fused_projections == 4
    assert "model.layers.1.self_attn.qkv_proj.inner" in linears and "model.layers.1.mlp.gate_up_proj.inner" in linears
    out = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6


def test_int8_kv_cache_attention_close_to_full_precision():
    from servelab_kernels.attention import write_kv
    from tests.tiny import attend

    gen = torch.Generator().manual_seed(3)
    kvh, bs, d, nb = 2, 4, 16, 16
    ctx_lens, q_lens = [9, 14], [9, 1]
    k = [torch.randn(c, kvh, d, generator=gen) for c in ctx_lens]
    v = [torch.randn(c, kvh, d, generator=gen) for c in ctx_lens]
    tables = [[3, 7, 1], [0, 5, 9, 12]]
    outs = []
    for dtype in (torch.float32, torch.int8):
        kc = torch.zeros(nb, kvh, bs, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        scales = (torch.zeros(nb, kvh, bs, dtype=torch.float16), torch.zeros(nb, kvh, bs, dtype=torch.float16)) \
            if dtype == torch.int8 else ()
        for kk, vv, t in zip(k, v, tables):
            slots = torch.tensor([t[p // bs] * bs + p % bs for p in range(kk.shape[0])])
            write_kv(kk, vv, kc, vc, slots, *scales)
        q = torch.randn(sum(q_lens), 4, d, generator=torch.Generator().manual_seed(9))
        bt = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32)
        outs.append(attend(q, kc, vc, bt, torch.tensor(ctx_lens), torch.tensor([0, 9, 10]), 0.25,
                           k_scale=scales[0] if scales else None, v_scale=scales[1] if scales else None))
    torch.testing.assert_close(outs[1], outs[0], atol=0.03, rtol=0.03)


def test_int8_kv_cache_doubles_capacity_and_serves(tiny_dirs):
    from plugins.cache.paged import PagedCacheConfig

    def engine(dtype):
        cfg = tiny_config(tiny_dirs["llama"], scheduler="continuous")
        cfg.cache = PagedCacheConfig(name="paged", block_size=8, memory_gb=0.001, dtype=dtype)
        return Engine(cfg)

    full, small = engine("auto"), engine("int8")
    # fp32 model: 16 x 4 B per head and token against 16 x 1 B + a 2 B scale
    assert small.kv_spec.bytes_per_token / full.kv_spec.bytes_per_token == pytest.approx((16 + 2) / 64)
    assert small.allocator.num_blocks / full.allocator.num_blocks == pytest.approx(64 / 18, rel=0.01)
    assert small.backend.kv_caches[0][0].dtype == torch.int8 and len(small.backend.kv_caches[0]) == 4
    # teacher-forced logits through each cache (measured: max |diff| 0.09, mean 0.013 on logits of ~6)
    from core.model.quantize import forward_prompt

    ids = [5, 6, 7, 8, 9] * 3 + list(range(20, 40))
    a = forward_prompt(full.model, ids, full.attention, full.kv_spec)
    b = forward_prompt(small.model, ids, small.attention, small.kv_spec)
    diff = (a - b).abs()
    assert diff.max().item() <= 0.25 and diff.mean().item() <= 0.03, (diff.max().item(), diff.mean().item())
    out = small.generate([ids[:15]], SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    assert len(out) == 8 and small.allocator.stats().num_free_blocks == small.allocator.num_blocks


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_embedding_rows_match_their_reference(bits):
    from servelab_kernels.quant_embedding import QuantEmbedding

    w = torch.randn(50, 64, generator=g)
    emb = QuantEmbedding(w, bits, group_size=32, out_dtype=torch.float32)
    ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
    if bits == 8:
        q, s = quantize_int8(w)
        ref = dequantize_int8(q, s.half().float())
    else:
        q, s, z = quantize_int4(w, 32)
        ref = dequantize_int4(q, s.half().float(), z.half().float(), 32)
    torch.testing.assert_close(emb(ids), ref[ids], atol=1e-5, rtol=1e-5)
    assert emb.q.numel() == w.numel() // (8 // bits)  # 1 byte a weight, or two weights a byte


def test_tied_embedding_follows_a_quantized_lm_head(tiny_dirs):
    from servelab_kernels.quant_embedding import QuantEmbedding

    cfg = tiny_config(tiny_dirs["llama3"])  # tie_word_embeddings=True
    cfg.quant = QuantConfig(name="int8")
    e = Engine(cfg)
    assert isinstance(e.model.model.embed_tokens, QuantEmbedding)
    cfg.quant = Int8QuantConfig(name="int8", keep=["lm_head"])  # mixed precision keeps both
    e = Engine(cfg)
    assert isinstance(e.model.lm_head, nn.Linear)
    assert isinstance(e.model.model.embed_tokens, nn.Embedding)


def test_an_int8_layer_builds_its_kernels_when_made_not_inside_a_compiled_trace():
    """torch.compile cannot trace the build (it reads the C++ sources): a fresh process that makes an
    Int8Linear has the kernels built before any forward, so `backend.compile=true` traces only their op."""
    import subprocess
    import sys

    code = ("import torch; from servelab_kernels import cpp_build; from servelab_kernels.quant import Int8Linear; "
            "Int8Linear.from_linear(torch.nn.Linear(64, 32)); print(('cpu_quant', False) in cpp_build._built)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
