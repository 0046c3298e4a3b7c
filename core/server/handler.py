"""Serving one HTTP request: typed body -> engine request(s) -> a response or an SSE stream.

A request with several prompts becomes several engine requests whose outputs all arrive, tagged,
on one asyncio queue, so the handler awaits one queue and never polls.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from core.engine.async_engine import AsyncEngine
from core.engine.engine import Engine
from core.engine.types import RequestOutput, SamplingParams
from core.errors import DeadlineError, RequestError
from core.server import protocol
from core.server.config import ServerConfig
from core.server.guards import Guards, OpenAIError
from core.server.metrics import ServerMetrics
from core.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class Call:
    """One HTTP request in flight: its engine requests share `queue`, tagged by prompt index."""

    chat: bool
    params: SamplingParams
    target: AsyncEngine
    model: str
    rids: list[str]
    queue: asyncio.Queue
    id: str
    created: int
    deadline: float
    next_disconnect_check: float = 0.0  # monotonic time of the next look for a gone client


class Server:
    """One process, one or more served models, each its own engine (thread) and KV pool."""

    def __init__(self, engines: dict[str, Engine], cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.main = next(iter(engines))  # the first is the main model: requests that name none get it
        self.metrics = ServerMetrics()
        self.engines: dict[str, AsyncEngine] = {}
        for name, engine in engines.items():
            engine.name = name  # what its observer listens for
            engine.registry.pm.register(self.metrics.observer(name))
            self.engines[name] = AsyncEngine(engine)
        self.guards = Guards(cfg, self.metrics, self.main)
        self.ready = False

    @property
    def engine(self) -> Engine:
        return self.engines[self.main].engine

    def failed_engines(self) -> dict[str, str]:
        """Served name -> the error that stopped its engine, for every engine that stopped."""
        return {n: str(e.error) for n, e in self.engines.items() if e.error is not None}

    def model_list(self) -> dict:
        """/v1/models: every served model."""
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "servelab",
                                            "max_model_len": e.engine.max_model_len, "root": e.engine.loaded.source}
                                           for n, e in self.engines.items()]}

    def max_input(self, name: str) -> int:
        return self.cfg.max_input_tokens or self.engines[name].engine.max_model_len - 1

    def observe_load(self) -> None:
        """Live gauges of every engine, and the degradation switch of the main one (called per request
        and per scrape, so an idle server's metrics are current too)."""
        for name, e in self.engines.items():
            stats = e.kv_stats()
            self.metrics.set_live(name, e.engine.scheduler.num_running, e.num_waiting, stats)
            if name == self.main:
                self.guards.degradation.update(e.num_waiting, stats.usage)

    def route(self, requested: str | None, pool: int | str | None) -> str:
        """The served model a request goes to: its pool's model, else the one it names (404 if none
        is served by that name); the main model's requests go to the fallback while degraded."""
        name = pool if isinstance(pool, str) else (requested or self.main)
        if name not in self.engines:
            raise OpenAIError(404, f"The model '{name}' does not exist; served: {', '.join(self.engines)}",
                              param="model", code="model_not_found")
        if name == self.main and self.cfg.fallback and self.guards.degradation.on:
            self.metrics.fallback.labels(self.main).inc()
            return self.cfg.fallback
        return name

    # ---- request handling ----------------------------------------------------------------

    def _prompts(self, req: CompletionRequest | ChatCompletionRequest, tok) -> list[list[int]]:
        if isinstance(req, ChatCompletionRequest):
            if not req.messages:
                raise OpenAIError(400, "messages must be a non-empty list", param="messages")
            try:
                return [tok.encode_chat([{"role": m.role, "content": m.text} for m in req.messages])]
            except RequestError as e:
                raise OpenAIError(400, f"bad messages: {e}", param="messages") from None
        p = req.prompt
        if isinstance(p, str) and p:
            return [tok.encode(p)]
        if p and all(isinstance(x, str) and x for x in p):
            return [tok.encode(x) for x in p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if p and all(isinstance(x, list) and x for x in p):
            return [list(x) for x in p]
        raise OpenAIError(400, "prompt must be a non-empty string, list of strings, or token ids", param="prompt")

    async def start_call(self, req: CompletionRequest | ChatCompletionRequest, headers) -> Call:
        chat = isinstance(req, ChatCompletionRequest)
        self.guards.check_auth(headers, self.main)
        pool = self.guards.pool(headers)
        name = self.route(req.model, pool)
        target = self.engines[name]
        try:
            params = req.params()
        except RequestError as e:
            raise OpenAIError(400, str(e)) from None
        pool_slo = self.cfg.pool_slo.get(headers.get("x-servelab-pool"), {})
        params.slo_ttft_s = params.slo_ttft_s or pool_slo.get("ttft_s")
        params.slo_tpot_s = params.slo_tpot_s or pool_slo.get("tpot_s")
        prompts = self._prompts(req, target.engine.tokenizer)
        self.guards.admit(prompts, target.num_waiting, self.max_input(name), name)
        priority = pool if isinstance(pool, int) else int(req.priority or 0)
        queue: asyncio.Queue = asyncio.Queue()
        rids = []
        for i, ids in enumerate(prompts):
            try:
                rid, _ = await target.add(sink=queue, tag=i, prompt_token_ids=ids, params=params, priority=priority,
                                          shed=self.cfg.shed)
            except DeadlineError as e:  # shed: it would be served late, so it is refused now
                for r in rids:
                    target.abort(r)
                self.metrics.reject(name, "deadline")
                raise OpenAIError(429, str(e), "rate_limit_error", headers={"Retry-After": str(e.retry_after_s)}) from None
            except RequestError as e:
                for r in rids:
                    target.abort(r)
                self.metrics.reject(name, "invalid")
                raise OpenAIError(400, str(e), param="prompt") from None
            rids.append(rid)
        return Call(chat, params, target, name, rids, queue, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                    int(time.time()), time.monotonic() + self.cfg.request_timeout_s)

    async def _next(self, call: Call, is_disconnected: Callable[[], Awaitable[bool]] | None) -> tuple[int, RequestOutput]:
        """The next output of any of the call's engine requests. Times out at the call's deadline.
        A gone client (non-streamed calls) is noticed within half a second, whether the request is
        queued (no outputs) or running (an output every step, so no wait ever times out)."""
        while True:
            now = time.monotonic()
            left = call.deadline - now
            if left <= 0:
                self.metrics.reject(call.model, "timeout")
                raise TimeoutError
            if is_disconnected is not None and now >= call.next_disconnect_check:
                call.next_disconnect_check = now + 0.5
                if await is_disconnected():
                    raise asyncio.CancelledError
            try:
                tag, out = await asyncio.wait_for(call.queue.get(), min(left, 0.5) if is_disconnected else left)
            except TimeoutError:
                continue
            if out is None:
                raise OpenAIError(500, "the engine stopped", "server_error")
            return tag, out

    async def complete(self, call: Call, is_disconnected) -> dict:
        finals: dict[int, RequestOutput] = {}
        try:
            while len(finals) < len(call.rids):
                tag, out = await self._next(call, is_disconnected)
                if out.finished:
                    finals[tag] = out
        except TimeoutError:
            raise OpenAIError(504, f"request timed out after {self.cfg.request_timeout_s:g} s", "timeout_error") from None
        finally:
            for tag, rid in enumerate(call.rids):
                if tag not in finals:  # the client went away or the call failed: free its KV at once
                    call.target.abort(rid)
        return protocol.response([finals[i] for i in range(len(call.rids))], call.params.n,
                                 call.params.logprobs is not None, call.chat, call.id, call.created, call.model,
                                 call.target.engine.tokenizer)

    async def stream(self, call: Call, include_usage: bool) -> AsyncIterator[str]:
        tok, n = call.target.engine.tokenizer, call.params.n
        finals: dict[int, RequestOutput] = {}
        sent_logprobs: dict[tuple, int] = {}

        def chunk(choices, usage=None):
            return protocol.chunk(call.chat, call.id, call.created, call.model, choices, usage)

        try:
            if call.chat:
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in range(n * len(call.rids))])
            while len(finals) < len(call.rids):
                try:
                    tag, out = await self._next(call, None)
                except TimeoutError:
                    yield protocol.sse(protocol.error_body("request timed out", "timeout_error", None, 504))
                    return
                except OpenAIError as e:  # the engine stopped mid-stream
                    yield protocol.sse(protocol.error_body(e.message, e.kind, None, e.code))
                    return
                choices = protocol.delta_choices(out, tag, n, call.chat, tok, call.params.logprobs is not None,
                                                 sent_logprobs)
                if choices:
                    yield chunk(choices)
                if out.finished:
                    finals[tag] = out
            if include_usage:
                yield chunk([], protocol.usage(list(finals.values())))
            yield "data: [DONE]\n\n"
        finally:
            for tag, rid in enumerate(call.rids):
                if tag not in finals:  # the client went away or the stream broke: free its KV at once
                    call.target.abort(rid)
