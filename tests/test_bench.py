"""`run` and `compare` end to end on a tiny model: every request recorded, reports readable."""

import json
import subprocess
import sys

import pytest

from core.bench.run import compare
from core.config.compose import compose, expand_sweeps

BASE = ["workload=fixed", "workload.num_requests=6", "workload.prompt_len=24", "workload.output_len=5",
        "model.max_model_len=64", "model.dtype=fp32", "run.warmup_requests=1", "run.progress=false"]


@pytest.fixture()
def base(tiny_llama, tmp_path):
    return BASE + [f"model.path={tiny_llama}", f"run.report_dir={tmp_path}"]


def test_run_writes_a_complete_report(base, tmp_path):
    r = subprocess.run([sys.executable, "-m", "core", "run", *base, "run.name=one", "scheduler.max_num_seqs=4",
                        "workload.arrival=poisson", "workload.rate=50"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "out tok/s" in r.stdout and "report:" in r.stdout
    out = tmp_path / "one"
    report = json.loads((out / "report.json").read_text())
    assert len(report["requests"]) == 6
    for q in report["requests"]:
        assert q["num_output_tokens"] == 5 and q["num_prompt_tokens"] == 24
        assert 0 <= q["queue_s"] <= q["ttft_s"] <= q["e2e_s"]
        assert len(q["itl_s"]) == 4
    s = report["summary"]
    assert s["num_requests"] == 6 and s["output_tokens"] == 30
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"]
    roof = report["roofline"]  # the floor of the workload actually run, and the run measured against it
    assert roof["workload_floor"]["time_s"] == max(roof["workload_floor"]["compute_s"], roof["workload_floor"]["memory_s"])
    # (report.json keeps six decimals: a tiny floor keeps few significant digits)
    assert roof["fraction_of_roofline"] == pytest.approx(roof["workload_floor"]["time_s"] / s["duration_s"], rel=0.01)
    assert report["machine"]["cores"] >= 1 and report["workload"]["num_requests"] == 6
    assert report["steps"] and all("kv_usage" in st for st in report["steps"])
    md = (out / "report.md").read_text()
    cost = s["step_cost"]  # the engine's online model of its step time, fitted on this run's steps
    assert cost["num_steps"] + cost["num_outliers"] >= len(report["steps"]) and cost["coefficients_s"]["overhead"] > 0
    for section in ("## Throughput", "## Latency", "## The physical limit", "## Step-cost model (learned online)",
                    "![timeline.png](timeline.png)"):
        assert section in md
    for png in ("latency_cdf.png", "latency_percentiles.png", "timeline.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_compare_puts_the_hf_peer_in_the_same_table(base, tmp_path):
    compare(base, [[], ["peer=hf"]], ["servelab", "hf"], "cmp")
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert [r["label"] for r in report["runs"]] == ["servelab", "hf"]
    for run in report["runs"]:
        assert len(run["requests"]) == 6
        assert all(q["num_output_tokens"] == 5 and q["ttft_s"] <= q["e2e_s"] for q in run["requests"])
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "| servelab |" in md and "| hf |" in md and "Ratios against `servelab`" in md


def test_multirun_sweep_expands_to_variants():
    fixed, variants = expand_sweeps(["cache=paged", "scheduler=static,continuous", "model.dtype=fp32,bf16"])
    assert fixed == ["cache=paged"]
    assert variants == [["scheduler=static", "model.dtype=fp32"], ["scheduler=static", "model.dtype=bf16"],
                        ["scheduler=continuous", "model.dtype=fp32"], ["scheduler=continuous", "model.dtype=bf16"]]


def test_a_rate_sweep_means_poisson_arrivals_unless_named():
    from core.cli import rate_sweep_arrivals

    fixed, variants = expand_sweeps(["workload.rate=0.5,1", "scheduler=slo"])
    assert rate_sweep_arrivals(fixed, variants) == ["scheduler=slo", "workload.arrival=poisson"]
    assert rate_sweep_arrivals(fixed + ["workload.arrival=gamma"], variants)[-1] == "workload.arrival=gamma"
    assert rate_sweep_arrivals(*expand_sweeps(["scheduler=static,slo"])) == []


def test_requests_larger_than_the_pool_are_counted_as_rejected(base, tmp_path):
    from core.bench.run import run_one

    # fp32 tiny model: 512 B/token; 8 blocks of 4 tokens hold 32 tokens
    base = [o for o in base if not o.startswith("workload")]
    cfg = compose(base + ["scheduler=continuous", "cache=paged", "cache.block_size=4", f"cache.memory_gb={8 * 4 * 512 / 1e9}",
                          "workload=uniform", "workload.num_requests=12", "workload.prompt_len_min=10",
                          "workload.prompt_len_max=40", "workload.output_len_min=5", "workload.output_len_max=5"])
    r = run_one(cfg)
    too_big = sum(1 for q in r["requests"] if q["num_prompt_tokens"] + 5 > 32)
    assert too_big == 0 and r["summary"]["rejected"] > 0
    assert r["summary"]["num_requests"] + r["summary"]["rejected"] == 12
    assert all("can never fit" in x["reason"] for x in r["rejected"])
    assert r["config"]["scheduler"]["max_num_batched_tokens"] == 128  # null in conf/: the CPU's default, as run
