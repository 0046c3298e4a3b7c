"""The server's settings (`server:` in conf/config.yaml), checked before any model loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.errors import ConfigError


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback only unless asked
    port: int = 8000
    served_model_name: str | None = None  # the main model's name; None: model.name
    api_keys: list = field(default_factory=list)
    max_queue: int = 256  # waiting requests (per model) before 429
    retry_after_s: int = 2
    max_input_tokens: int | None = None  # None: max_model_len - 1
    request_timeout_s: float = 600.0
    max_body_bytes: int = 1_000_000
    warmup: bool = True
    # more models in this process, each its own engine and KV pool: served name -> overrides on top
    # of the command line's, e.g. {chat: [quant=int4], code: [quant=int8], agent: [scheduler.max_num_seqs=8]}
    models: dict = field(default_factory=dict)
    # X-Servelab-Pool header -> a priority (an int, within the requested model) or a served model (a name)
    pools: dict = field(default_factory=lambda: {"chat": 0, "agent": 1})
    # per pool, the default targets of its requests: {chat: {ttft_s: 2.0, tpot_s: 0.15}}
    pool_slo: dict = field(default_factory=dict)
    shed: bool = False  # refuse (429) a request the scheduler predicts will miss its TTFT target
    fallback: str | None = None  # a `models` entry that takes the main model's new requests while degraded
    degrade_enabled: bool = True
    degrade_waiting_high: int = 64  # switch on at this many waiting, or at this KV usage
    degrade_kv_high: float = 0.95
    degrade_waiting_low: int = 16  # and off again only below both lows (hysteresis)
    degrade_kv_low: float = 0.7
    degrade_max_input_tokens: int = 512


def validate(cfg: ServerConfig, main_name: str) -> None:
    """Every bad value in one line naming it and its limit, before any engine is built."""
    checks = [
        (1 <= cfg.port <= 65535, f"server.port must be in 1..65535, got {cfg.port}"),
        (cfg.max_queue >= 1, f"server.max_queue must be at least 1, got {cfg.max_queue}"),
        (cfg.retry_after_s >= 0, f"server.retry_after_s must be >= 0, got {cfg.retry_after_s}"),
        (cfg.request_timeout_s > 0, f"server.request_timeout_s must be positive, got {cfg.request_timeout_s}"),
        (cfg.max_body_bytes > 0, f"server.max_body_bytes must be positive, got {cfg.max_body_bytes}"),
        (cfg.max_input_tokens is None or cfg.max_input_tokens >= 1,
         f"server.max_input_tokens must be at least 1, got {cfg.max_input_tokens}"),
        (main_name not in cfg.models, f"server.models has an entry named '{main_name}', the main model's name"),
        (cfg.fallback is None or cfg.fallback in cfg.models,
         f"server.fallback='{cfg.fallback}' names no server.models entry; entries: {', '.join(cfg.models) or 'none'}"),
        (cfg.degrade_waiting_low <= cfg.degrade_waiting_high and cfg.degrade_kv_low <= cfg.degrade_kv_high,
         "server.degrade_*_low must not exceed the matching degrade_*_high"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    for name, overrides in cfg.models.items():
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ConfigError(f"server.models.{name} must be a list of overrides, e.g. [quant=int8], got {overrides!r}")
    for pool, slo in cfg.pool_slo.items():
        if pool not in cfg.pools:
            raise ConfigError(f"server.pool_slo.{pool} names no pool; pools: {', '.join(cfg.pools)}")
        bad = set(slo) - {"ttft_s", "tpot_s"} if isinstance(slo, dict) else {"?"}
        if bad or not all(isinstance(v, (int, float)) and v > 0 for v in slo.values()):
            raise ConfigError(f"server.pool_slo.{pool} must map ttft_s and/or tpot_s to positive seconds, "
                              f"got {slo!r}")
    served = {main_name, *cfg.models}
    for pool, target in cfg.pools.items():
        if not isinstance(target, int) and target not in served:
            raise ConfigError(f"server.pools.{pool}={target!r} is neither a priority (an integer) nor a served "
                              f"model ({', '.join(sorted(served))})")
