"""Guard rails: API keys, the input-length limit, the bounded queue, pools, and the degradation
switch. Each refusal is an OpenAI error with its HTTP status and is counted in the metrics."""

from __future__ import annotations

import logging

from core.server import protocol
from core.server.config import ServerConfig
from core.server.metrics import ServerMetrics

log = logging.getLogger("servelab")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers or {}
        self.code = status if code is None else code  # OpenAI's `code`: e.g. model_not_found

    def body(self) -> dict:
        """The OpenAI error JSON."""
        return protocol.error_body(self.message, self.kind, self.param, self.code)


class Degradation:
    """The switch: on when waiting or KV usage crosses its high mark, off below both low marks."""

    def __init__(self, cfg: ServerConfig, metrics: ServerMetrics, model_name: str) -> None:
        self.cfg, self.metrics, self.model_name, self.on = cfg, metrics, model_name, False

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
        self.metrics.degraded.labels(self.model_name).set(1 if self.on else 0)


class Guards:
    def __init__(self, cfg: ServerConfig, metrics: ServerMetrics, main_name: str) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.degradation = Degradation(cfg, metrics, main_name)

    def check_auth(self, headers, model_name: str) -> None:
        if not self.cfg.api_keys:
            return
        auth = headers.get("authorization", "")
        if not auth.startswith("Bearer ") or auth[7:] not in self.cfg.api_keys:
            self.metrics.reject(model_name, "unauthorized")
            raise OpenAIError(401, "invalid or missing API key (send Authorization: Bearer KEY)", "authentication_error")

    def check_body_size(self, size: int, model_name: str) -> None:
        if size > self.cfg.max_body_bytes:
            self.metrics.reject(model_name, "body_too_large")
            raise OpenAIError(413, f"request body of {size} bytes is over the limit of {self.cfg.max_body_bytes}")

    def admit(self, prompts: list[list[int]], num_waiting: int, max_input: int, model_name: str) -> None:
        """The input-length limit (lowered while degraded) and the bounded queue."""
        on = self.degradation.on
        limit = min(max_input, self.cfg.degrade_max_input_tokens) if on else max_input
        for ids in prompts:
            if len(ids) > limit:
                self.metrics.reject(model_name, "input_too_long")
                why = " (lowered while the server is overloaded)" if on else ""
                raise OpenAIError(400, f"input has {len(ids)} tokens; the limit is {limit}{why}", param="prompt")
        if num_waiting + len(prompts) > self.cfg.max_queue:
            self.metrics.reject(model_name, "queue_full")
            raise OpenAIError(429, f"the server is busy: {num_waiting} requests are waiting "
                                   f"(limit {self.cfg.max_queue}); retry later", "rate_limit_error",
                              headers={"Retry-After": str(self.cfg.retry_after_s)})

    def pool(self, headers) -> int | str | None:
        """The X-Servelab-Pool header's priority (int) or served model (str); None without a header."""
        pool = headers.get("x-servelab-pool")
        if pool is None:
            return None
        if pool not in self.cfg.pools:
            raise OpenAIError(400, f"unknown pool '{pool}'; pools: {', '.join(self.cfg.pools)}", param="X-Servelab-Pool")
        return self.cfg.pools[pool]
