"""`python -m core calibrate`: the fit recovers a known profile from its own step times, and the
command measures, fits, saves where hardware=cpu finds it, and validates end to end."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from core.bench.calibrate import fit_profile
from core.cli import main
from core.engine.hardware import HardwareProfile, StepTimeModel
from core.model.llama import ModelArgs

SMOL = ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                 num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def test_the_fit_recovers_the_profile_that_made_the_step_times():
    base = HardwareProfile(name="cpu", bf16_tflops=0.4, memory_bandwidth_gbs=30, memory_gb=24)
    truth = dataclasses.replace(base, matmul_efficiency=0.8, bandwidth_efficiency=0.35,
                                attention_efficiency=float(np.geomspace(0.02, 1.0, 15)[9]),
                                step_overhead_s=0.004, sequence_overhead_s=0.0003)
    model = StepTimeModel(SMOL, truth, 2, 23040)
    samples = []
    for b in (1, 4, 16, 64):
        for c in (128, 1024):
            samples.append({"point": f"decode {b} x {c}", "tokens": b, "sampled": b, "kv_read": b * c,
                            "pairs": b * c, "seqs": b})
    for t in (32, 128, 512, 1536):
        samples.append({"point": f"prefill {t}", "tokens": t, "sampled": 1, "kv_read": t,
                        "pairs": t * (t + 1) / 2, "seqs": 1})
    for s in samples:
        s["duration_s"] = model.step(s["tokens"], s["sampled"], s["kv_read"], s["pairs"], s["seqs"]).total
    fitted, fit = fit_profile(samples, base, StepTimeModel(SMOL, base, 2, 23040))
    assert fitted.matmul_efficiency == pytest.approx(0.8)
    assert fitted.bandwidth_efficiency == pytest.approx(0.35)
    assert fitted.attention_efficiency == pytest.approx(truth.attention_efficiency)
    assert fitted.step_overhead_s == pytest.approx(0.004, abs=1e-9)
    assert fitted.sequence_overhead_s == pytest.approx(0.0003, abs=1e-9)
    assert fit["median_abs_relative_error"] < 1e-9


def test_calibrate_measures_fits_saves_and_validates(tiny_llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path / "cache"))
    rc = main(["calibrate", f"model.path={tiny_llama}", "model.name=tiny", "model.dtype=fp32",
               "model.max_model_len=256", "calibrate.decode_batches=[1,4]", "calibrate.contexts=[16]",
               "calibrate.prefill_tokens=[32,96]", "calibrate.reps=2", "calibrate.validate=[fixed]",
               "calibrate.validate_overrides=['workload.num_requests=4','workload.prompt_len=24','workload.output_len=6']",
               f"calibrate.report_dir={tmp_path}", "run.warmup_requests=1", "run.progress=false"])
    assert rc == 0
    saved = list((tmp_path / "cache").glob("hardware-cpu-*.json"))
    assert len(saved) == 1
    profile = json.loads(saved[0].read_text())
    assert profile["name"] == "cpu" and 0 < profile["bandwidth_efficiency"] <= 1
    rep = json.loads((tmp_path / "calibration-cpu" / "report.json").read_text())
    points = {p["point"] for p in rep["fit"]["points"]}
    assert points == {"decode 1 x 16", "decode 4 x 16", "prefill 32", "prefill 96"}
    decode4 = [s for s in rep["samples"] if s["point"] == "decode 4 x 16"]
    assert len(decode4) == 2 and all(s["tokens"] == 4 and s["seqs"] == 4 for s in decode4)
    v = rep["validation"][0]
    assert v["workload"] == "fixed" and v["measured"]["output_tok_s"] > 0 and v["simulated"]["output_tok_s"] > 0
    both = json.loads((tmp_path / "calibration-cpu" / "fixed" / "report.json").read_text())["runs"]
    assert [r["summary"].get("simulated") is not None for r in both] == [False, True]
    assert "Simulated against measured" in (tmp_path / "calibration-cpu" / "report.md").read_text()
