"""Weight quantization: round-trip bounds, fast kernels against their references, odd shapes,
AWQ-style scaling, GGUF blocks served as they are."""

import numpy as np
import pytest
import torch
from torch import nn

from core.config import QuantConfig
from core.engine import Engine
from core.quantize import swap_linears
from core.types import SamplingParams
from kernels.quant import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    int8_matmul,
    int8_matmul_ref,
    quantize_int4,
    quantize_int8,
)
from plugins.quant.gguf import q4_blocks
from plugins.quant.int4 import awq_scale
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


def test_int8_fast_kernel_matches_reference():
    w = torch.randn(96, 64, generator=g)
    q, s = quantize_int8(w)
    x = torch.randn(5, 64, generator=g).bfloat16()
    torch.testing.assert_close(int8_matmul(x, q, s).float(), int8_matmul_ref(x, q, s).float(), atol=0.05, rtol=0.02)


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
    assert fast.fast  # odd N and K are padded for the packed kernel


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
    cfg.quant = QuantConfig(name=quant, extra={"group_size": 32} if quant == "int4" else {})
    e = Engine(cfg)
    linears = [n for n, m in e.backend.model.named_modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert len(linears) == 2 * 7 and not any("lm_head" in n for n in linears)
    out = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6
