"""Typed configuration: the Hydra tree becomes these dataclasses before any code sees it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"
    path: str | None = None  # HF directory or GGUF file; None: the embedded default model
    dtype: str = "bf16"  # bf16 | fp32
    max_model_len: int = 2048  # prompt + output tokens per sequence
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    name: str = "static"  # the dataclass default is the baseline; conf/ picks continuous
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    policy: str = "fcfs"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CacheConfig:
    name: str = "contiguous"
    block_size: int = 16
    dtype: str = "auto"  # auto (the model dtype) | int8
    memory_gb: float | None = None  # KV pool budget; None: sized from the scheduler's limits
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class QuantConfig:
    name: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DecoderConfig:
    name: str = "sampling"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class BackendConfig:
    name: str = "torch"
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    seed: int = 0


@dataclass
class RunConfig:
    """How `run` and `compare` measure and report."""

    name: str | None = None  # reports/<name>/; None: built from the workload and components
    report_dir: str = "reports"
    warmup_requests: int = 2
    slo_ttft_s: float = 1.0  # the seed's healthy references for chat
    slo_tpot_s: float = 0.05
    remeasure_machine: bool = False
    plots: bool = True
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def section(cls: type, node: Any, where: str):
    """Known keys become fields (type-checked by OmegaConf); unknown ones go to `extra`."""
    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    names = {f.name for f in dataclasses.fields(cls)}
    known = {k: v for k, v in data.items() if k in names and k != "extra"}
    extra = dict(data.get("extra") or {})
    extra.update({k: v for k, v in data.items() if k not in names})
    try:
        typed = OmegaConf.merge(OmegaConf.structured(cls), known)
    except Exception as e:  # OmegaConf's validation errors carry the key and the value
        key = getattr(e, "full_key", None) or getattr(e, "key", None)
        raise ConfigError(f"{where}.{key}: {str(e).splitlines()[0]}" if key else f"{where}: {e}") from None
    obj = OmegaConf.to_object(typed)
    obj.extra = extra
    return obj


def run_config(cfg: DictConfig | dict) -> RunConfig:
    return section(RunConfig, cfg.get("run"), "run")


def engine_config(cfg: DictConfig | dict) -> EngineConfig:
    """The engine's part of a composed Hydra config as typed dataclasses."""
    get = cfg.get
    ec = EngineConfig(
        model=section(ModelConfig, get("model"), "model"),
        scheduler=section(SchedulerConfig, get("scheduler"), "scheduler"),
        cache=section(CacheConfig, get("cache"), "cache"),
        quant=section(QuantConfig, get("quant"), "quant"),
        decoder=section(DecoderConfig, get("decoder"), "decoder"),
        backend=section(BackendConfig, get("backend"), "backend"),
        seed=int(get("seed", 0) or 0),
    )
    if ec.cache.dtype not in ("auto", "int8"):
        raise ConfigError(f"cache.dtype must be auto or int8, got '{ec.cache.dtype}'")
    if ec.model.dtype not in ("fp32", "bf16"):
        raise ConfigError(f"model.dtype must be fp32 or bf16, got '{ec.model.dtype}'")
    for name, value in (
        ("model.max_model_len", ec.model.max_model_len),
        ("scheduler.max_num_seqs", ec.scheduler.max_num_seqs),
        ("scheduler.max_num_batched_tokens", ec.scheduler.max_num_batched_tokens),
        ("cache.block_size", ec.cache.block_size),
    ):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    return ec
