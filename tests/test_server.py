"""The OpenAI-compatible server, live in a subprocess, driven by the official `openai` client."""

import concurrent.futures as cf
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def start_server(tiny_llama):
    procs = []

    def start(*overrides):
        port = _free_port()
        p = subprocess.Popen([sys.executable, "-m", "core", "serve", f"model.path={tiny_llama}",
                              "model.max_model_len=256", "cache.memory_gb=0.002", "cache.block_size=4",
                              f"server.port={port}", *overrides],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(p)
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    return base
            except httpx.HTTPError:
                pass
            assert p.poll() is None, p.stdout.read().decode()
            time.sleep(0.1)
        raise AssertionError("server did not become ready")

    yield start
    for p in procs:
        p.terminate()
        p.wait(timeout=10)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("server.max_queue=256")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def _metric(base, name):
    text = httpx.get(f"{base}/metrics").text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_completions_and_chat_with_and_without_streaming(client):
    assert client.models.list().data[0].id
    r = client.completions.create(model="m", prompt="hello", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 5
    # keys are token strings: byte tokens that decode alike can share one (as in vLLM)
    assert len(c.logprobs.token_logprobs) == 5 and all(1 <= len(t) <= 2 for t in c.logprobs.top_logprobs)
    stream = client.completions.create(model="m", prompt="hello", max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream) == c.text  # the same greedy text, streamed
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=3, temperature=1.0, seed=1, logprobs=True, top_logprobs=1)
    assert len(chat.choices) == 3 and chat.usage.completion_tokens == sum(
        len(ch.logprobs.content) for ch in chat.choices)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stop_strings_and_token_id_prompts(client):
    full = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:6]
    cut = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    batch = client.completions.create(model="m", prompt=["a", "bb"], max_tokens=2, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]


def test_over_long_input_is_a_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=[1] * 300, max_tokens=2)
    assert "300 tokens" in str(e.value) and "limit is 255" in str(e.value)


def test_many_concurrent_clients_all_complete_and_blocks_return(server, client):
    def one(i):
        r = client.completions.create(model="m", prompt=[10 + i % 50, 7, 8], max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        return i, r.choices[0].text

    single = {i % 50: client.completions.create(model="m", prompt=[10 + i % 50, 7, 8], max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True}).choices[0].text for i in range(4)}
    with cf.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert len(results) == 64
    for i, text in results:
        if i % 50 in single:
            assert text == single[i % 50]  # batched greedy output equals the lone one
    assert httpx.get(f"{server}/health").status_code == 200
    total = _metric(server, "servelab:kv_cache_total_blocks")
    assert _metric(server, "servelab:kv_cache_free_blocks") == total


def test_client_disconnect_mid_stream_frees_the_blocks(server):
    total = _metric(server, "servelab:kv_cache_total_blocks")
    aborted = 'servelab:request_success_total{finished_reason="abort",model_name="smollm2-135m"}'
    before = _metric(server, aborted) or 0.0
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{server}/v1/completions", json={
                "model": "m", "prompt": "x" * 10, "max_tokens": 240, "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # one chunk, then hang up
    for _ in range(100):  # the request is aborted (not finished) and its blocks come back
        if (_metric(server, aborted) or 0) > before and _metric(server, "servelab:kv_cache_free_blocks") == total:
            break
        time.sleep(0.05)
    assert _metric(server, aborted) == before + 1
    assert _metric(server, "servelab:kv_cache_free_blocks") == total


def test_guard_rails(start_server):
    base = start_server("server.api_keys=[secret]", "server.max_queue=2", "server.max_body_bytes=2000",
                        "server.degrade_waiting_high=3", "server.degrade_waiting_low=0", "server.degrade_kv_low=1.0",
                        "server.degrade_max_input_tokens=8")
    r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    auth = {"Authorization": "Bearer secret"}
    assert httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x" * 5000}, headers=auth).status_code == 413
    ok = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200

    def long_request(_):
        return httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 120,
                                                          "ignore_eos": True}, headers=auth, timeout=120)

    with cf.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(long_request, i) for i in range(12)]
        time.sleep(0.3)
        statuses = [f.result() for f in futures]
    codes = [s.status_code for s in statuses]
    assert 429 in codes and 200 in codes
    busy = next(s for s in statuses if s.status_code == 429)
    assert busy.headers["retry-after"] == "2" and busy.json()["error"]["type"] == "rate_limit_error"
    text = httpx.get(f"{base}/metrics").text
    assert 'reason="queue_full"' in text and 'reason="unauthorized"' in text and 'reason="body_too_large"' in text


def test_degradation_switch_turns_on_under_overload_and_off_again(start_server):
    base = start_server("server.max_queue=100", "server.degrade_waiting_high=4", "server.degrade_waiting_low=0",
                        "server.degrade_kv_low=1.0", "server.degrade_max_input_tokens=8", "scheduler.max_num_seqs=2",
                        'server.fallback=["quant=int8"]')
    assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["smollm2-135m", "smollm2-135m:fallback"]

    def long_request(_):
        return httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 60,
                                                          "ignore_eos": True}, timeout=120)

    with cf.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(long_request, i) for i in range(10)]
        seen_on, limited = False, None
        for _ in range(200):
            if _metric(base, "servelab:degraded") == 1.0:
                seen_on = True
                limited = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x" * 20, "max_tokens": 1})
                routed = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2},
                                    timeout=60)
                break
            time.sleep(0.02)
        [f.result() for f in futures]
    assert seen_on and limited.status_code == 400 and "lowered while the server is overloaded" in limited.text
    assert routed.status_code == 200 and routed.json()["model"] == "smollm2-135m:fallback"  # the quantized fallback
    assert _metric(base, "servelab:requests_routed_to_fallback_total") >= 1
    for _ in range(50):
        if _metric(base, "servelab:degraded") == 0.0:
            break
        time.sleep(0.05)
    assert _metric(base, "servelab:degraded") == 0.0


def test_grafana_dashboard_reads_only_metrics_the_server_exports(server):
    import json
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "servelab-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    def base(name):
        return re.sub(r"_(bucket|total)$", "", name)

    used = {base(m) for e in exprs for m in re.findall(r"servelab:[a-z0-9_]+", e)}
    exported = {base(m) for m in re.findall(r"^# TYPE (servelab:[a-z0-9_]+) ", httpx.get(f"{server}/metrics").text, re.M)}
    assert used and used <= exported, used - exported
    titles = " ".join(p["title"] for p in dash["panels"])
    for needed in ("TTFT", "TPOT", "Throughput", "KV-cache", "Queue", "Rejections"):
        assert needed in titles


def test_schemathesis_finds_no_server_error(server, tmp_path):
    import shutil

    cli = shutil.which("schemathesis") or shutil.which("st")
    if cli is None:
        pytest.skip("schemathesis is not installed")
    r = subprocess.run([cli, "run", f"{server}/openapi.json", "--checks", "not_a_server_error", "-n", "25",
                        "--request-timeout", "60", "--generation-deterministic"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache stays out of the repo
    assert r.returncode == 0, r.stdout[-3000:]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # and the server is still up


def test_agent_and_chat_pools(server):
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{server}/v1/completions", json=body, headers={"X-Servelab-Pool": "agent"}).status_code == 200
    r = httpx.post(f"{server}/v1/completions", json=body, headers={"X-Servelab-Pool": "batch"})
    assert r.status_code == 400 and "unknown pool 'batch'; pools: chat, agent" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json={"model": "m", "prompt": "hi", "temperature": -1})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_request_timeout_aborts_and_answers_504(start_server):
    base = start_server("server.request_timeout_s=0.05", "scheduler.max_num_batched_tokens=2")
    total = _metric(base, "servelab:kv_cache_total_blocks")
    r = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x" * 200, "max_tokens": 200,
                                                   "ignore_eos": True}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    for _ in range(100):
        if _metric(base, "servelab:kv_cache_free_blocks") == total:
            break
        time.sleep(0.05)
    assert _metric(base, "servelab:kv_cache_free_blocks") == total
    assert 'reason="timeout"' in httpx.get(f"{base}/metrics").text
