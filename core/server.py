"""`python -m core serve`: an OpenAI-compatible HTTP server over the engine, with guard rails.

Endpoints: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health,
/ready (200 only after a warm-up request ran), /metrics (Prometheus). Guard rails, each in
conf/server and each counted in metrics: an input-length limit (400), a bounded waiting queue
(429 + Retry-After), a per-request timeout, abort on client disconnect, API keys (401), a
request-body limit (413), loopback by default, and the degradation switch that lowers the input
limit while the engine is overloaded, with hysteresis. Requests carry a pool (header
`X-Servelab-Pool`, e.g. chat or agent) that maps to a scheduling priority.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from core.async_engine import AsyncEngine
from core.config import section
from core.engine import Engine
from core.errors import RequestError
from core.server_metrics import ServerMetrics
from core.types import RequestOutput, SamplingParams

log = logging.getLogger("servelab")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless asked
    port: int = 8000
    served_model_name: str | None = None
    api_keys: list = field(default_factory=list)
    max_queue: int = 256  # waiting requests before 429
    retry_after_s: int = 2
    max_input_tokens: int | None = None  # None: max_model_len - 1
    request_timeout_s: float = 600.0
    max_body_bytes: int = 1_000_000
    warmup: bool = True
    pools: dict = field(default_factory=lambda: {"chat": 0, "agent": 1})
    degrade_enabled: bool = True
    degrade_waiting_high: int = 64  # switch on at this many waiting, or at this KV usage
    degrade_kv_high: float = 0.95
    degrade_waiting_low: int = 16  # and off again only below both lows (hysteresis)
    degrade_kv_low: float = 0.7
    degrade_max_input_tokens: int = 512
    fallback: list = field(default_factory=list)  # overrides of a fallback engine (e.g. [quant=int4]) used while degraded
    extra: dict[str, Any] = field(default_factory=dict)


class GenerationRequest(BaseModel):
    """Fields both endpoints share (extra fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    ignore_eos: bool = False
    priority: int | None = None


class CompletionRequest(GenerationRequest):
    """The body of /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None


class ChatCompletionRequest(GenerationRequest):
    """The body of /v1/chat/completions."""

    messages: list[dict[str, Any]]  # {"role": ..., "content": str or content parts}
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}


class Degradation:
    """The switch: on when waiting or KV usage crosses its high mark, off below both low marks."""

    def __init__(self, cfg: ServerConfig, metrics: ServerMetrics) -> None:
        self.cfg, self.metrics, self.on = cfg, metrics, False

    def update(self, waiting: int, kv_usage: float) -> None:
        c = self.cfg
        if not c.degrade_enabled:
            return
        if not self.on and (waiting >= c.degrade_waiting_high or kv_usage >= c.degrade_kv_high):
            self.on = True
            log.warning("degradation ON: waiting=%d kv=%.2f; max input tokens now %d", waiting, kv_usage,
                        c.degrade_max_input_tokens)
        elif self.on and waiting <= c.degrade_waiting_low and kv_usage <= c.degrade_kv_low:
            self.on = False
            log.warning("degradation OFF: waiting=%d kv=%.2f", waiting, kv_usage)
        self.metrics.degraded.labels(self.metrics.model_name).set(1 if self.on else 0)


def _usage(out: RequestOutput) -> dict:
    completion = sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
            "total_tokens": len(out.prompt_token_ids) + completion}


def _completion_logprobs(tokenizer, entries: list[dict]) -> dict:
    return {
        "tokens": [tokenizer.decode([e["token_id"]], skip_special_tokens=False) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in e["top"]} for e in entries],
        "text_offset": [],
    }


def _chat_logprobs(tokenizer, entries: list[dict]) -> dict:
    def one(tid, lp):
        tok = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


class Server:
    def __init__(self, engine: Engine, cfg: ServerConfig, fallback: Engine | None = None) -> None:
        self.engine, self.cfg = engine, cfg
        self.model_name = cfg.served_model_name or engine.config.model.name
        self.metrics = ServerMetrics(self.model_name)
        engine.registry.pm.register(self.metrics)
        self.async_engine = AsyncEngine(engine)
        # while degraded, new requests go to the fallback engine (smaller or quantized), if one is configured
        self.fallback = AsyncEngine(fallback) if fallback is not None else None
        self.degradation = Degradation(cfg, self.metrics)
        self.ready = False
        self.max_input = cfg.max_input_tokens or engine.max_model_len - 1

    # ---- request handling ----------------------------------------------------------------

    def _check_auth(self, headers) -> None:
        if not self.cfg.api_keys:
            return
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer ") or auth[7:] not in self.cfg.api_keys:
            self.metrics.reject("unauthorized")
            raise OpenAIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", "authentication_error")

    def _params(self, body: dict, chat: bool) -> SamplingParams:
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = max_tokens or body.get("max_tokens") or 16
        if chat:
            logprobs = body.get("top_logprobs", 0) if body.get("logprobs") else None
        else:
            logprobs = body.get("logprobs")
        stop = body.get("stop") or []
        try:
            return SamplingParams(
                max_tokens=int(max_tokens), temperature=float(body.get("temperature", 1.0) if body.get("temperature")
                                                              is not None else 1.0),
                top_p=float(body.get("top_p") if body.get("top_p") is not None else 1.0),
                top_k=int(body.get("top_k") or 0), seed=body.get("seed"), n=int(body.get("n") or 1),
                stop=[stop] if isinstance(stop, str) else list(stop), ignore_eos=bool(body.get("ignore_eos", False)),
                logprobs=logprobs,
            )
        except (RequestError, TypeError, ValueError) as e:
            raise OpenAIError(400, str(e)) from None

    def _prompt_ids(self, body: dict, chat: bool) -> list[list[int]]:
        tok = self.engine.tokenizer
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise OpenAIError(400, "messages must be a non-empty list", param="messages")
            try:
                return [tok.encode_chat([{"role": m["role"], "content": _content(m)} for m in messages])]
            except (KeyError, TypeError, RequestError) as e:
                raise OpenAIError(400, f"bad messages: {e}", param="messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [tok.encode(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [tok.encode(p) for p in prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
        raise OpenAIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")

    def _admit(self, ids_list: list[list[int]]) -> None:
        limit = min(self.max_input, self.cfg.degrade_max_input_tokens) if self.degradation.on else self.max_input
        for ids in ids_list:
            if len(ids) > limit:
                self.metrics.reject("input_too_long")
                why = " (lowered while the server is overloaded)" if self.degradation.on else ""
                raise OpenAIError(400, f"input has {len(ids)} tokens; the limit is {limit}{why}", param="prompt")
        if self.async_engine.num_waiting + len(ids_list) > self.cfg.max_queue:
            self.metrics.reject("queue_full")
            raise OpenAIError(429, f"the server is busy: {self.async_engine.num_waiting} requests are waiting "
                                   f"(limit {self.cfg.max_queue}); retry later", "rate_limit_error",
                              headers={"Retry-After": str(self.cfg.retry_after_s)})

    def _target(self) -> tuple[AsyncEngine, str]:
        if self.fallback is not None and self.degradation.on:
            return self.fallback, f"{self.model_name}:fallback"
        return self.async_engine, self.model_name

    async def _submit(self, ids: list[int], params: SamplingParams, priority: int, target: AsyncEngine):
        try:
            return await target.add(prompt_token_ids=ids, params=params, priority=priority)
        except RequestError as e:
            self.metrics.reject("invalid")
            raise OpenAIError(400, str(e)) from None

    def _priority(self, body: dict, headers) -> int:
        pool = headers.get("x-servelab-pool")
        if pool is not None:
            if pool not in self.cfg.pools:
                raise OpenAIError(400, f"unknown pool '{pool}'; pools: {', '.join(self.cfg.pools)}")
            return int(self.cfg.pools[pool])
        return int(body.get("priority") or 0)

    async def handle(self, body: dict, headers, chat: bool, is_disconnected):
        """Returns a dict (JSON response) or an async iterator of SSE lines."""
        self._check_auth(headers)
        params = self._params(body, chat)
        ids_list = self._prompt_ids(body, chat)
        if chat and len(ids_list) != 1:
            raise OpenAIError(400, "one conversation per chat request")
        self._admit(ids_list)
        priority = self._priority(body, headers)
        created = int(time.time())
        rid_prefix = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        target, model = self._target()
        if target is self.fallback:
            self.metrics.fallback.labels(self.model_name).inc(len(ids_list))
        subs = [await self._submit(ids, params, priority, target) for ids in ids_list]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._stream(subs, params, chat, rid_prefix, created, include_usage, is_disconnected, target, model)
        finals = await asyncio.gather(*(self._collect(rid, q, is_disconnected, target) for rid, q in subs))
        return self._response(finals, params, chat, rid_prefix, created, model)

    async def _next(self, rid: str, q: asyncio.Queue, deadline: float) -> RequestOutput | None:
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            raise TimeoutError
        return await asyncio.wait_for(q.get(), timeout)

    async def _collect(self, rid: str, q: asyncio.Queue, is_disconnected, target: AsyncEngine) -> RequestOutput:
        deadline = time.monotonic() + self.cfg.request_timeout_s
        try:
            while True:
                try:
                    out = await asyncio.wait_for(q.get(), min(0.5, max(0.01, deadline - time.monotonic())))
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        self.metrics.reject("timeout")
                        raise OpenAIError(504, f"request timed out after {self.cfg.request_timeout_s:g} s",
                                          "timeout_error") from None
                    if await is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                if out is None:
                    raise OpenAIError(500, "the engine stopped", "server_error")
                if out.finished:
                    return out
        except BaseException:
            target.abort(rid)
            raise

    def _response(self, finals: list[RequestOutput], params, chat: bool, rid: str, created: int, model: str) -> dict:
        tok = self.engine.tokenizer
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, out in enumerate(finals):
            for k, v in _usage(out).items():
                usage[k] += v
            for o in out.outputs:
                index = i * params.n + o.index
                lp = None
                if params.logprobs is not None:
                    lp = _chat_logprobs(tok, o.logprobs) if chat else _completion_logprobs(tok, o.logprobs)
                if chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": o.text},
                                    "logprobs": lp, "finish_reason": _reason(o.finish_reason)})
                else:
                    choices.append({"index": index, "text": o.text, "logprobs": lp,
                                    "finish_reason": _reason(o.finish_reason)})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage}

    async def _stream(self, subs, params, chat, rid, created, include_usage, is_disconnected, target, model):
        tok = self.engine.tokenizer
        obj = "chat.completion.chunk" if chat else "text_completion"
        deadline = time.monotonic() + self.cfg.request_timeout_s

        def chunk(choices, usage=None):
            d = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        pending = {r: (i, q) for i, (r, q) in enumerate(subs)}
        finals: dict[str, RequestOutput] = {}
        sent_logprobs: dict[tuple, int] = {}
        try:
            if chat:
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in range(params.n)])
            while pending:
                for r, (i, q) in list(pending.items()):
                    try:
                        out = await self._next(r, q, deadline) if q.qsize() or len(pending) == 1 else q.get_nowait()
                    except asyncio.QueueEmpty:
                        await asyncio.sleep(0.005)
                        continue
                    except TimeoutError:
                        self.metrics.reject("timeout")
                        yield f"data: {json.dumps({'error': {'message': 'request timed out', 'type': 'timeout_error'}})}\n\n"
                        return
                    if out is None:
                        return
                    choices = []
                    for o in out.outputs:
                        text, _ids = out.deltas.get(o.index, ("", []))
                        done = o.finish_reason is not None
                        if not text and not done:
                            continue
                        index = i * params.n + o.index
                        lp = None
                        if params.logprobs is not None:
                            start = sent_logprobs.get((r, o.index), 0)
                            new = o.logprobs[start:]
                            sent_logprobs[(r, o.index)] = len(o.logprobs)
                            lp = _chat_logprobs(tok, new) if chat else _completion_logprobs(tok, new)
                        if chat:
                            choices.append({"index": index, "delta": {"content": text} if text else {},
                                            "logprobs": lp, "finish_reason": _reason(o.finish_reason)})
                        else:
                            choices.append({"index": index, "text": text, "logprobs": lp,
                                            "finish_reason": _reason(o.finish_reason)})
                    if choices:
                        yield chunk(choices)
                    if out.finished:
                        finals[r] = out
                        del pending[r]
            if include_usage:
                usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
                for out in finals.values():
                    for k, v in _usage(out).items():
                        usage[k] += v
                yield chunk([], usage)
            yield "data: [DONE]\n\n"
        finally:
            for r in pending:  # the client went away or the stream broke: free its KV at once
                target.abort(r)


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, reason) if reason else None


def build_app(server: Server):
    app = FastAPI(title="servelab", version="0.1.0")

    def error(e: OpenAIError) -> JSONResponse:
        return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}},
                            status_code=e.status, headers=e.headers)

    engines = [e for e in (server.async_engine, server.fallback) if e is not None]

    @app.on_event("startup")
    async def startup():
        for e in engines:
            e.start(asyncio.get_running_loop())
            if server.cfg.warmup:  # the seed's cold-start lesson: a real request before /ready says yes
                rid, q = await e.add(prompt_token_ids=e.engine.tokenizer.encode("Hello"),
                                     params=SamplingParams(max_tokens=2, ignore_eos=True))
                while not (out := await q.get()) or not out.finished:
                    pass
        server.ready = True

    @app.on_event("shutdown")
    async def shutdown():
        for e in engines:
            e.stop()

    async def body_of(request: Request) -> dict:
        size = int(request.headers.get("content-length") or 0)
        if size > server.cfg.max_body_bytes:
            server.metrics.reject("body_too_large")
            raise OpenAIError(413, f"request body of {size} bytes is over the limit of {server.cfg.max_body_bytes}")
        raw = await request.body()
        if len(raw) > server.cfg.max_body_bytes:
            server.metrics.reject("body_too_large")
            raise OpenAIError(413, f"request body of {len(raw)} bytes is over the limit of {server.cfg.max_body_bytes}")
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:  # bad JSON, or bytes that are not UTF-8
            raise OpenAIError(400, f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object")
        return body

    async def serve(request: Request, chat: bool):
        try:
            body = await body_of(request)
            try:
                (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise OpenAIError(400, f"{where}: {first['msg']}", param=where) from None
            stats = server.engine.allocator.stats()
            server.degradation.update(server.async_engine.num_waiting, stats.usage)
            result = await server.handle(body, request.headers, chat, request.is_disconnected)
        except OpenAIError as e:
            return error(e)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    def body_schema(model: type[BaseModel]) -> dict:
        schema = model.model_json_schema()  # flat: no nested models, so no $refs to resolve
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                "responses": {"400": {"description": "bad request (OpenAI error JSON)"},
                              "401": {"description": "missing or wrong API key"},
                              "413": {"description": "body too large"},
                              "429": {"description": "queue full; see Retry-After"}}}

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            server._check_auth(request.headers)
        except OpenAIError as e:
            return error(e)
        data = [{"id": server.model_name, "object": "model", "created": 0, "owned_by": "servelab",
                 "max_model_len": server.engine.max_model_len}]
        if server.fallback is not None:
            data.append({"id": f"{server.model_name}:fallback", "object": "model", "created": 0, "owned_by": "servelab",
                         "max_model_len": server.fallback.engine.max_model_len})
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        if server.async_engine.error is not None:
            return JSONResponse({"status": "error", "error": str(server.async_engine.error)}, status_code=500)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        return JSONResponse({"ready": server.ready}, status_code=200 if server.ready else 503)

    @app.get("/metrics")
    async def metrics():
        stats = server.engine.allocator.stats()
        server.degradation.update(server.async_engine.num_waiting, stats.usage)  # so it can turn off when idle
        server.metrics.set_pool(stats)
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    return app


def serve(cfg, overrides: list[str], compose) -> int:
    import uvicorn

    from core.config import engine_config

    sc = section(ServerConfig, cfg.get("server"), "server")
    engine = Engine(engine_config(cfg))
    fallback = Engine(engine_config(compose(list(overrides) + list(sc.fallback)))) if sc.fallback else None
    server = Server(engine, sc, fallback)
    log.info("serving %s on http://%s:%d", server.model_name, sc.host, sc.port)
    uvicorn.run(build_app(server), host=sc.host, port=sc.port, log_level="warning")
    return 0
