"""From a configuration to the engine's parts: typed plugin configs, the model on its device,
and every component built by its plugin and checked against its contract."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from core.config.schema import DTYPE_NAMES, ENGINE_KINDS, EngineConfig, ModelConfig, ParallelConfig, section, to_dict
from core.engine.defaults import describe_dtype, fill_device_defaults, resolve_device
from core.engine.hardware import load_hardware
from core.engine.interfaces import has_capability
from core.engine.registry import Registry, get_registry
from core.engine.step_cost import SchedulerContext
from core.engine.types import KVCacheSpec
from core.errors import ConfigError
from core.model.dummy import dummy_args, dummy_model
from core.model.fuse import fuse_projections
from core.model.llama import ModelArgs
from core.model.loader import DTYPES, LoadedModel, load_model, load_tokenizer, read_model_args
from core.model.tokenizer import Tokenizer
from core.parallel.executor import DistributedBackend, check_parallel, local_spec, shard_model, start_ranks
from core.runner.memory import activation_reserve
from core.runner.model_runner import ModelRunner

log = logging.getLogger("servelab")

# cache.dtype: auto (the model's), a float dtype the KV is stored in whatever the model computes in
# (bf16 under an fp32 model: half the bytes a decode step reads, attention still in fp32), or INT8
CACHE_DTYPES = ("auto", *DTYPE_NAMES, "int8")


def engine_config(cfg: Any, registry: Registry | None = None) -> EngineConfig:
    """The engine's part of a composed config, every component section as its plugin's dataclass."""
    registry = registry or get_registry()
    hardware = cfg.get("hardware")
    ec = EngineConfig(model=section(ModelConfig, cfg.get("model"), "model"), seed=int(cfg.get("seed", 0) or 0),
                      hardware=load_hardware(to_dict(hardware) if hardware is not None else None),
                      parallel=section(ParallelConfig, cfg.get("parallel"), "parallel"),
                      **{kind: component_config(registry, kind, cfg.get(kind)) for kind in ENGINE_KINDS})
    simulated = is_simulated(ec, registry)
    fill_device_defaults(ec, simulated)
    validate(ec)
    if simulated and ec.parallel.tensor_parallel_size > 1:
        raise ConfigError("backend=simulator models tensor parallelism itself: use backend.tensor_parallel_size")
    check_parallel(ec)
    return ec


def is_simulated(ec: EngineConfig, registry: Registry) -> bool:
    """Whether the backend runs without weights (a simulator); a hardware profile needs one."""
    simulated = not getattr(registry.get("backend", ec.backend.name).factory, "needs_weights", True)
    if ec.hardware is not None and not simulated:
        raise ConfigError(f"hardware={ec.hardware.name} is what backend=simulator simulates; backend="
                          f"{ec.backend.name} runs on this machine (drop hardware= or add backend=simulator)")
    return simulated


def component_config(registry: Registry, kind: str, node: Any):
    if kind == "backend" and node is not None:
        name = node.get("name") if hasattr(node, "get") else getattr(node, "name", None)
        if name in registry.components["peer"] and name not in registry.components["backend"]:
            raise ConfigError(f"'{name}' is a benchmark peer, not a backend: use peer={name} with run or compare")
    return registry.config(kind, node)


def typed(config: EngineConfig, registry: Registry) -> EngineConfig:
    """The same config with each component section as its plugin's dataclass (for configs built
    in code from the base classes)."""
    config = dataclasses.replace(config, **{k: component_config(registry, k, getattr(config, k)) for k in ENGINE_KINDS})
    if (config.scheduler.max_num_batched_tokens is None or config.model.dtype == "auto"
            or getattr(config.cache, "block_size", 0) is None):
        fill_device_defaults(config, is_simulated(config, registry))
    return config


def validate(ec: EngineConfig) -> None:
    if ec.cache.dtype not in CACHE_DTYPES:
        raise ConfigError(f"cache.dtype must be {', '.join(CACHE_DTYPES[:-1])} or {CACHE_DTYPES[-1]}, "
                          f"got '{ec.cache.dtype}'")
    if ec.model.dtype not in DTYPE_NAMES:
        raise ConfigError(f"model.dtype must be auto, {' or '.join(DTYPE_NAMES)}, got '{ec.model.dtype}'")
    if ec.model.max_model_len < 2:
        raise ConfigError(f"model.max_model_len must be at least 2 (a prompt token and an output token), got "
                          f"{ec.model.max_model_len}")
    for name, value in (("scheduler.max_num_seqs", ec.scheduler.max_num_seqs),
                        ("scheduler.max_num_batched_tokens", ec.scheduler.max_num_batched_tokens)):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    resolve_device(ec.model.device)
    if ec.model.load_format not in ("auto", "dummy"):
        raise ConfigError(f"model.load_format must be auto or dummy, got '{ec.model.load_format}'")


def require_shedding(ec: EngineConfig, what: str, registry: Registry | None = None) -> None:
    """Load shedding (`what` asks for it) needs a scheduler that predicts TTFT: say so before any model loads."""
    factory = (registry or get_registry()).get("scheduler", ec.scheduler.name).factory
    if "deadlines" not in getattr(factory, "capabilities", ()):
        raise ConfigError(f"{what} needs a scheduler that predicts TTFT (scheduler=slo); "
                          f"'{ec.scheduler.name}' does not")


def resolve_model_path(config: EngineConfig) -> str:
    """Where the weights come from: a path, the embedded default model, or `dummy:NAME`."""
    if config.model.load_format == "dummy":
        return f"dummy:{config.model.name}"
    if config.model.path:
        return config.model.path
    if config.model.name == "smollm2-135m":
        from core.model.default_model import default_model_path

        return str(default_model_path())
    raise ConfigError(f"model '{config.model.name}' has no path; set model.path=DIR_OR_GGUF")


def load_weights(config: EngineConfig, device: torch.device) -> LoadedModel:
    mc = config.model
    if mc.load_format == "dummy":
        return dummy_model(mc.shape, mc.name, DTYPES[mc.dtype], mc.max_model_len, device, config.seed, mc.tokenizer)
    return load_model(resolve_model_path(config), mc.dtype, mc.max_model_len, device)


def model_args(config: EngineConfig) -> ModelArgs:
    """The model's geometry without its weights."""
    mc = config.model
    return dummy_args(mc.shape, mc.name) if mc.load_format == "dummy" else read_model_args(resolve_model_path(config))


def model_tokenizer(config: EngineConfig) -> Tokenizer:
    mc = config.model
    if mc.load_format == "dummy":
        from core.model.default_model import default_model_path

        return load_tokenizer(mc.tokenizer or default_model_path())
    return load_tokenizer(resolve_model_path(config))


def shape_only(config: EngineConfig) -> LoadedModel:
    """What a simulator loads: the model's shape and tokenizer, no weights."""
    return LoadedModel(None, model_tokenizer(config), model_args(config), resolve_model_path(config))


@dataclass
class EngineParts:
    config: EngineConfig
    loaded: LoadedModel
    model: torch.nn.Module  # after quantization: what the backend runs
    device: torch.device
    kv_spec: KVCacheSpec
    quantizer: Any
    allocator: Any
    attention: Any
    backend: Any
    scheduler: Any
    decoder: Any
    runner: ModelRunner
    context: SchedulerContext  # the engine's step-cost model and clock, shared with its scheduler


def build_parts(config: EngineConfig, registry: Registry, loaded: LoadedModel | None = None) -> EngineParts:
    config = typed(config, registry)  # every name and key checked before the (slow) model load
    world = config.parallel.tensor_parallel_size
    workers = start_ranks(config, model_args(config), build_worker_backend) if world > 1 else None
    try:
        return _build_parts(config, registry, loaded, workers)
    except BaseException:
        if workers:
            workers.shutdown(timeout=1.0)
        raise


def _build_parts(config: EngineConfig, registry: Registry, loaded: LoadedModel | None, workers) -> EngineParts:
    mc = config.model
    device = resolve_device(mc.device)
    torch.manual_seed(config.seed)
    simulated = is_simulated(config, registry)
    if loaded is None:
        loaded = shape_only(config) if simulated else load_weights(config, device)
    quantizer = registry.create("quant", config.quant, tokenizer=loaded.tokenizer, source=loaded.source)
    shard = None
    if simulated:
        model = None
    elif workers:
        model, shard = shard_model(loaded.model, quantizer, config, 0, config.parallel.tensor_parallel_size)
    else:
        model = quantizer.quantize(loaded.model)
    if model is not None:
        fuse_projections(model)
    args = loaded.args
    sc = config.scheduler
    reserve = activation_reserve(args, sc.max_num_batched_tokens, sc.max_num_seqs)
    kv_spec, attention, backend = _attention_and_backend(config, registry, device, model, args, shard)
    if workers:
        backend = DistributedBackend(backend, workers)
    if simulated and config.cache.memory_gb is None:  # the pool of the simulated devices, not of this machine
        utilization = getattr(config.cache, "memory_utilization", None) or config.hardware.default_memory_utilization
        budget = backend.kv_budget_bytes(config, args, backend.weight_bytes, reserve, utilization)
        if budget <= 0:
            raise ConfigError(f"{args.num_layers}-layer model: {backend.weight_bytes / 1e9:.1f} GB of weights leave "
                              f"no KV memory on {config.hardware.name} at utilization {utilization} (quantize, or "
                              f"raise backend.tensor_parallel_size)")
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, memory_gb=budget / 1e9))
    allocator = registry.create("cache", config.cache, spec=kv_spec, max_num_seqs=sc.max_num_seqs, device=device,
                                reserved_bytes=reserve)
    if has_capability(allocator, "describe"):
        log.info(allocator.describe())
    if not simulated and (line := describe_dtype(config, device)):
        log.info(line)
    backend.init_kv_cache(allocator.num_blocks, allocator.block_size)
    clock = getattr(backend, "clock", None)  # a simulator's virtual clock drives the whole engine
    context = SchedulerContext(clock=clock, sleep=clock.sleep) if clock is not None else SchedulerContext()
    scheduler = registry.create("scheduler", config.scheduler, allocator=allocator, context=context)
    # a speculative decoder drafts with the target itself (`self`), a second model or the text
    decoder = registry.create("decoder", config.decoder, vocab_size=args.vocab_size, seed=config.seed, model=model,
                              model_args=args, engine_config=config, registry=registry, device=device)
    runner = getattr(backend, "runner", None) or ModelRunner(device, attention)  # a simulator builds no tensors
    return EngineParts(config, loaded, model, device, kv_spec, quantizer, allocator, attention, backend, scheduler,
                       decoder, runner, context)


def kv_cache_spec(config: EngineConfig, args: ModelArgs) -> KVCacheSpec:
    """The whole model's KV geometry at the configured cache dtype (int8, bf16, fp32, or the model's)."""
    name = config.model.dtype if config.cache.dtype == "auto" else config.cache.dtype
    kv_dtype = torch.int8 if name == "int8" else DTYPES[name]
    return KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, kv_dtype, config.model.max_model_len)


def _attention_and_backend(config: EngineConfig, registry: Registry, device, model, args: ModelArgs, shard):
    """(the whole KV spec, attention, backend); a tensor-parallel `shard` holds its own KV heads only."""
    kv_spec = kv_cache_spec(config, args)
    attention = registry.create("attention", config.attention, device=device)
    backend = registry.create("backend", config.backend, model=model, spec=local_spec(kv_spec, shard) if shard else
                              kv_spec, attention=attention, device=device, max_num_seqs=config.scheduler.max_num_seqs,
                              model_args=args, engine_config=config)
    return kv_spec, attention, backend


def build_worker_backend(config: EngineConfig, rank: int, world: int):
    """What a tensor-parallel worker rank builds: the same model load, its shard, its KV cache and
    backend (no scheduler or allocator: rank 0 sends it every call)."""
    registry = get_registry()
    config = typed(config, registry)
    device = resolve_device(config.model.device)
    torch.manual_seed(config.seed)
    loaded = load_weights(config, device)
    quantizer = registry.create("quant", config.quant, tokenizer=loaded.tokenizer, source=loaded.source)
    model, shard = shard_model(loaded.model, quantizer, config, rank, world)
    fuse_projections(model)
    return _attention_and_backend(config, registry, device, model, loaded.args, shard)[2]
