"""`python -m core bench`: locust in its own process against servelab's server on the tiny model."""

import json
import subprocess
import sys

# never import locust here: it monkey-patches the whole process with gevent (it is a declared
# dev dependency: a missing locust fails these tests rather than skipping them)

COMMON = ["model.max_model_len=256", "cache.memory_gb=0.01", "workload=fixed", "workload.prompt_len=24",
          "workload.output_len=8", "workload.num_requests=32"]


def bench(tiny_llama, tmp_path, *overrides, timeout=240):
    r = subprocess.run([sys.executable, "-m", "core", "bench", f"model.path={tiny_llama}", *COMMON,
                        f"run.report_dir={tmp_path}", "run.name=b", *overrides],
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads((tmp_path / "b" / "report.json").read_text())


def test_short_scenario_records_every_request(tiny_llama, tmp_path):
    # ten requests, however long they take: the run ends when the last one has (the time limit is a backstop)
    rep = bench(tiny_llama, tmp_path, "scenario.duration_s=120", "scenario.max_requests=10", "scenario.users=4",
                "scenario.rate_per_user=2")
    reqs = rep["requests"]
    assert len(reqs) == 10 and rep["summary"]["failures"] == 0
    counted = rep["server_metrics"]["smollm2-135m"]  # the server's own count over the run (its warm-up excluded)
    assert counted["requests"] == 10 and counted["generation_tokens"] == 10 * 8
    assert counted["prefix_queries"] == sum(r["num_prompt_tokens"] for r in reqs)
    for r in reqs:
        assert r["error"] is None and r["num_output_tokens"] == 8 and r["num_prompt_tokens"] > 0
        assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) >= 1
    assert rep["summary"]["ttft_s"]["p99"] >= rep["summary"]["ttft_s"]["p50"]
    stats = (tmp_path / "b" / "locust-u4_stats.csv").read_text().splitlines()
    assert stats[0].startswith("Type,Name") and any("e2e" in line for line in stats)
    assert (tmp_path / "b" / "report.md").read_text().startswith("# servelab run")


def test_agent_scenario_retries_and_falls_back_to_a_model_of_its_own(tiny_llama, tmp_path):
    # one running sequence and a queue of one: concurrent agents get 429s and retry; long answers hit
    # the server's request timeout, and the retry goes to the fallback model, served beside the main one.
    # 1,500 tokens take over 0.4 s at any step time this engine reaches (0.27 ms), queued or not: with 300,
    # a faster CI machine finished every answer inside the timeout (1 ms a step here, 0.3 s)
    rep = bench(tiny_llama, tmp_path, "scenario=agent", "scenario.duration_s=120", "scenario.max_requests=8",
                "scenario.users=6", "scheduler.max_num_seqs=1", "server.max_queue=1", "server.request_timeout_s=0.4",
                'server.models={backup:["scheduler.max_num_seqs=4"]}', "model.max_model_len=2048",
                "workload.output_len=1500", "scenario.agent.tool_result_chars=10",
                "scenario.agent.fallback_model=backup", "scenario.agent.retries=3")
    reqs = rep["requests"]
    errors = [r["error"] or "" for r in reqs]
    assert any("429" in e for e in errors)  # the queue guard rail pushed back
    assert any("timeout" in e.lower() for e in errors)  # the server gave up on a long answer
    on_backup = [r for r in reqs if r["model"] == "backup"]
    assert on_backup  # and retried on the fallback model
    assert rep["summary"]["failures"] == sum(1 for e in errors if e)
    served = rep["server_metrics"]["backup"]["requests"]  # every request sent there landed there
    assert served >= sum(1 for r in on_backup if not r["error"])


def test_a_users_sweep_makes_one_curve_report(tiny_llama, tmp_path):
    r = subprocess.run([sys.executable, "-m", "core", "bench", "-m", "scenario.users=1,3", f"model.path={tiny_llama}",
                        *COMMON, "scenario.stage_s=3", "scenario.rate_per_user=0", f"run.report_dir={tmp_path}",
                        "run.name=c", "run.slo_ttft_s=0.000001"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "c" / "report.json").read_text())
    assert [s["users"] for s in rep["stages"]] == [1, 3]
    assert rep["knee"]["users"] == 1  # an SLO nobody meets breaks at the first stage
    md = (tmp_path / "c" / "report.md").read_text()
    assert "The knee: 1 users" in md and "load_curve.png" in md
    assert (tmp_path / "c" / "load_curve.png").read_bytes()[:4] == b"\x89PNG"


def test_a_target_without_ready_is_awaited_on_its_health(monkeypatch):
    # llama.cpp's server (like vLLM and SGLang) has no /ready: 404 there, 503 on /health while it
    # loads, then 200; servelab's own /ready is asked first
    import httpx

    from core.bench import loadtest

    seen, health = [], iter([503, 503, 200])

    def get(url, timeout):
        seen.append(url.rsplit("/", 1)[1])
        return httpx.Response(404 if url.endswith("/ready") else next(health))

    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(loadtest.time, "sleep", lambda s: None)
    loadtest._wait_ready("http://target", None, timeout=60)
    assert seen == ["ready", "health"] * 3
