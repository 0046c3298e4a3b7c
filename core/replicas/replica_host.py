"""One replica's servelab server, free of Ray: the engines, guards and metrics of `serve`, answering
OpenAI calls handed over as bytes, and its own /metrics on a port of its node.

Every answer is a stream: first a head (status, body or None, headers, streaming), then, for a
streamed call, the SSE chunks. A non-streamed call's head carries the whole response, so the
ingress needs no second guess of the request's `stream` field.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from omegaconf import OmegaConf
from prometheus_client import CollectorRegistry, start_http_server

from core.config.schema import section
from core.engine.engine import Engine
from core.server.app import engine_configs, start_engines, start_generation
from core.server.config import ServerConfig
from core.server.guards import OpenAIError
from core.server.handler import Server
from core.server.protocol import ChatCompletionRequest, CompletionRequest

MODELS = {"completions": CompletionRequest, "chat/completions": ChatCompletionRequest}


class _Live:
    """Collected first on each scrape: refreshes the live gauges (running, waiting, KV) on the
    server's event loop, then hands over the server's own series."""

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop

    def collect(self):
        async def observe():
            self.server.observe_load()

        asyncio.run_coroutine_threadsafe(observe(), self.loop).result(timeout=5)
        yield from self.server.metrics.registry.collect()


class ReplicaHost:
    def __init__(self, server: Server, metrics_url: str, http) -> None:
        self.server, self.metrics_url, self._http = server, metrics_url, http

    @classmethod
    async def start(cls, cfg: dict, overrides: list[str], host: str = "127.0.0.1") -> ReplicaHost:
        """Build and warm the engines (as `serve` does), then open /metrics on a free port of `host`."""
        cfg = OmegaConf.create(cfg)
        sc = section(ServerConfig, cfg.get("server"), "server")
        server = Server({n: Engine(ec) for n, ec in engine_configs(cfg, overrides, sc).items()}, sc)
        await start_engines(server)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Live(server, asyncio.get_running_loop()))
        http, _ = start_http_server(0, addr=host, registry=registry)
        return cls(server, f"http://{host}:{http.server_port}/metrics", http)

    async def call(self, path: str, body: bytes, headers: dict) -> AsyncIterator:
        try:
            if path == "models":
                self.server.guards.check_auth(headers, self.server.main)
                yield 200, self.server.model_list(), {}, False
                return
            req, call = await start_generation(self.server, body, headers, MODELS[path])
            if not req.stream:
                yield 200, await self.server.complete(call, None), {}, False
                return
        except OpenAIError as e:
            yield e.status, e.body(), e.headers, False
            return
        yield 200, None, {}, True
        async for chunk in self.server.stream(call, req.include_usage):
            yield chunk

    def check_health(self) -> None:
        failed = self.server.failed_engines()
        if failed:
            raise RuntimeError("engine failed: " + "; ".join(f"{n}: {err}" for n, err in failed.items()))

    def close(self) -> None:
        self._http.shutdown()
        for e in self.server.engines.values():
            e.stop()
        for e in self.server.engines.values():
            e.engine.close()
