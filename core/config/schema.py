"""Typed configuration: the Hydra tree becomes these dataclasses before any code sees it.

Each component section (scheduler, cache, ...) has a base dataclass with the keys every
implementation understands; a plugin that needs more declares a subclass as its factory's
`config_class`, and `core.engine.components.engine_config` builds that instead. A key that is in
neither is an error naming the plugin's valid keys: a typo never passes silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError

# Component kinds, in the order the engine builds them; each is a Hydra group and a hook.
ENGINE_KINDS = ("scheduler", "cache", "quant", "decoder", "backend", "attention")
COMPONENT_KINDS = ENGINE_KINDS + ("peer",)
DTYPE_NAMES = ("fp32", "bf16")


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"
    path: str | None = None  # HF directory or GGUF file; None: the embedded default model
    dtype: str = "auto"  # auto (bf16 where the device computes it natively, else fp32) | bf16 | fp32
    max_model_len: int = 2048  # prompt + output tokens per sequence
    device: str = "auto"  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    load_format: str = "auto"  # auto: the weights at `path`; dummy: random weights of `shape` (no download)
    shape: dict | None = None  # dummy: Hugging Face config keys (hidden_size, num_hidden_layers, ...)
    tokenizer: str | None = None  # dummy: a tokenizer directory or GGUF; None: the embedded model's


@dataclass
class SchedulerConfig:
    name: str = "static"  # the dataclass default is the baseline; conf/ picks continuous
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = 4096  # None: the device's default (engine_config resolves it)


@dataclass
class CacheConfig:
    name: str = "contiguous"
    dtype: str = "auto"  # auto (the model dtype; bf16 under an fp32 model that model.dtype=auto took) | bf16 | fp32 | int8
    memory_gb: float | None = None  # KV pool budget; None: the allocator's own default


@dataclass
class QuantConfig:
    name: str = "none"


@dataclass
class DecoderConfig:
    name: str = "sampling"


@dataclass
class BackendConfig:
    name: str = "torch"
    num_threads: int | None = None  # torch intra-op threads on the CPU; None: torch's default


@dataclass
class AttentionConfig:
    name: str = "auto"  # triton on CUDA, torch elsewhere


@dataclass
class PeerConfig:
    """A benchmark peer run in place of the engine by `run`/`compare` (null: the engine itself)."""

    name: str = "hf"
    num_threads: int | None = None


BASE_CONFIGS: dict[str, type] = {
    "scheduler": SchedulerConfig, "cache": CacheConfig, "quant": QuantConfig, "decoder": DecoderConfig,
    "backend": BackendConfig, "attention": AttentionConfig, "peer": PeerConfig,
}


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks the model is split over (Megatron layout); the engine starts them
    distributed_backend: str = "auto"  # auto: gloo on the CPU, nccl on CUDA | gloo | nccl
    master_port: int | None = None  # rank 0's port for the others (engine-started ranks); None: a free one
    timeout_s: float = 60.0  # a collective waiting longer fails (a rank that hangs rather than dies)
    # data-parallel replicas on Ray Serve (`serve` and `bench` only): core/replicas/ray_serve.py
    replicas: int = 1  # engines behind one OpenAI ingress (each tensor_parallel_size ranks)
    ray_address: str | None = None  # an existing cluster (auto, ray://host:10001); None: a local Ray
    router: str = "prefix"  # prefix | pow2 (Ray's power of two choices) | a RequestRouter class path
    router_block_chars: int = 256  # prefix: the prompt is matched in blocks of this many characters
    router_max_imbalance: int = 4  # prefix: the holder is passed over at this many more ongoing requests than the least loaded
    min_replicas: int | None = None  # autoscaling bounds: set both to let Ray scale between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # autoscaling: Ray adds a replica above this many per replica
    max_ongoing_requests: int = 256  # per replica; beyond it Ray routes elsewhere or queues
    replica_cpus: float | None = None  # Ray CPUs per replica, also its torch threads; None: cores / (max_replicas or replicas)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    seed: int = 0
    hardware: Any = None  # a core.engine.hardware.HardwareProfile: what backend=simulator simulates
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass
class RunConfig:
    """How `run` and `compare` measure and report."""

    name: str | None = None  # reports/<name>/; None: built from the workload and components
    report_dir: str = "reports"
    warmup_requests: int = 2
    slo_ttft_s: float = 1.0  # the seed's healthy references for chat
    slo_tpot_s: float = 0.05
    shed: bool = False  # refuse at arrival a request the scheduler predicts will miss its TTFT target
    remeasure_machine: bool = False
    plots: bool = True
    progress: bool = True


def to_dict(node: Any) -> dict:
    if node is None:
        return {}
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    if dataclasses.is_dataclass(node):
        return dataclasses.asdict(node)
    return dict(node)


def section(cls: type, node: Any, where: str):
    """A config section as the dataclass `cls`, type-checked by OmegaConf; unknown keys are an error
    that lists the valid ones."""
    data = to_dict(node)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                          f"valid keys: {', '.join(names)}")
    try:
        typed = OmegaConf.merge(OmegaConf.structured(cls), data)
    except Exception as e:  # OmegaConf's validation errors carry the key and the value
        key = getattr(e, "full_key", None) or getattr(e, "key", None)
        raise ConfigError(f"{where}.{key}: {str(e).splitlines()[0]}" if key else f"{where}: {e}") from None
    return OmegaConf.to_object(typed)


def run_config(cfg: DictConfig | dict) -> RunConfig:
    return section(RunConfig, cfg.get("run"), "run")
