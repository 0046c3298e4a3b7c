"""`python -m core bench scenario=...`: replay a scenario with locust against an OpenAI-compatible server.

Locust runs headless in its own process (it patches everything with gevent at import). With no
`target=URL`, servelab's own server is started with the same overrides as `serve` and stopped
afterwards. The report has the same shape as `run`'s (per-request records, percentiles, goodput,
CDF and timeline plots) plus locust's CSV and HTML; a ramp scenario runs one stage per user
count and writes the throughput-latency curve with the knee where P99 TTFT breaks the SLO.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from core.bench import replica_report, report, server_state
from core.bench.driver import slo_targets, workload_config
from core.bench.preflight import check_before_loading
from core.bench.roofline import machine_info
from core.bench.summary import summarize
from core.config.compose import compose
from core.config.schema import run_config, section
from core.engine.components import engine_config, model_tokenizer
from core.errors import ConfigError
from scenarios.workloads import build_workload, materialize

LOCUSTFILE = Path(str(resources.files("scenarios") / "locustfile.py"))


@dataclass
class ScenarioConfig:
    name: str = "chat_longtail"
    workload: str = "chat_longtail"
    chat: bool = False
    users: int = 8
    spawn_rate: float = 8
    rate_per_user: float = 0.5
    burstiness: float = 1.0
    duration_s: float = 60
    max_requests: int = 0
    ramp: list | None = None  # stages of user counts
    ramp_rates: list | None = None  # or stages of rate_per_user at `users` users
    stage_s: float = 30
    agent: dict | None = None


@dataclass
class TargetConfig:
    url: str | None = None  # None: start servelab's server
    model: str | None = None  # the model name to send; None: ask /v1/models
    api_key: str | None = None
    ignore_eos: bool = True  # whether the server accepts ignore_eos (vLLM, SGLang, servelab do)
    timeout_s: float = 600
    workers: int = 0  # >0: locust master + this many worker processes on this machine
    kill_replica_after_s: float | None = None  # fault injection: SIGKILL one replica (Ray Serve) this far into the run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ConfigError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            status = httpx.get(f"{url}/ready", timeout=2).status_code
            if status == 404:  # not servelab: the /health that vLLM, SGLang and llama.cpp's server answer when ready
                status = httpx.get(f"{url}/health", timeout=2).status_code
            if status == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise ConfigError(f"{url} was not ready within {timeout:.0f} s")


def _served_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


def _records(prefix: Path) -> list[dict]:
    """Every locust process's JSON lines (RequestRecords), merged and numbered in arrival order;
    the files are removed: report.json keeps them all."""
    out = []
    for f in sorted(prefix.parent.glob(prefix.name + ".*")):
        lines = f.read_text().splitlines()
        f.unlink()
        out += [json.loads(line) for line in lines]
    out.sort(key=lambda r: r["arrival_s"])
    for i, r in enumerate(out):
        r["request_id"] = str(i)
    return out


def run_locust(spec: dict, url: str, users: int, spawn_rate: float, duration_s: float, out: Path, tag: str,
               workers: int = 0) -> tuple[list[dict], float]:
    """One headless locust run; returns (records, wall seconds)."""
    spec_file = out / f"scenario-{tag}.json"
    spec_file.write_text(json.dumps(spec))
    records = out / f"records-{tag}.jsonl"
    for old in out.glob(records.name + ".*"):
        old.unlink()
    t0 = time.perf_counter()  # CLOCK_MONOTONIC: the locust processes measure from the same origin
    env = {**os.environ, "SERVELAB_SCENARIO": str(spec_file), "SERVELAB_RECORDS": str(records),
           "SERVELAB_ORIGIN": repr(t0)}
    base = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
            "-u", str(users), "-r", str(spawn_rate), "-t", f"{max(1, int(duration_s))}s", "--stop-timeout", "120",
            "--csv", str(out / f"locust-{tag}"), "--html", str(out / f"locust-{tag}.html"), "--only-summary",
            "--loglevel", "WARNING"]
    if workers > 0:
        port = _free_port()
        master = subprocess.Popen(base + ["--master", "--expect-workers", str(workers), "--master-bind-port", str(port)],
                                  env=env)
        procs = [subprocess.Popen([sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker",
                                   "--master-port", str(port), "--loglevel", "WARNING"], env=env)
                 for _ in range(workers)]
        rc = master.wait()
        for p in procs:
            p.wait(timeout=60)
    else:
        rc = subprocess.run(base, env=env, check=False).returncode
    result = _records(records), time.perf_counter() - t0
    spec_file.unlink()  # the prompts are in the workload; the records in report.json
    if not result[0] and rc != 0:  # locust also exits 1 when some requests failed: only no record is fatal
        raise ConfigError(f"locust exited with status {rc} and recorded no request (see its output above)")
    return result


def _start_server(overrides: list[str], sc: ScenarioConfig) -> tuple[subprocess.Popen, str]:
    """servelab's own server, with the same overrides as `serve`, on a free port."""
    port = _free_port()
    queue = [] if any(o.startswith("server.max_queue=") for o in overrides) else \
        [f"server.max_queue={max(256, 4 * max(sc.ramp or [sc.users]))}"]  # room for every user by default
    proc = subprocess.Popen([sys.executable, "-m", "core", "serve", *overrides, f"server.port={port}", *queue])
    return proc, f"http://127.0.0.1:{port}"


def _stages(sc: ScenarioConfig) -> list[tuple[int, float]]:
    if sc.ramp_rates:
        return [(sc.users, rate) for rate in sc.ramp_rates]
    return [(users, sc.rate_per_user) for users in (sc.ramp or [sc.users])]


def _stage_result(cfg, sc: ScenarioConfig, rc, wc, url: str, workload, users: int, rate: float, records, wall
                  ) -> dict:
    ok = [r for r in records if not r["error"]]
    refused = [r for r in records if r["error"] and r["error"].startswith("HTTP 429")]  # shed or queue full
    summary = summarize(ok, wall, [], *slo_targets(wc, rc), num_rejected=len(refused))
    summary["failures"] = len(records) - len(ok)
    extra = {"offered_rate": users * rate} if sc.ramp_rates else {}
    return {
        **extra,
        "label": f"{sc.name} users={users}" + (f" rate={rate:g}" if sc.ramp_rates else ""), "users": users,
        "rate_per_user": rate, "config": OmegaConf.to_container(cfg, resolve=True), "target": url,
        "model": {"path": url, "architecture": "remote", "dtype": "-"}, "kv_cache": "see the server's /metrics",
        "machine": machine_info(), "workload": workload.describe(), "summary": summary, "roofline": None,
        "requests": records, "steps": [],
    }


def _spec(sc: ScenarioConfig, tc: TargetConfig, rc, wc, workload, tokenizer) -> dict:
    return {"name": sc.name, "api_key": tc.api_key, "ignore_eos": tc.ignore_eos,
            "timeout_s": tc.timeout_s, "rate_per_user": sc.rate_per_user, "burstiness": sc.burstiness,
            "max_requests": sc.max_requests, "agent": sc.agent, "chat": sc.chat,
            "slo": dict(zip(("slo_ttft_s", "slo_tpot_s"), slo_targets(wc, rc))) if wc.slo_ttft_s or wc.slo_tpot_s
            else None,
            "requests": [{"prompt": tokenizer.decode(r.prompt_token_ids), "output_len": r.output_len}
                         for r in workload.requests]}


def bench_target(cfg: DictConfig, overrides: list[str], workload, spec: dict, out: Path, label: str | None = None
                 ) -> list[dict]:
    """Every stage against one target (servelab's own server, started with `overrides`, unless
    target.url is set); the last stage carries what the server counted over all of them."""
    sc = section(ScenarioConfig, cfg.get("scenario"), "scenario")
    tc = section(TargetConfig, cfg.get("target"), "target")
    rc, wc = run_config(cfg), workload_config(cfg)
    server, url = _start_server(overrides, sc) if tc.url is None else (None, tc.url)
    try:
        _wait_ready(url, server)
        spec = {**spec, "model": tc.model or _served_model(url, tc.api_key)}
        before, listed = server_state.scrape(url), server_state.listing(url)
        killer = server_state.ReplicaKiller(url, tc.kill_replica_after_s).start() if tc.kill_replica_after_s else None
        stages, results = _stages(sc), []
        prefix = re.sub(r"\W+", "_", label).strip("_") + "-" if label else ""
        for users, rate in stages:
            tag = prefix + f"u{users}" + (f"-r{rate:g}" if sc.ramp_rates else "")
            records, wall = run_locust({**spec, "rate_per_user": rate}, url, users, max(sc.spawn_rate, users),
                                       sc.stage_s if len(stages) > 1 else sc.duration_s, out, tag, tc.workers)
            results.append(_stage_result(cfg, sc, rc, wc, url, workload, users, rate, records, wall))
        after, last = server_state.scrape(url), results[-1]
        last["server_metrics"], prefix_cache = server_state.run_counts(before, after)  # this run's share only
        if prefix_cache:
            last["summary"]["prefix_cache"] = prefix_cache
        if listed is not None:
            now = killer.await_replacement(len(listed["replicas"])) if killer else server_state.listing(url)
            last["replicas"] = server_state.replicas_seen(listed, now, after, killer)
        if label:
            for r in results:
                r["label"] = label
        return results
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)


def run_bench(cfg: DictConfig, overrides: list[str], variants: list[list[str]] | None = None,
              labels: list[str] | None = None) -> int:
    """One target, or (variants) one server per variant, each the base overrides plus its own, on
    the same requests: one comparison report."""
    sc = section(ScenarioConfig, cfg.get("scenario"), "scenario")
    tc = section(TargetConfig, cfg.get("target"), "target")
    rc, ec, wc = run_config(cfg), engine_config(cfg), workload_config(cfg)
    tokenizer = model_tokenizer(ec)
    workload = build_workload(wc, ec.model.max_model_len)
    materialize(workload, tokenizer)
    name = rc.name or f"bench-{sc.name}-{ec.scheduler.name}"
    out = Path(rc.report_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    spec = _spec(sc, tc, rc, wc, workload, tokenizer)
    if variants:
        cfgs = [compose(overrides + var) for var in variants]
        for vcfg in cfgs:  # every variant checked before the first server starts
            check_before_loading("bench", vcfg)
        results = []
        for i, (var, vcfg) in enumerate(zip(variants, cfgs)):
            label = labels[i] if labels and i < len(labels) else " ".join(var)
            print(f"[{i + 1}/{len(variants)}] {label}")
            results += bench_target(vcfg, engine_overrides(overrides + var), workload, spec, out, label)
        replica_report.write_bench_comparison(results, name, rc)
    else:
        results = bench_target(cfg, engine_overrides(overrides), workload, spec, out)
        if len(results) == 1:
            report.write_run(results[0], name, rc)
        else:
            report.write_curve(results, name, rc)
    print(report.summary_table(results))
    print(f"report: {out / 'report.md'}")
    return 0


def engine_overrides(overrides: list[str]) -> list[str]:
    """The overrides the server takes (the bench's own sections stay here)."""
    return [o for o in overrides if not o.startswith(("scenario", "target", "run.", "workload"))]
