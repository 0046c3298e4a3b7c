"""Data-parallel replicas on Ray Serve: the prefix-affinity policy on constructed requests, the
merged /metrics, the settings' one-line errors, and (test_ray_*) two live replicas of the tiny
model behind the ingress, one of them killed mid-stream."""

import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.bench import server_state
from core.config.compose import compose
from core.errors import ConfigError
from core.replicas.prefix_affinity import PrefixAffinity, routing_key
from core.replicas.ray_serve import check_replicas, replica_options
from core.server.replica_metrics import ReplicaMetrics
from tests.test_server import _free_port, wait_until

A, B = "a" * 40, "b" * 40  # two system prompts of 4 blocks of 10 characters


def test_a_request_goes_where_its_prefix_went():
    p = PrefixAffinity(block_chars=10, max_imbalance=4)
    p.record(A + "first question", "r1")
    assert p.rank(A + "another question", {"r1": 1, "r2": 0}) == ["r1", "r2"]  # busier, but holds the prefix
    # an unseen prefix goes to the least loaded; at equal load to the replica holding fewer blocks
    assert p.rank(B + "question", {"r1": 0, "r2": 0}) == ["r2", "r1"]
    assert p.rank(B + "question", {"r1": 0, "r2": 3}) == ["r1", "r2"]
    assert p.rank("short", {"r1": 2, "r2": 1}) == ["r2", "r1"]  # under one block: no prefix to follow


def test_the_longest_match_wins_and_a_hot_prefix_does_not_pin_all_traffic():
    p = PrefixAffinity(block_chars=10, max_imbalance=4)
    p.record(A[:20] + "x" * 20, "r1")  # shares 2 blocks with A
    p.record(A + "tail", "r2")  # shares all 4
    assert p.rank(A + "q", {"r1": 0, "r2": 2, "r3": 0})[0] == "r2"
    assert p.rank(A + "q", {"r1": 0, "r2": 3, "r3": 0})[0] == "r2"  # 3 more than the least loaded: still under 4
    # 4 more: the least loaded, the longer match first (r1 has half of A), then the one holding fewer blocks
    assert p.rank(A + "q", {"r1": 0, "r2": 4, "r3": 0}) == ["r1", "r3", "r2"]
    assert p.rank(B + "q", {"r1": 0, "r2": 4, "r3": 0}) == ["r3", "r1", "r2"]


def test_a_dead_replica_is_forgotten_and_old_blocks_age_out():
    p = PrefixAffinity(block_chars=10, max_imbalance=4, capacity=6)
    p.record(A, "r1")
    p.forget("r1")
    assert p.rank(A + "q", {"r1": 0, "r2": 0}) == ["r1", "r2"]  # no affinity left: load, then name order
    assert p._index == {} and "r1" not in p._held
    p.record(A, "r1")  # 4 blocks
    p.record(B, "r2")  # 4 more: the capacity of 6 drops A's two oldest
    assert len(p._index) == 6 and p._held == {"r1": 2, "r2": 4}
    assert p.matches(A + "q", ["r1", "r2"]) == {"r1": 0, "r2": 0}  # A's first block is gone: nothing matches
    assert p.matches(B + "q", ["r1", "r2"]) == {"r1": 0, "r2": 4}


def test_the_routing_key_of_each_request_shape():
    assert routing_key({"prompt": "hello"}) == "hello"
    assert routing_key({"prompt": ["first", "second"]}) == "first"
    assert routing_key({"prompt": [5, 6, 7]}) == routing_key({"prompt": [[5, 6, 7], [8]]}) == "5 6 7"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert routing_key(chat) == "<system>be brief<user>hi"
    assert routing_key(None) == routing_key({"prompt": 3}) == ""


def _replica_text(requests: float, hits: float, usage: float, latencies: list[float]) -> str:
    r = CollectorRegistry()
    Counter("servelab:request_success", "done", ["model_name"], registry=r).labels("m").inc(requests)
    Counter("servelab:prefix_cache_hits", "hits", ["model_name"], registry=r).labels("m").inc(hits)
    Gauge("servelab:kv_cache_usage_perc", "usage", ["model_name"], registry=r).labels("m").set(usage)
    Gauge("servelab:num_requests_running", "running", ["model_name"], registry=r).labels("m").set(requests)
    h = Histogram("servelab:e2e_request_latency_seconds", "e2e", ["model_name"], buckets=(1.0, 2.0), registry=r)
    for x in latencies:
        h.labels("m").observe(x)
    return generate_latest(r).decode()


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_of_every_replica_and_their_totals():
    m = ReplicaMetrics()
    m.update({"r1": _replica_text(3, 10, 0.2, [0.5, 1.5]), "r2": _replica_text(5, 30, 0.6, [2.5])})
    s = _samples(m.render())
    m_ = ("model_name", "m")
    assert s[("servelab:request_success_total", (m_, ("replica", "r1")))] == 3
    assert s[("servelab:request_success_total", (m_,))] == 8
    assert s[("servelab:prefix_cache_hits_total", (m_,))] == 40
    assert s[("servelab:kv_cache_usage_perc", (m_,))] == pytest.approx(0.4)  # a share: averaged
    assert s[("servelab:num_requests_running", (m_,))] == 8  # a count: summed
    assert s[("servelab:e2e_request_latency_seconds_bucket", (("le", "1.0"), m_))] == 1
    assert s[("servelab:e2e_request_latency_seconds_bucket", (("le", "2.0"), m_))] == 2
    assert s[("servelab:e2e_request_latency_seconds_count", (m_,))] == 3
    assert s[("servelab:e2e_request_latency_seconds_sum", (m_,))] == pytest.approx(4.5)
    assert not any(name.endswith("_created") for name, _ in s)
    # r2 dies (its last scrape kept in the totals); r3 replaces it; a failed scrape of r1 keeps r1's last
    m.update({"r1": None, "r3": _replica_text(1, 4, 0.1, [0.1])})
    s = _samples(m.render())
    assert s[("servelab:request_success_total", (m_,))] == 3 + 5 + 1  # never backwards
    assert s[("servelab:prefix_cache_hits_total", (m_,))] == 10 + 30 + 4
    assert s[("servelab:num_requests_running", (m_,))] == 3 + 1  # a gauge of the dead is gone
    assert ("servelab:request_success_total", (m_, ("replica", "r2"))) not in s


def test_bench_reads_totals_and_replicas_apart():
    m = ReplicaMetrics()
    m.update({"r1": _replica_text(3, 10, 0.2, []), "r2": _replica_text(5, 30, 0.6, [])})
    models, per_replica = server_state.parse(m.render())
    assert models == {"m": {"requests": 8.0, "prefix_hits": 40.0}}
    assert per_replica == {"r1": {"requests": 3.0, "prefix_hits": 10.0}, "r2": {"requests": 5.0, "prefix_hits": 30.0}}
    before = {"m": {"requests": 2.0, "prefix_hits": 5.0}}
    assert server_state.difference(models, before) == {"m": {"requests": 6.0, "prefix_hits": 35.0}}
    assert server_state.hit_rate({"prefix_queries": 80.0, "prefix_hits": 20.0})["hit_rate"] == 0.25
    first = ReplicaMetrics()
    first.update({"r1": _replica_text(1, 2, 0.2, [])})
    counted, prefix = server_state.run_counts(first.render(), m.render())
    assert counted == {"m": {"requests": 7.0, "prefix_hits": 38.0}} and prefix is None  # no lookups reported


def test_bench_describes_the_replicas_and_the_kill_it_injected():
    m = ReplicaMetrics()
    m.update({"r2": _replica_text(5, 30, 0.6, []), "r3": _replica_text(1, 0, 0.1, [])})
    text = m.render() + 'servelab:replica_failures_total{stage="mid_stream"} 2.0\n'
    killer = server_state.ReplicaKiller("http://unused", 3600)  # never started: the kill is described, not done
    killer.event = {"replica": "r1", "pid": 123, "at": 1000.0}
    at_start = {"router": "prefix", "started": 2, "replicas": [{"id": "r1", "since": 900.0}, {"id": "r2", "since": 901.0}]}
    at_end = {"router": "prefix", "started": 3, "replicas": [{"id": "r2", "since": 901.0}, {"id": "r3", "since": 1009.5}]}
    seen = server_state.replicas_seen(at_start, at_end, text, killer)
    assert seen["at_start"] == ["r1", "r2"] and seen["at_end"] == ["r2", "r3"] and seen["started"] == 3
    assert seen["failures"] == {"mid_stream": 2.0}
    assert seen["kill"] == {"replica": "r1", "pid": 123, "at": 1000.0, "replacement": "r3", "replaced_after_s": 9.5}
    assert seen["per_replica"]["r2"] == {"requests": 5.0, "prefix_hits": 30.0, "queries": 0.0, "hits": 30.0,
                                         "hit_rate": 0.0}


@pytest.mark.parametrize("overrides, message", [
    (["parallel.replicas=0"], "parallel.replicas must be at least 1, got 0"),
    (["parallel.max_replicas=4"], "parallel.min_replicas and parallel.max_replicas are set together"),
    (["parallel.replicas=3", "parallel.min_replicas=1", "parallel.max_replicas=2"],
     "autoscaling needs 1 <= parallel.min_replicas <= parallel.replicas <= parallel.max_replicas, got 1 <= 3 <= 2"),
    (["parallel.replicas=2", "parallel.router=nearest"], "parallel.router='nearest': use prefix, pow2 or a"),
    (["parallel.replica_cpus=0"], "parallel.replica_cpus must be positive, got 0"),
])
def test_replica_settings_fail_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        check_replicas(_parallel(overrides), "serve")


def _parallel(overrides):
    from core.engine.components import engine_config

    return engine_config(compose(overrides)).parallel


def test_replicas_are_for_serve_and_bench_and_need_ray(monkeypatch):
    with pytest.raises(ConfigError, match=r"^parallel.replicas=2 deploys replicas behind `serve` .*`run` drives one"):
        check_replicas(_parallel(["parallel.replicas=2"]), "run")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if ray[serve] were not installed
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    with pytest.raises(ConfigError, match=r"^parallel.replicas=2 runs on Ray Serve, which is not installed: "
                                          r"pip install 'servelab\[ray\]'$"):
        check_replicas(_parallel(["parallel.replicas=2"]), "serve")
    check_replicas(_parallel([]), "serve")  # one replica: plain `serve`, no Ray needed


def test_deployment_options_carry_the_router_and_the_autoscaling_bounds():
    pc = _parallel(["parallel.replicas=2", "parallel.min_replicas=1", "parallel.max_replicas=4",
                    "parallel.target_ongoing_requests=8", "parallel.replica_cpus=0.5", "parallel.router_block_chars=64"])
    opts = replica_options(pc, cuda=False)
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                          "target_ongoing_requests": 8.0}
    assert "num_replicas" not in opts and opts["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0}
    assert opts["request_router_config"] == {"request_router_class": "core.replicas.ray_router.PrefixAffinityRouter",
                                             "request_router_kwargs": {"block_chars": 64, "max_imbalance": 4}}
    unset = replica_options(_parallel(["parallel.replicas=1", "parallel.min_replicas=1", "parallel.max_replicas=2"]),
                            cuda=False)  # the cores are shared by as many replicas as Ray may scale up to
    assert unset["ray_actor_options"]["num_cpus"] == max(1, os.cpu_count() // 2)
    plain = replica_options(_parallel(["parallel.replicas=3", "parallel.router=pow2",
                                       "parallel.tensor_parallel_size=2"]), cuda=True)
    assert plain["num_replicas"] == 3 and "request_router_config" not in plain  # Ray's own power of two choices
    assert plain["ray_actor_options"]["num_gpus"] == 2  # a tensor-parallel replica holds its ranks' devices


# ---- live: two replicas of the tiny model behind the ingress (the last tests: they start Ray) ----


@pytest.fixture(scope="module")
def ray_server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    port = _free_port()
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "core", "serve", f"model.path={tiny_llama}", "model.max_model_len=256",
                              "cache.memory_gb=0.002", "cache.block_size=4", f"server.port={port}",
                              "server.served_model_name=tiny", "parallel.replicas=2", "parallel.router_block_chars=32"],
                             stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready():
        assert p.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{base}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 180, "two replicas' readiness")
    yield base
    p.send_signal(signal.SIGINT)  # as Ctrl-C: Serve and the local Ray instance are taken down
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]


def _per_replica(base: str, series: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^servelab:{series}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = lab.get("replica", "total")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _complete(base: str, prompt: str, **kw) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt, "temperature": 0, **kw}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_ray_replicas_serve_the_engine_s_tokens_and_keep_each_prefix_on_one_replica(ray_server, tiny_llama):
    from core.engine.components import engine_config
    from core.engine.engine import Engine
    from core.engine.types import SamplingParams

    engine = Engine(engine_config(compose([f"model.path={tiny_llama}", "model.max_model_len=256"])))
    want = engine.generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    got = _complete(ray_server, "Hello there", max_tokens=8, ignore_eos=True)
    assert got["choices"][0]["text"] == want.outputs[0].text  # greedy through the ingress and a replica = the engine itself

    before = _per_replica(ray_server, "request_success_total")
    system_a, system_b = "You are a terse assistant. " * 6, "Answer in French, politely. " * 6  # 162, 168 chars
    for i in range(4):  # one at a time: equal load, so the prefix alone decides
        _complete(ray_server, system_a + f"question {i}?", max_tokens=2)
        _complete(ray_server, system_b + f"question {i}?", max_tokens=2)
    after = _per_replica(ray_server, "request_success_total")
    served = sorted(after[r] - before.get(r, 0) for r in after if r != "total")
    assert served == [4, 4]  # each system prompt stayed on one replica, and they went to different ones
    hits = _per_replica(ray_server, "prefix_cache_hits_total")
    assert all(hits[r] >= 3 * 160 for r in hits if r != "total")  # 3 of each 4 found their 160-token prefix cached
    assert hits["total"] == sum(v for r, v in hits.items() if r != "total")  # the totals are the replicas' sum
    models = httpx.get(f"{ray_server}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    bad = httpx.post(f"{ray_server}/v1/completions", json={"model": "tiny", "prompt": ""}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"  # the replica's own validation


def test_ray_a_killed_replica_fails_its_streams_counted_and_is_replaced(ray_server):
    listed = httpx.get(f"{ray_server}/v1/replicas", timeout=10).json()
    assert listed["started"] == 2 and len(listed["replicas"]) == 2
    pids = {r["id"]: r["pid"] for r in listed["replicas"]}
    done_before = _per_replica(ray_server, "request_success_total")["total"]

    def stream(i):  # a long answer on one replica (same prefix): the kill lands mid-stream
        with httpx.stream("POST", f"{ray_server}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "The same long story, told again. " * 2 + str(i), "max_tokens": 180,
                "ignore_eos": True, "temperature": 0, "stream": True}) as r:
            return [line for line in r.iter_lines() if line]

    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        running = wait_until(lambda: {r: v for r, v in _per_replica(ray_server, "num_requests_running").items()
                                      if r != "total" and v == 4}, what="the four streams running on one replica")
        (victim,) = running  # one shared 2-block prefix: all four on the replica that holds it
        os.kill(pids[victim], signal.SIGKILL)
        lines = [f.result() for f in futures]
    for got in lines:
        assert "replica serving this stream died" in got[-1] and got[-1] != "data: [DONE]"
    failed = re.search(r'^servelab:replica_failures_total\{stage="mid_stream"\} (\S+)$',
                       httpx.get(f"{ray_server}/metrics", timeout=10).text, re.M)
    assert float(failed.group(1)) == 4

    def replaced():
        now = httpx.get(f"{ray_server}/v1/replicas", timeout=10).json()
        return now if now["started"] == 3 and len(now["replicas"]) == 2 else None

    now = wait_until(replaced, what="Ray's replacement replica")
    assert victim not in {r["id"] for r in now["replicas"]}
    _complete(ray_server, "after the kill", max_tokens=4)
    totals = _per_replica(ray_server, "request_success_total")["total"]
    assert totals >= done_before + 1  # the dead replica's count is kept: totals never go backwards
