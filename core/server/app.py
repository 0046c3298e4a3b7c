"""`python -m core serve`: an OpenAI-compatible HTTP server over the engine, with guard rails.

Endpoints: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health,
/ready (200 only after a warm-up request ran), /metrics (Prometheus). Guard rails, each in
conf/config.yaml under `server:` and each counted in metrics: an input-length limit (400), a
bounded waiting queue (429 + Retry-After), a per-request timeout (504), abort on client
disconnect, API keys (401), a request-body limit (413), loopback by default, and the degradation
switch that lowers the input limit while the engine is overloaded, with hysteresis. Requests
carry a pool (header `X-Servelab-Pool`, e.g. chat or agent) that maps to a scheduling priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ValidationError

from core.config.compose import compose
from core.config.schema import section
from core.engine.async_engine import AsyncEngine
from core.engine.components import engine_config, require_shedding, resolve_device
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.server.config import ServerConfig, validate
from core.server.guards import OpenAIError
from core.server.handler import Server
from core.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("servelab")


def error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def warm_up(e: AsyncEngine) -> None:
    """The seed's cold-start lesson: a real request runs before /ready says yes. Its prompt has
    several tokens and it decodes one: backend.compile's two graphs (n tokens, 1 token) both
    compile here, not under the first users."""
    rid, q = await e.add(prompt_token_ids=e.engine.tokenizer.encode("Hello, how are you today?"),
                         params=SamplingParams(max_tokens=2, ignore_eos=True))
    while True:
        _, out = await q.get()
        if out is None or out.finished:
            return


async def start_engines(server: Server) -> None:
    """Every engine's loop on this event loop, each warmed up (if configured); then /ready says yes."""
    for e in server.engines.values():
        e.start(asyncio.get_running_loop())
        if server.cfg.warmup:
            await warm_up(e)
    server.ready = True


def parse_body(server: Server, raw: bytes, model: type[BaseModel]):
    """The body, size-checked, parsed once into its typed model (an OpenAI 400 if it does not fit)."""
    server.guards.check_body_size(len(raw), server.main)
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        if first["type"] == "json_invalid":  # bad JSON, or bytes that are not UTF-8
            raise OpenAIError(400, f"invalid JSON: {first['msg']}") from None
        if first["type"] == "model_type":
            raise OpenAIError(400, "the request body must be a JSON object") from None
        raise OpenAIError(400, f"{where}: {first['msg']}", param=where or None) from None


async def start_generation(server: Server, raw: bytes, headers, model: type[BaseModel]):
    """Parse, check and submit one generation request: (its typed body, the call in flight)."""
    req = parse_body(server, raw, model)
    server.observe_load()
    return req, await server.start_call(req, headers)


def openapi_body(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}},
            "responses": {"400": {"description": "bad request (OpenAI error JSON)"},
                          "401": {"description": "missing or wrong API key"},
                          "413": {"description": "body too large"},
                          "429": {"description": "queue full; see Retry-After"}}}


def add_generation_routes(app: FastAPI, server: Server) -> None:
    async def serve_call(request: Request, model: type[BaseModel]):
        try:
            server.guards.check_body_size(int(request.headers.get("content-length") or 0), server.main)
            req, call = await start_generation(server, await request.body(), request.headers, model)
            if req.stream:
                return StreamingResponse(server.stream(call, req.include_usage), media_type="text/event-stream")
            return JSONResponse(await server.complete(call, request.is_disconnected))
        except OpenAIError as e:
            return error(e)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await serve_call(request, CompletionRequest)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await serve_call(request, ChatCompletionRequest)


def add_info_routes(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models")
    async def models(request: Request):
        try:
            server.guards.check_auth(request.headers, server.main)
        except OpenAIError as e:
            return error(e)
        return server.model_list()

    @app.get("/health")
    async def health():
        failed = server.failed_engines()
        if failed:
            return JSONResponse({"status": "error", "error": failed}, status_code=500)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        return JSONResponse({"ready": server.ready}, status_code=200 if server.ready else 503)

    @app.get("/metrics")
    async def metrics():
        server.observe_load()  # so the switch can turn off when idle
        return PlainTextResponse(generate_latest(server.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")


def build_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await start_engines(server)
        yield
        for e in server.engines.values():
            e.stop()

    app = FastAPI(title="servelab", version="0.1.0", lifespan=lifespan)
    add_generation_routes(app, server)
    add_info_routes(app, server)
    return app


def engine_configs(cfg, overrides: list[str], sc: ServerConfig) -> dict:
    """Served name -> engine config: the main model, then each `server.models` entry (its overrides
    on top of the command line's). Several engines share the memory: an engine whose pool size is
    not set gets an equal share of the default utilization."""
    main = sc.served_model_name or engine_config(cfg).model.name
    validate(sc, main)
    configs = {main: engine_config(cfg)}
    for name, extra in sc.models.items():
        configs[name] = engine_config(compose(list(overrides) + list(extra)))
    for ec in configs.values():
        if sc.shed:
            require_shedding(ec, "server.shed=true")
        cache = ec.cache
        if len(configs) > 1 and getattr(cache, "memory_utilization", 0) is None and cache.memory_gb is None:
            default = 0.9 if resolve_device(ec.model.device).type == "cuda" else 0.2
            cache.memory_utilization = round(default / len(configs), 4)
    return configs


def serve(cfg, overrides: list[str]) -> int:
    import uvicorn

    sc = section(ServerConfig, cfg.get("server"), "server")
    engines = {name: Engine(ec) for name, ec in engine_configs(cfg, overrides, sc).items()}
    if len(engines) > 1:
        log.info("serving %d models in one process: %s", len(engines), "; ".join(
            f"{n}: {e.allocator.num_blocks * e.allocator.block_size * e.kv_spec.bytes_per_token / 1e9:.2f} GB KV"
            for n, e in engines.items()))
    server = Server(engines, sc)
    log.info("serving %s on http://%s:%d", ", ".join(engines), sc.host, sc.port)
    uvicorn.run(build_app(server), host=sc.host, port=sc.port, log_level="warning")
    return 0
