"""`python -m core eval` end to end on the tiny model."""

import json
import subprocess
import sys


def test_eval_reports_quality_size_and_speed(tiny_llama, tmp_path):
    r = subprocess.run([
        sys.executable, "-m", "core", "eval", f"model.path={tiny_llama}", "model.max_model_len=128",
        "eval.only=[bf16,int8,kv-int8]", "eval.new_tokens=4", "eval.ppl_windows=2", "eval.ppl_window_len=24",
        "eval.speed_new_tokens=3", "eval.speed_batches=[1,4]", f"eval.report_dir={tmp_path}", "eval.name=t",
    ], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "t" / "report.json").read_text())
    res = rep["results"]
    assert set(res) == {"baseline", "bf16", "int8", "kv-int8"}
    assert res["baseline"]["categories"]["code"]["kl"] < 1e-6  # the baseline against itself
    assert res["baseline"]["categories"]["math"]["top1_agreement"] == 1.0
    for name in ("bf16", "int8", "kv-int8"):
        for cat in ("chat", "code", "math"):
            c = res[name]["categories"][cat]
            assert c["kl"] >= -1e-6 and 0 <= c["top1_agreement"] <= 1 and 0 <= c["greedy_exact_match"] <= 1
        assert res[name]["perplexity"] > 1 and res[name]["decode_tok_s"]["1"] > 0
    assert res["int8"]["weight_bytes"] < 0.75 * res["bf16"]["weight_bytes"]  # tiny: embeddings dominate
    assert res["kv-int8"]["kv_bytes_per_token"] < 0.6 * res["bf16"]["kv_bytes_per_token"]
    assert "| int8 (`quant=int8`) |" in (tmp_path / "t" / "report.md").read_text()


def test_unknown_eval_variant_is_one_line(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "core", "eval", f"model.path={tiny_llama}", "eval.only=[nope]"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unknown eval variant(s) nope" in r.stderr and "Traceback" not in r.stderr
