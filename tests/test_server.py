"""The OpenAI-compatible server, live in a subprocess, driven by the official `openai` client and httpx."""

import concurrent.futures as cf
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float = 120.0, what: str = "condition"):
    """Poll `cond` until it holds; the timeout only catches a hang, it is no deadline to meet."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} never held within {timeout:.0f} s")


@pytest.fixture(scope="module")
def start_server(tiny_llama):
    procs = []

    def start(*overrides):
        port = _free_port()
        p = subprocess.Popen([sys.executable, "-m", "core", "serve", f"model.path={tiny_llama}",
                              "model.max_model_len=256", "cache.memory_gb=0.002", "cache.block_size=4",
                              f"server.port={port}", f"server.served_model_name={MODEL}", *overrides],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append(p)
        base = f"http://127.0.0.1:{port}"

        def ready():
            assert p.poll() is None, p.stdout.read().decode()
            try:
                return httpx.get(f"{base}/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, what="the server's readiness")
        return base

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


def _metric(base, name, **labels):
    text = httpx.get(f"{base}/metrics").text
    for m in re.finditer(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_completions_and_chat_with_and_without_streaming(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 5
    # keys are token strings: byte tokens that decode alike can share one (as in vLLM)
    assert len(c.logprobs.token_logprobs) == 5 and all(1 <= len(t) <= 2 for t in c.logprobs.top_logprobs)
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream) == c.text  # the same greedy text, streamed
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          n=3, temperature=1.0, seed=1, logprobs=True, top_logprobs=1)
    assert len(chat.choices) == 3 and chat.usage.completion_tokens == sum(
        len(ch.logprobs.content) for ch in chat.choices)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    assert chunks[-2].choices[0].finish_reason == "length"


def _streamed(client, **kw):
    texts, logprobs, reasons = {}, {}, {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs:
                logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return texts, logprobs, reasons


@pytest.mark.parametrize("n, ignore_eos", [(1, True), (3, True), (2, False)])
def test_streamed_output_is_the_non_streamed_output(client, n, ignore_eos):
    """With stop strings cut across tokens, n > 1, logprobs, and EOS: the same text, token for token."""
    base = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=40, temperature=0.8, seed=3, n=n, logprobs=1,
                extra_body={"ignore_eos": ignore_eos})
    plain = client.completions.create(**base).choices
    stops = [plain[0].text[6:9] or "zz", "\n\n"]
    for kw in (base, {**base, "stop": stops}):
        full = {c.index: c for c in client.completions.create(**kw).choices}
        texts, logprobs, reasons = _streamed(client, **kw)
        assert texts == {i: c.text for i, c in full.items()}
        assert reasons == {i: c.finish_reason for i, c in full.items()}
        assert logprobs == {i: c.logprobs.token_logprobs for i, c in full.items()}
        if "stop" in kw:
            assert not any(s in t for t in texts.values() for s in stops)


def test_a_speculative_server_streams_the_plain_tokens(start_server, client):
    """decoder=speculative behind the server: greedy text streamed and not, with a stop string
    inside an accepted run, equal to the plain server's; its drafts counted in /metrics."""
    spec = start_server("decoder=speculative", "decoder.method=self", "decoder.draft_layers=1",
                        "decoder.disable_by_batch_size=0")
    sc = openai.OpenAI(base_url=f"{spec}/v1", api_key="unused")
    base = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(**base).choices[0].text
    stop = want[10:13]
    for kw, expect in ((base, want), ({**base, "stop": [stop]}, want[: want.index(stop)])):
        full = sc.completions.create(**kw).choices[0]
        texts, _, _ = _streamed(sc, **kw)
        assert full.text == texts[0] == expect
    drafts = _metric(spec, "servelab:spec_decode_num_draft_tokens_total", model_name=MODEL)
    accepted = _metric(spec, "servelab:spec_decode_num_accepted_tokens_total", model_name=MODEL)
    assert drafts > 0 and 0 <= accepted <= drafts


def test_stop_strings_and_token_id_prompts(client):
    full = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[4:6]
    cut = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    batch = client.completions.create(model=MODEL, prompt=["a", "bb"], max_tokens=2, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]


BAD_REQUESTS = [  # (endpoint, body or raw bytes, status, param, words in the message)
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("completions", {"prompt": "hi", "n": 17}, 400, "n", "less than or equal to 16"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ("completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("completions", {"prompt": "hi", "seed": -1}, 400, "seed", "greater than or equal to 0"),
    ("completions", {"prompt": ""}, 400, "prompt", "non-empty"),
    ("completions", {"prompt": []}, 400, "prompt", "non-empty"),
    ("completions", {"prompt": [[]]}, 400, "prompt", "non-empty"),
    ("completions", {"prompt": [99999]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"max_tokens": 2}, 400, "prompt", "Field required"),
    ("completions", {"prompt": "hi", "model": "nope"}, 404, "model", "does not exist"),
    ("completions", b'{"prompt": "hi",', 400, None, "invalid JSON"),
    ("completions", b"\xff\xfe", 400, None, "invalid JSON"),
    ("completions", b"[1, 2]", 400, None, "must be a JSON object"),
    ("chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "greater than or equal to 1"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", "less than or equal to 20"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role", "Field required"),
]


@pytest.mark.parametrize("endpoint, body, status, param, words", BAD_REQUESTS)
def test_bad_requests_are_refused_naming_the_parameter(server, endpoint, body, status, param, words):
    url = f"{server}/v1/{endpoint}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json={"model": MODEL, **body} if "model" not in body else body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    if status == 404:
        assert err["code"] == "model_not_found"


def test_over_long_input_is_a_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1] * 300, max_tokens=2)
    assert "300 tokens" in str(e.value) and "limit is 255" in str(e.value)


def test_many_concurrent_clients_all_complete_and_blocks_return(server, client):
    def one(i):
        r = client.completions.create(model=MODEL, prompt=[10 + i % 50, 7, 8], max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        return i, r.choices[0].text

    single = {i % 50: client.completions.create(model=MODEL, prompt=[10 + i % 50, 7, 8], max_tokens=8, temperature=0,
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


def test_client_disconnect_is_counted_and_frees_blocks_with_the_server_idle(server):
    total = _metric(server, "servelab:kv_cache_total_blocks")
    aborted = ("servelab:request_success_total", {"finished_reason": "abort", "model_name": MODEL})
    before = _metric(server, aborted[0], **aborted[1]) or 0.0
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", f"{server}/v1/completions", json={
                "model": MODEL, "prompt": "x" * 10, "max_tokens": 240, "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # one chunk, then hang up
    # no other request comes: the scrape alone must show the abort, the blocks back and nothing running
    wait_until(lambda: _metric(server, aborted[0], **aborted[1]) == before + 1, what="the abort counted")
    assert _metric(server, "servelab:kv_cache_free_blocks") == total
    assert _metric(server, "servelab:num_requests_running", model_name=MODEL) == 0


def test_guard_rails(start_server):
    # one running sequence at a time, so the other long requests wait, whatever the step budget
    base = start_server("server.api_keys=[secret]", "server.max_queue=2", "server.max_body_bytes=2000",
                        "server.degrade_enabled=false", "scheduler.max_num_seqs=1")
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{base}/v1/models").status_code == 401
    auth = {"Authorization": "Bearer secret"}
    assert httpx.get(f"{base}/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
    assert httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x" * 5000},
                      headers=auth).status_code == 413
    ok = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200

    def long_request(_):
        return httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 120,
                                                          "ignore_eos": True}, headers=auth, timeout=120)

    with cf.ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(long_request, range(12)))
    codes = [s.status_code for s in statuses]
    assert 429 in codes and 200 in codes
    busy = next(s for s in statuses if s.status_code == 429)
    assert busy.headers["retry-after"] == "2" and busy.json()["error"]["type"] == "rate_limit_error"
    text = httpx.get(f"{base}/metrics").text
    assert 'reason="queue_full"' in text and 'reason="unauthorized"' in text and 'reason="body_too_large"' in text


def test_shedding_refuses_late_requests_with_429_and_pool_targets_apply(start_server):
    base = start_server("scheduler=slo", "server.shed=true", "server.pool_slo={agent:{ttft_s:0.000001}}")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 12, "ignore_eos": True}
    for _ in range(2):  # the engine's step-cost model learns from these steps
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
    late = httpx.post(f"{base}/v1/completions", json={**body, "slo_ttft_s": 1e-6})
    assert late.status_code == 429 and late.json()["error"]["type"] == "rate_limit_error"
    assert int(late.headers["retry-after"]) >= 1 and "TTFT target" in late.json()["error"]["message"]
    assert httpx.post(f"{base}/v1/completions", json={**body, "slo_ttft_s": 600}, timeout=60).status_code == 200
    pool = {"X-Servelab-Pool": "agent"}  # the pool's default target is impossible; the request's own wins
    assert httpx.post(f"{base}/v1/completions", json=body, headers=pool).status_code == 429
    assert httpx.post(f"{base}/v1/completions", json={**body, "slo_ttft_s": 600}, headers=pool,
                      timeout=60).status_code == 200
    assert _metric(base, "servelab:request_rejected_total", model_name=MODEL, reason="deadline") == 2.0
    bad = httpx.post(f"{base}/v1/completions", json={**body, "slo_tpot_s": -1})
    assert bad.status_code == 400 and "slo_tpot_s" in bad.text


def test_degradation_switch_turns_on_under_overload_and_off_again(start_server):
    base = start_server("server.max_queue=100", "server.degrade_waiting_high=4", "server.degrade_waiting_low=0",
                        "server.degrade_kv_low=0.95", "server.degrade_max_input_tokens=8", "scheduler.max_num_seqs=2",
                        'server.models={backup:["quant=int8"]}', "server.fallback=backup")
    assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == [MODEL, "backup"]

    # The overload is held open by the test, not raced against: 30 long requests on raw sockets
    # that are never read stay queued until their sockets close (the server aborts a request
    # whose client is gone), however slow the machine.
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True}).encode()
    host, port = base.removeprefix("http://").split(":")
    held = []
    try:
        for _ in range(30):
            s = socket.create_connection((host, int(port)))
            held.append(s)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        wait_until(lambda: _metric(base, "servelab:degraded", model_name=MODEL) == 1.0, what="degradation on")
        limited = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x" * 20, "max_tokens": 1})
        routed = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
    finally:
        for s in held:
            s.close()
    assert limited.status_code == 400 and "lowered while the server is overloaded" in limited.text
    assert routed.status_code == 200 and routed.json()["model"] == "backup"  # the quantized fallback
    assert _metric(base, "servelab:requests_routed_to_fallback_total", model_name=MODEL) >= 1
    # the fallback's work is counted as its own, not the main model's
    assert _metric(base, "servelab:request_success_total", model_name="backup", finished_reason="length") >= 1
    wait_until(lambda: _metric(base, "servelab:degraded", model_name=MODEL) == 0.0, what="degradation off")


def test_several_models_in_one_server_are_routed_by_name_and_pool(start_server):
    base = start_server('server.models={int8:["quant=int8"]}', "server.pools.agent=int8")
    assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == [MODEL, "int8"]
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    for name in (MODEL, "int8", "int8"):
        assert httpx.post(f"{base}/v1/completions", json={**body, "model": name}).json()["model"] == name
    pooled = httpx.post(f"{base}/v1/completions", json={**body, "model": MODEL}, headers={"X-Servelab-Pool": "agent"})
    assert pooled.json()["model"] == "int8"  # the agent pool is a model of its own
    ok = {"finished_reason": "length"}
    # each model's warm-up, then: two named int8 and one pooled there, one named the main model
    assert _metric(base, "servelab:request_success_total", model_name="int8", **ok) == 1 + 3
    assert _metric(base, "servelab:request_success_total", model_name=MODEL, **ok) == 1 + 1
    assert _metric(base, "servelab:generation_tokens_total", model_name="int8") == 2 + 3 * 3


def test_grafana_dashboard_reads_only_metrics_the_server_exports(server):
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "servelab-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]

    def base(name):
        return re.sub(r"_(bucket|total)$", "", name)

    used = {base(m) for e in exprs for m in re.findall(r"servelab:[a-z0-9_]+", e)}
    exported = {base(m) for m in re.findall(r"^# TYPE (servelab:[a-z0-9_]+) ", httpx.get(f"{server}/metrics").text, re.M)}
    assert used and used <= exported, used - exported
    assert all('model_name=~"$model"' in e for e in exprs)  # the model selector filters every panel
    titles = " ".join(p["title"] for p in dash["panels"])
    for needed in ("TTFT", "TPOT", "Throughput", "KV-cache", "Queue", "Rejections"):
        assert needed in titles


def test_schemathesis_finds_no_server_error(server, tmp_path):
    cli = shutil.which("schemathesis") or shutil.which("st") or str(
        __import__("pathlib").Path(sys.executable).parent / "schemathesis")
    r = subprocess.run([cli, "run", f"{server}/openapi.json", "--checks", "not_a_server_error", "-n", "25",
                        "--request-timeout", "60", "--generation-deterministic"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache stays out of the repo
    assert r.returncode == 0, r.stdout[-3000:]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # and the server is still up


def test_agent_and_chat_pools(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{server}/v1/completions", json=body, headers={"X-Servelab-Pool": "agent"}).status_code == 200
    r = httpx.post(f"{server}/v1/completions", json=body, headers={"X-Servelab-Pool": "batch"})
    assert r.status_code == 400 and "unknown pool 'batch'; pools: chat, agent" in r.json()["error"]["message"]


def test_request_timeout_aborts_and_answers_504(start_server):
    base = start_server("server.request_timeout_s=0.05", "scheduler.max_num_batched_tokens=2")
    total = _metric(base, "servelab:kv_cache_total_blocks")
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x" * 200, "max_tokens": 200,
                                                   "ignore_eos": True}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    wait_until(lambda: _metric(base, "servelab:kv_cache_free_blocks") == total, what="the blocks back")
    assert 'reason="timeout"' in httpx.get(f"{base}/metrics").text


def test_a_gone_client_is_noticed_while_its_request_streams_outputs():
    """A running request puts an output on its queue every step, so no wait for one ever times out;
    the gone client must still be noticed (and the request aborted) within half a second."""
    import asyncio

    from core.engine.types import SamplingParams
    from core.server.handler import Call, Server

    server = Server.__new__(Server)  # _next needs no engines: a constructed call and queue

    async def drive(gone_after: int) -> tuple[int, int]:
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(1000):
            queue.put_nowait((0, f"output {i}"))
        call = Call(False, SamplingParams(), None, MODEL, ["r"], queue, "cmpl-x", 0, time.monotonic() + 60)
        looks = 0

        async def is_disconnected():
            nonlocal looks
            looks += 1
            return looks > gone_after

        taken = 0
        try:
            while True:
                await server._next(call, is_disconnected)
                taken += 1
                if taken == 200:
                    call.next_disconnect_check = 0.0  # as if half a second had passed
        except asyncio.CancelledError:
            return taken, looks

    # the first look finds the client there; outputs flow without a look per output (200 taken
    # on one look); the next look, due, finds it gone
    assert asyncio.run(drive(gone_after=1)) == (200, 2)
    assert asyncio.run(drive(gone_after=0)) == (0, 1)  # gone before any output
