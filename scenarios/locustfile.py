"""Locust users that replay a servelab scenario against any OpenAI-compatible server.

Run by `python -m core bench` in its own process (locust patches the process with gevent). The
scenario comes from the JSON file named by SERVELAB_SCENARIO: the requests (prompt text and
forced output length, drawn from the same workload definitions as `run`), the endpoint, model
name(s), API key, pacing and, for agents, the conversation shape. Each user writes one JSON line
per request to SERVELAB_RECORDS.<pid>: servelab's one record schema (core.engine.records), timed
from SERVELAB_ORIGIN (the bench's perf_counter at launch: CLOCK_MONOTONIC, shared by every process
on the machine). Locust's own timer stops at the response headers, so the request event is fired
here, with the end-to-end time.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time

import gevent
from locust import HttpUser, events, task

from core.engine.records import make_record

SPEC = json.loads(open(os.environ["SERVELAB_SCENARIO"]).read())
ORIGIN = float(os.environ.get("SERVELAB_ORIGIN", "0"))
RECORDS = open(f"{os.environ['SERVELAB_RECORDS']}.{os.getpid()}", "a", buffering=1)
_next_request = itertools.count()
_done = itertools.count(1)  # tasks (requests, or agent tasks) completed in this process


def _payload(prompt: str, output_len: int, model: str, messages: list | None = None) -> dict:
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if SPEC.get("ignore_eos", True):
        body["ignore_eos"] = True  # vLLM, SGLang and servelab accept it; turn off for servers that refuse it
    if SPEC.get("slo"):  # servelab's extra fields: the workload's targets (other servers ignore them)
        body.update(SPEC["slo"])
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    return body


class ServelabUser(HttpUser):
    """Streams requests and times them from the client's side."""

    def wait_time(self):
        rate = SPEC.get("rate_per_user")
        if not rate:
            return 0.0
        if SPEC.get("burstiness", 1.0) != 1.0:  # gamma gaps with the given coefficient of variation
            shape = 1.0 / SPEC["burstiness"] ** 2
            return random.gammavariate(shape, 1.0 / (rate * shape))
        return random.expovariate(rate)  # Poisson arrivals per user

    def on_start(self):
        key = SPEC.get("api_key")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    def _stream(self, body: dict, chat: bool, name: str) -> dict:
        """One streamed request; returns its record (error set on failure)."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        start = time.perf_counter()
        times, text, usage, error, status, finish = [], [], None, None, None, None
        try:
            with self.client.post(path, json=body, stream=True, catch_response=True, name=name,
                                  timeout=SPEC.get("timeout_s", 600)) as resp:
                status = resp.status_code
                if status != 200:
                    error = f"HTTP {status}: {resp.text[:200]}"
                    resp.failure(error)
                else:
                    for raw in resp.iter_lines():
                        line = raw.decode() if isinstance(raw, bytes) else raw
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if chunk.get("error"):  # an error after the headers, e.g. the server's timeout
                            err = chunk["error"]
                            error = f"{err.get('type', 'error')}: {err.get('message', '')}"
                            resp.failure(error)
                            break
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for c in chunk.get("choices", []):
                            finish = c.get("finish_reason") or finish
                            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                            if piece:
                                times.append(time.perf_counter())
                                text.append(piece)
                    if error is None:
                        resp.success()
        except Exception as e:  # connection errors and timeouts: recorded, never fatal to the user
            error = f"{type(e).__name__}: {e}"
        end = time.perf_counter()
        n_out = (usage or {}).get("completion_tokens") or len(times)
        record = make_record(
            name, arrival=start, token_times=times, finished=end, num_output_tokens=n_out if not error else 0,
            num_prompt_tokens=(usage or {}).get("prompt_tokens", 0), origin=ORIGIN, error=error,
            model=body.get("model"), finish_reason=finish,
        ).to_dict()
        # locust's own timer stops at the headers: report the end-to-end time instead
        events.request.fire(request_type="POST", name=f"{name} e2e", response_time=(end - start) * 1000,
                            response_length=n_out, exception=error, context={})
        RECORDS.write(json.dumps(record) + "\n")
        return record

    @task
    def one(self):
        reqs = SPEC["requests"]
        limit = SPEC.get("max_requests") or 0
        i = next(_next_request)
        if limit and i >= limit:
            time.sleep(0.05)  # this user is done; the last task to finish ends the run
            return
        r = reqs[i % len(reqs)]
        if SPEC.get("agent"):
            self._agent(r)
        else:
            self._stream(_payload(r["prompt"], r["output_len"], SPEC["model"]), False, SPEC.get("name", "request"))
        if limit and next(_done) >= limit and self.environment.runner is not None:
            # every task issued has finished: stop before the time limit (from a greenlet of its own: quit()
            # stops the users, this one included, before it would stop the runner)
            gevent.spawn_later(1.0, self.environment.runner.quit)  # after the last events reach the stats

    def _agent(self, r: dict) -> None:
        """A task of many calls: the context grows every turn, with think time between calls; a
        failed call is retried, and a timed-out one falls back to the second model name."""
        a = SPEC["agent"]
        messages = [{"role": "system", "content": a.get("system", "You are an agent that uses tools.")},
                    {"role": "user", "content": r["prompt"]}]
        for turn in range(a.get("calls_per_task", 4)):
            model, rec = SPEC["model"], None
            for attempt in range(a.get("retries", 2) + 1):
                body = _payload("", r["output_len"], model, messages)
                rec = self._stream(body, True, f"agent turn {turn}")
                if not rec["error"]:
                    break
                if "timeout" in (rec["error"] or "").lower() and a.get("fallback_model"):
                    model = a["fallback_model"]  # the seed's advice: fall back to a smaller model on timeout
                time.sleep(a.get("retry_backoff_s", 0.2) * (attempt + 1))
            if rec is None or rec["error"]:
                return
            messages.append({"role": "assistant", "content": f"[tool call {turn}]"})
            messages.append({"role": "user", "content": f"Tool result {turn}: " + r["prompt"][: a.get("tool_result_chars", 200)]})
            time.sleep(random.uniform(*a.get("think_time_s", [0.05, 0.2])))
