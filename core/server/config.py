"""The server's settings (`server:` in conf/config.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
