"""`python -m core plan`: the seed's worked KV figures, and the plan of a real model on a profile."""

from __future__ import annotations

import json

import pytest

from core.bench.plan import concurrency, covering_length, kv_bytes_per_token
from core.cli import main


def test_the_seeds_kv_figures():
    """32 layers, 32 heads, head_dim 128, 4,096 tokens, fp16 (2 bytes, as bf16): about 2.1 GB a request; 32 of them
    about 67 GB (the seed multiplies the rounded 2.1 GB: 67.2); 40 GB left at 2 GB each is 20 in
    theory, 15 planned."""
    per_request = kv_bytes_per_token(32, 32, 128, 2) * 4096
    assert per_request == 2 * 32 * 32 * 128 * 4096 * 2 == 2_147_483_648
    assert round(per_request / 1e9, 1) == 2.1
    assert 32 * round(per_request / 1e9, 1) == pytest.approx(67.2)
    assert 32 * per_request / 1e9 == pytest.approx(68.72, abs=0.01)
    assert concurrency(40e9, 2e9, 0.75) == (20, 15)


def test_covering_length_rounds_up_to_a_multiple_of_1024():
    lengths = list(range(1, 101)) * 10 + [7000]  # p99 within the first 100, the max far out
    p, covering = covering_length(lengths, 0.99)
    assert p == 100 and covering == 1024
    assert covering_length([5000, 5000], 0.5) == (5000, 5120)


def test_plan_llama_2_7b_on_an_a100(tmp_path, capsys):
    rc = main(["plan", "model=llama-2-7b", "hardware=a100-80gb", f"plan.report_dir={tmp_path}",
               "plan.name=p", "workload=chat_longtail"])
    assert rc == 0
    p = json.loads((tmp_path / "p" / "report.json").read_text())
    assert p["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2
    assert p["kv_bytes_per_request"] == 2_147_483_648  # max_model_len 4096
    params = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 2 * 32000 * 4096  # layers, embedding and head
    assert p["parameters"] == params and p["weight_bytes"] == 2 * params
    budget = 0.9 * 80e9 - 2 * params - p["activation_reserve_bytes"]
    assert p["kv_budget_bytes"] == pytest.approx(budget)
    assert p["max_concurrency"] == int(budget // 2_147_483_648)
    assert p["planned_concurrency"] == int(p["max_concurrency"] * 0.75)
    w = p["workload"]
    assert w["covering_max_model_len"] % 1024 == 0 and w["covering_max_model_len"] >= w["length_at_percentile"]
    assert w["max_concurrency"] == int(budget // (w["covering_max_model_len"] * 524288))
    assert "in theory / planned" in capsys.readouterr().out


def test_plan_needs_a_hardware_profile(capsys):
    assert main(["plan", "model=llama-2-7b"]) == 2
    assert "plan needs hardware=NAME" in capsys.readouterr().err


def test_a_model_too_large_for_the_device_says_so(capsys, tmp_path):
    assert main(["plan", "model=llama-3-70b", "hardware=l4", f"plan.report_dir={tmp_path}"]) == 0
    p = json.loads(next(tmp_path.glob("*/report.json")).read_text())
    assert p["kv_budget_bytes"] < 0 and p["max_concurrency"] == 0 and p["planned_concurrency"] == 0


def test_plan_slo_finds_the_fewest_replicas_by_simulation(tmp_path):
    """Replicas are added until at least 90 % of requests meet both targets at rate / replicas:
    the last try meets it, every earlier one does not."""
    rc = main(["plan", "model=llama-2-7b", "hardware=a100-80gb", "plan.slo=true", "plan.rate=40",
               "plan.num_requests=60", "workload=chat_longtail", "workload.slo_ttft_s=0.5", "workload.slo_tpot_s=0.05",
               f"plan.report_dir={tmp_path}", "plan.name=p"])
    assert rc == 0
    s = json.loads((tmp_path / "p" / "report.json").read_text())["slo"]
    tried = s["tried"]
    assert s["replicas"] == tried[-1]["replicas"] == len(tried) >= 2
    assert tried[-1]["attained"] >= 0.9 and all(t["attained"] < 0.9 for t in tried[:-1])
    assert [t["rate_per_replica"] for t in tried] == pytest.approx([40 / k for k in range(1, len(tried) + 1)])
    assert "replicas" in (tmp_path / "p" / "report.md").read_text()
