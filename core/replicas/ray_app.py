"""The two Ray Serve deployments behind `serve parallel.replicas=N`, in the shape of Ray Serve
LLM's (an OpenAI ingress calling engine replicas through a deployment handle):

- `ServelabReplica`: one whole servelab server (engine(s), guards, metrics; tensor-parallel if
  configured), answering one OpenAI call at a time as a stream: first a head (status, body,
  headers, streaming), then the SSE chunks if streaming.
- `OpenAIIngress`: the FastAPI app users reach. It reads each request's prompt for the router
  (RoutedRequest.prompt) and relays the replica's answer; /metrics has every replica's series
  and their totals; /v1/replicas lists the replicas (pid, /metrics URL, since when).

Replicas announce themselves on a named actor, the board, every second; each also serves its own
/metrics on a port of its node, which the ingress scrapes live. A request whose replica dies is
answered 503 (or, mid-stream, with an SSE error) and counted in
`servelab:replica_failures_total`; Ray starts a replacement, which announces itself in turn.
"""

# no `from __future__ import annotations`: FastAPI must see the Request annotations as classes
import asyncio
import json
import os
import time
from dataclasses import dataclass

import httpx
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, RayError

from core.replicas.prefix_affinity import routing_key
from core.replicas.replica_host import ReplicaHost
from core.server import protocol
from core.server.replica_metrics import ReplicaMetrics

NAMESPACE = "servelab"
BOARD = "servelab-replica-board"
GONE = object()  # a scrape refused: the replica's process is gone


@dataclass
class RoutedRequest:
    path: str  # completions | chat/completions | models
    body: bytes
    headers: dict
    prompt: str  # what the request router reads the prefix from


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """Who the replicas are and where their /metrics is; every replica ever seen is counted."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict] = {}
        self.started = 0

    def register(self, replica_id: str, info: dict) -> None:
        if replica_id not in self.replicas:
            self.started += 1
        self.replicas[replica_id] = {**info, "seen": time.time()}

    def drop(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def list(self) -> dict:
        return {"replicas": self.replicas, "started": self.started}


def board():
    """The board, created by the first caller: `serve` itself, before it deploys, so that the board
    is owned by the process that lives as long as the application (not by a replica that may die)."""
    return ReplicaBoard.options(name=BOARD, namespace=NAMESPACE, get_if_exists=True).remote()


@serve.deployment(name="ServelabReplica")
class ServelabReplica:
    async def __init__(self, cfg: dict, overrides: list[str], cluster: bool) -> None:
        self.id = serve.get_replica_context().replica_id.unique_id
        host = ray.util.get_node_ip_address() if cluster else "127.0.0.1"
        self.host = await ReplicaHost.start(cfg, overrides, host)
        self.info = {"pid": os.getpid(), "node": host, "metrics_url": self.host.metrics_url, "since": time.time()}
        self.beat = asyncio.get_running_loop().create_task(self._announce())

    async def _announce(self) -> None:
        handle = board()
        while True:
            try:
                await handle.register.remote(self.id, self.info)
            except RayError:  # the board is gone (its owner, `serve`, restarted it): look it up again
                handle = board()
            await asyncio.sleep(1.0)

    async def call(self, req: RoutedRequest):
        async for item in self.host.call(req.path, req.body, req.headers):
            yield item

    def check_health(self) -> None:
        self.host.check_health()

    def __del__(self) -> None:  # Ray Serve's graceful stop (scale-down, shutdown)
        if hasattr(self, "beat"):  # not if the constructor failed
            self.beat.cancel()
            self.host.close()


app = FastAPI(title="servelab on Ray Serve", version="0.1.0")


@serve.deployment(name="OpenAIIngress")
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, replica, router: str, expected: int) -> None:
        self.replica, self.router, self.expected = replica, router, expected
        self.board = board()
        self.replica_metrics = ReplicaMetrics()
        self.registry = CollectorRegistry()
        self.live = Gauge("servelab:replicas", "Replicas serving (registered and reachable)", registry=self.registry)
        self.started = Gauge("servelab:replicas_started", "Replicas ever started (restarts included)",
                             registry=self.registry)
        self.failures = Counter("servelab:replica_failures", "Requests that failed because their replica died",
                                ["stage"], registry=self.registry)
        self.http = httpx.AsyncClient(timeout=5.0)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._forward(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._forward(request, "chat/completions")

    @app.get("/v1/models")
    async def models(self, request: Request):
        return await self._forward(request, "models")

    async def _forward(self, request: Request, path: str):
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:  # the replica answers the 400
            body = None
        routed = RoutedRequest(path, raw, dict(request.headers), routing_key(body))
        stream = self.replica.options(stream=True).call.remote(routed)
        try:
            status, payload, headers, streaming = await stream.__anext__()
        except (RayActorError, ActorUnavailableError):
            self.failures.labels("before_response").inc()
            return JSONResponse(protocol.error_body("the replica serving this request died; retry", "server_error",
                                                    None, 503), status_code=503, headers={"Retry-After": "1"})
        if not streaming:
            return JSONResponse(payload, status_code=status, headers=headers)
        return StreamingResponse(self._relay(stream), media_type="text/event-stream")

    async def _relay(self, stream):
        try:
            async for chunk in stream:
                yield chunk
        except (RayActorError, ActorUnavailableError):
            self.failures.labels("mid_stream").inc()
            yield protocol.sse(protocol.error_body("the replica serving this stream died", "server_error", None, 503))

    async def _replicas(self) -> dict:
        """The board's replicas that are still there; a replica whose /metrics refuses is dropped."""
        listed = await self.board.list.remote()
        replicas = listed["replicas"]
        texts = await asyncio.gather(*(self._scrape(r["metrics_url"]) for r in replicas.values()))
        scraped = {}
        for rid, text in zip(list(replicas), texts):
            if text is GONE:
                await self.board.drop.remote(rid)
                del replicas[rid]
            else:
                scraped[rid] = text
        self.replica_metrics.update(scraped)
        self.live.set(len(replicas))
        self.started.set(listed["started"])
        return listed

    async def _scrape(self, url: str):
        try:
            return (await self.http.get(url)).text
        except httpx.ConnectError:
            return GONE
        except httpx.HTTPError:  # slow, not gone: keep its last scrape
            return None

    @app.get("/metrics")
    async def metrics(self):
        await self._replicas()
        text = generate_latest(self.registry).decode() + self.replica_metrics.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/replicas")
    async def replicas(self):
        listed = await self._replicas()
        now = time.time()
        return {"router": self.router, "started": listed["started"],
                "replicas": [{"id": rid, **{k: v for k, v in r.items() if k != "seen"}, "age_s": now - r["since"]}
                             for rid, r in sorted(listed["replicas"].items(), key=lambda kv: kv[1]["since"])]}

    @app.get("/health")
    async def health(self):
        n = len((await self._replicas())["replicas"])
        return JSONResponse({"status": "ok" if n else "error", "replicas": n}, status_code=200 if n else 500)

    @app.get("/ready")
    async def ready(self):
        n = len((await self._replicas())["replicas"])  # ready once the configured replicas all announced themselves
        return JSONResponse({"ready": n >= self.expected, "replicas": n}, status_code=200 if n >= self.expected else 503)
