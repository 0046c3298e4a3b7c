"""SmoothQuant-style smoothing (core/model/smooth.py, `quant=int8 quant.w8a8=true quant.smooth=true`)."""

import pytest
import torch

from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.errors import ConfigError
from core.model.loader import load_model
from core.model.quantize import forward_prompt
from core.model.smooth import ALPHAS, llama_groups, smooth_model, smooth_scale, w8a8_error
from plugins.quant.int8 import Int8QuantConfig, Int8Quantizer
from tests.tiny import tiny_config

g = torch.Generator().manual_seed(7)


def _outlier_model(path):
    """The tiny model in fp32 with a few hidden channels 40x the rest at every norm's output, as
    real LLMs' activations have them."""
    lm = load_model(path, "fp32")
    with torch.no_grad():
        for layer in lm.model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17]] *= 40.0
            layer.mlp.up_proj.weight[5] *= 30.0  # one large intermediate channel into down_proj
    return lm


def test_smooth_scale_beats_plain_w8a8_when_a_channel_is_an_outlier():
    x = torch.randn(256, 64, generator=g)
    x[:, [2, 9]] *= 50.0
    w = torch.randn(96, 64, generator=g) * 0.05
    s, err, plain, alpha = smooth_scale(x, x.abs().amax(0), [w])
    assert alpha is not None and err < 0.25 * plain
    a, wm = x.abs().amax(0), w.abs().amax(0)
    torch.testing.assert_close(s, a.pow(alpha) / wm.pow(1 - alpha), rtol=1e-6, atol=0)  # SmoothQuant's formula
    assert err == pytest.approx(w8a8_error(x, [w], s), rel=1e-9)


def test_smooth_scale_keeps_plain_w8a8_when_no_alpha_helps():
    # activations alike and weights already on INT8's grid: plain W8A8 is exact, no scale can do better
    x = torch.ones(32, 16)
    w = torch.randint(-126, 127, (8, 16), generator=g).float()
    w[:, 0] = 127.0
    s, err, plain, alpha = smooth_scale(x, x.abs().amax(0), [w])
    assert s is None and alpha is None and err == plain


def test_smoothing_leaves_the_float_model_unchanged_and_shares_scales_across_gqa_heads(tiny_dirs):
    lm = _outlier_model(tiny_dirs["llama"])
    m = lm.model
    assert m.args.num_heads == 2 * m.args.num_kv_heads  # the o_proj group exercises the GQA sharing
    ids = [5, 9, 14, 3, 8, 30, 2, 11, 7, 19]
    ref = forward_prompt(m, ids)
    v_before = m.model.layers[0].self_attn.v_proj.weight.clone()
    prompts = [[(7 * i + j) % 200 + 3 for j in range(48)] for i in range(4)]
    report = smooth_model(m, prompts)
    assert set(report) == {grp.name for grp in llama_groups(m)} and len(report) == 4 * m.args.num_layers
    assert report["model.layers.0.qkv"]["alpha"] is not None and report["model.layers.0.down"]["alpha"] is not None
    for r in report.values():
        assert r["smooth_mse"] <= r["plain_mse"]
    # exact in real arithmetic; fp32 rounding of the folded scales only
    torch.testing.assert_close(forward_prompt(m, ids), ref, atol=2e-4, rtol=1e-4)
    if report["model.layers.0.o"]["alpha"] is not None:
        hd = m.args.head_dim
        ratio = (m.model.layers[0].self_attn.v_proj.weight / v_before)[:, 0].reshape(-1, hd)
        assert not torch.allclose(ratio, torch.ones_like(ratio))


def test_smoothed_w8a8_is_closer_to_the_float_model_than_plain_w8a8(tiny_dirs):
    ids = [5, 9, 14, 3, 8, 30, 2, 11, 7, 19, 4, 6]
    errs = {}
    for smooth in (False, True):
        lm = _outlier_model(tiny_dirs["llama"])
        ref = forward_prompt(lm.model, ids)
        q = Int8Quantizer(Int8QuantConfig(name="int8", w8a8=True, smooth=smooth, fast=False), tokenizer=lm.tokenizer)
        q.config.calibration_prompts, q.config.calibration_len = 4, 48
        q.quantize(lm.model)
        errs[smooth] = (forward_prompt(lm.model, ids) - ref).pow(2).mean().item()
    assert errs[True] < 0.5 * errs[False]


def test_quant_smooth_needs_w8a8():
    with pytest.raises(ConfigError, match="quant.w8a8=true"):
        Int8Quantizer(Int8QuantConfig(name="int8", smooth=True), tokenizer=object())


def test_engine_serves_a_smoothed_w8a8_model_and_reports_every_group(tiny_dirs):
    cfg = tiny_config(tiny_dirs["llama"])
    cfg.model.dtype = "bf16"
    cfg.quant = Int8QuantConfig(name="int8", w8a8=True, smooth=True, calibration_prompts=4, calibration_len=32)
    e = Engine(cfg)
    report = e.quantizer.report
    assert len(report) == 4 * e.model.args.num_layers
    assert all(r["alpha"] in (None, *ALPHAS) for r in report.values())
    out = e.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6


def test_the_searchs_error_is_the_w8a8_twins():
    from servelab_kernels.quant import quantize_int8, w8a8_matmul_ref

    x = torch.randn(64, 96, generator=g)
    x[:, 4] *= 30.0
    w = torch.randn(40, 96, generator=g)
    s = torch.rand(96, generator=g) + 0.5
    q, scales = quantize_int8(w * s)
    want = (w8a8_matmul_ref(x / s, q, scales) - x @ w.T).pow(2).mean().item()
    assert w8a8_error(x, [w], s) == pytest.approx(want, rel=1e-4)


def test_calibration_keeps_few_rows_but_the_largest_magnitudes_of_all(tiny_dirs):
    from core.model.quantize import capture_linear_inputs
    from core.model.smooth import capture_inputs_and_absmax

    lm = load_model(tiny_dirs["llama"], "fp32")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(48)] for i in range(4)]
    name = "model.layers.1.mlp.down_proj"
    rows, absmax = capture_inputs_and_absmax(lm.model, prompts, {name}, max_rows=20)
    everything = capture_linear_inputs(lm.model, prompts, max_rows=10_000)[name]
    assert everything.shape[0] == 4 * 48 and rows[name].shape == (20, everything.shape[1])
    torch.testing.assert_close(absmax[name], everything.abs().amax(0), rtol=0, atol=0)
    # the kept rows are rows that were seen
    assert all(bool((everything == r).all(1).any()) for r in rows[name])
