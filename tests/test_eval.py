"""`python -m core eval` end to end on the tiny model."""

import json
import subprocess
import sys

import pytest


def test_eval_reports_quality_size_and_speed(tiny_llama, tmp_path):
    r = subprocess.run([
        sys.executable, "-m", "core", "eval", f"model.path={tiny_llama}", "model.max_model_len=128",
        "eval.only=[bf16,int8,kv-int8,kv-bf16]", "eval.new_tokens=4", "eval.ppl_windows=2", "eval.ppl_window_len=24",
        "eval.speed_new_tokens=3", "eval.speed_batches=[1,4]", f"eval.report_dir={tmp_path}", "eval.name=t",
    ], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "t" / "report.json").read_text())
    res = rep["results"]
    assert set(res) == {"baseline", "bf16", "int8", "kv-int8", "kv-bf16"}
    for name in ("bf16", "int8", "kv-int8", "kv-bf16"):  # each variant differs from fp32, a little (tiny random model)
        for cat in ("chat", "code", "math"):
            c = res[name]["categories"][cat]
            assert 0 < c["kl"] < 0.2, (name, cat, c)
        assert abs(res[name]["perplexity"] / res["baseline"]["perplexity"] - 1) < 0.1
        assert set(res[name]["decode_tok_s"]) == {"1", "4"}
    assert res["int8"]["weight_bytes"] < 0.75 * res["bf16"]["weight_bytes"]  # tiny: embeddings dominate
    assert res["kv-int8"]["kv_bytes_per_token"] < 0.6 * res["bf16"]["kv_bytes_per_token"]
    # an fp32 model over a bf16 cache: the bf16 model's KV bytes, half the fp32 baseline's
    assert res["kv-bf16"]["kv_bytes_per_token"] * 2 == res["baseline"]["kv_bytes_per_token"] == \
        2 * res["bf16"]["kv_bytes_per_token"]
    assert "| int8 (`quant=int8`) |" in (tmp_path / "t" / "report.md").read_text()


def test_unknown_eval_variant_is_one_line(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "core", "eval", f"model.path={tiny_llama}", "eval.only=[nope]"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown eval variant(s) nope" in r.stderr and "Traceback" not in r.stderr


def test_eval_numbers_match_an_independent_computation(tiny_llama):
    """evaluate_variant's KL, top-1, exact match and perplexity, recomputed here from transformers'
    fp32 logits (the reference) and the formulas, for a bf16 variant."""
    import math

    import torch
    import transformers

    from core.bench.evaluate import evaluate_variant
    from core.engine.engine import Engine
    from core.engine.types import SamplingParams
    from core.model.quantize import forward_prompt
    from tests.tiny import tiny_config

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = {"chat": [[5, 6, 7, 8], [40, 41, 42]]}
    base = Engine(tiny_config(tiny_llama))
    conts = [o.outputs[0].token_ids for o in base.generate(prompts["chat"], SamplingParams(max_tokens=6,
                                                                                             ignore_eos=True))]

    def hf_logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)

    reference = {"chat": {"tokens": conts, "logprobs": [hf_logprobs(p + c)[len(p) - 1:-1]
                                                        for p, c in zip(prompts["chat"], conts)]}}
    window = list(range(30, 70))
    cfg = tiny_config(tiny_llama)
    cfg.model.dtype = "bf16"
    variant = Engine(cfg)
    got = evaluate_variant(variant, prompts, reference, [window])
    kls, agree = [], []
    for p, c, lp0 in zip(prompts["chat"], conts, reference["chat"]["logprobs"]):
        lp = torch.log_softmax(forward_prompt(variant.model, p + c, variant.attention, variant.kv_spec)
                               [len(p) - 1:-1].float(), -1)
        kls.append(float((lp0.exp() * (lp0 - lp)).sum(-1).mean()))
        agree.append(float((lp.argmax(-1) == lp0.argmax(-1)).float().mean()))
    assert got["categories"]["chat"]["kl"] == pytest.approx(sum(kls) / 2, rel=1e-5)
    assert got["categories"]["chat"]["top1_agreement"] == pytest.approx(sum(agree) / 2)
    mine = [o.outputs[0].token_ids for o in variant.generate(prompts["chat"], SamplingParams(max_tokens=6,
                                                                                              ignore_eos=True))]
    assert got["categories"]["chat"]["greedy_exact_match"] == sum(m == c for m, c in zip(mine, conts)) / 2
    # perplexity of the fp32 baseline through servelab equals transformers' (logits agree to 1e-4)
    fp32 = evaluate_variant(base, prompts, reference, [window])
    nll = -hf_logprobs(window)[:-1].gather(1, torch.tensor(window[1:])[:, None]).sum().item()
    assert fp32["perplexity"] == pytest.approx(math.exp(nll / (len(window) - 1)), rel=1e-4)
    assert fp32["categories"]["chat"]["kl"] < 1e-6 and fp32["categories"]["chat"]["top1_agreement"] == 1.0
