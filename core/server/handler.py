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
from core.errors import RequestError
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


class Server:
    def __init__(self, engine: Engine, cfg: ServerConfig, fallback: Engine | None = None) -> None:
        self.engine, self.cfg = engine, cfg
        self.model_name = cfg.served_model_name or engine.config.model.name
        self.metrics = ServerMetrics(self.model_name)
        engine.registry.pm.register(self.metrics)
        self.async_engine = AsyncEngine(engine)
        # while degraded, new requests go to the fallback engine (smaller or quantized), if one is configured
        self.fallback = AsyncEngine(fallback) if fallback is not None else None
        self.guards = Guards(cfg, self.metrics, cfg.max_input_tokens or engine.max_model_len - 1)
        self.ready = False

    @property
    def engines(self) -> list[AsyncEngine]:
        return [e for e in (self.async_engine, self.fallback) if e is not None]

    def observe_load(self) -> None:
        """Feed the degradation switch and the pool gauges (called per request and per scrape)."""
        stats = self.async_engine.kv_stats()
        self.guards.degradation.update(self.async_engine.num_waiting, stats.usage)
        self.metrics.set_pool(stats)

    # ---- request handling ----------------------------------------------------------------

    def _prompts(self, req: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        tok = self.engine.tokenizer
        if isinstance(req, ChatCompletionRequest):
            if not req.messages:
                raise OpenAIError(400, "messages must be a non-empty list", param="messages")
            try:
                return [tok.encode_chat([{"role": m.role, "content": m.text} for m in req.messages])]
            except RequestError as e:
                raise OpenAIError(400, f"bad messages: {e}", param="messages") from None
        p = req.prompt
        if isinstance(p, str):
            return [tok.encode(p)]
        if p and all(isinstance(x, str) for x in p):
            return [tok.encode(x) for x in p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        if p and all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
        raise OpenAIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")

    def _target(self) -> tuple[AsyncEngine, str]:
        if self.fallback is not None and self.guards.degradation.on:
            return self.fallback, f"{self.model_name}:fallback"
        return self.async_engine, self.model_name

    async def start_call(self, req: CompletionRequest | ChatCompletionRequest, headers) -> Call:
        chat = isinstance(req, ChatCompletionRequest)
        self.guards.check_auth(headers)
        try:
            params = req.params()
        except RequestError as e:
            raise OpenAIError(400, str(e)) from None
        prompts = self._prompts(req)
        self.guards.admit(prompts, self.async_engine.num_waiting)
        priority = self.guards.priority(req.priority, headers)
        target, model = self._target()
        if target is self.fallback:
            self.metrics.fallback.labels(self.model_name).inc(len(prompts))
        queue: asyncio.Queue = asyncio.Queue()
        rids = []
        for i, ids in enumerate(prompts):
            try:
                rid, _ = await target.add(sink=queue, tag=i, prompt_token_ids=ids, params=params, priority=priority)
            except RequestError as e:
                for r in rids:
                    target.abort(r)
                self.metrics.reject("invalid")
                raise OpenAIError(400, str(e)) from None
            rids.append(rid)
        return Call(chat, params, target, model, rids, queue, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                    int(time.time()), time.monotonic() + self.cfg.request_timeout_s)

    async def _next(self, call: Call, is_disconnected: Callable[[], Awaitable[bool]] | None) -> tuple[int, RequestOutput]:
        """The next output of any of the call's engine requests. Times out at the call's deadline;
        while waiting, a gone client (non-streamed calls) is noticed every half second."""
        while True:
            left = call.deadline - time.monotonic()
            if left <= 0:
                self.metrics.reject("timeout")
                raise TimeoutError
            try:
                tag, out = await asyncio.wait_for(call.queue.get(), min(left, 0.5) if is_disconnected else left)
            except TimeoutError:
                if is_disconnected is not None and await is_disconnected():
                    raise asyncio.CancelledError from None
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
                                 self.engine.tokenizer)

    async def stream(self, call: Call, include_usage: bool) -> AsyncIterator[str]:
        tok, n = self.engine.tokenizer, call.params.n
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
                    yield protocol.sse(protocol.error_body(e.message, e.kind, None, e.status))
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
