"""Defaults that depend on the device the engine runs on, resolved once into the config (so that
reports record the value that ran): the step's token budget and the model's compute dtype."""

from __future__ import annotations

import torch

from core.config.schema import EngineConfig
from core.errors import ConfigError
from servelab_kernels.cpp_build import cpu_features as cpu_feature_flags  # (tests replace it here)

# A step's token budget when the config leaves it null, per device, as vLLM picks its defaults per
# device. Every running decode waits through the step's prefill chunk, and on 2 CPU cores a step costs
# about 0.75 ms a token (bf16, 64 rows and up), so TPOT is about the budget's price: on the Zen 4 kind
# chat_longtail (100 requests at once) ran TPOT p50 130-148 ms at 128 against 224-230 ms at 256, for
# 0.86x the output tokens (47.8-53.5 % of its roofline), and decode_heavy 636 against 626 output
# tok/s (reports/chunk-budget-zen4-*); on faster kinds 256 already held TPOT p50 at 125 ms
# (reports/chunk-budget-chat_longtail). On a GPU 1,024 tokens take milliseconds.
STEP_BUDGET = {"cpu": 128, "cuda": 1024}

# Tokens per KV block when `cache.block_size` is null. A block holds each KV head's block_size x
# head_dim values contiguous (2 KB at 16 for SmolLM2), and a CPU decode step reads every run of every
# block its sequences hold: longer runs read nearer the streaming rate (`python -m
# benchmarks.decode_attention --block-sizes`), and decode_heavy served 1.03-1.05x the output tokens at
# 64 against 16 in two alternating pairs (reports/block-size-decode_heavy). A GPU's kernels (and the
# Triton ones here) are tuned for 16, which also keeps prefix-cache hits fine-grained.
BLOCK_SIZE = {"cpu": 64, "cuda": 16}

# CPU features with which bf16 matmuls run in hardware. Without them (AVX2-only x86, such as AMD
# EPYC Zen 3) torch 2.13 runs a bf16 linear of 64 x 576 x 1,536 at about 19 GFLOP/s against 120 in
# fp32, and a bf16 `mm` at about 1 GFLOP/s, so `auto` takes fp32 there.
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; `bf16` is the Arm Features name


def fp32_tiles(device: torch.device) -> bool:
    """Whether fp32 linears multiply on servelab's AVX2 FMA tiles here (servelab_kernels/fp32_linear.py:
    AVX2 and FMA and no AVX-512, where oneDNN's kernels serve instead), read from the CPU's flags without
    building the kernels: the CPUs whose packed weights `backend.fp32_linear_weights` stores."""
    flags = cpu_feature_flags()
    return device.type == "cpu" and {"avx2", "fma"} <= flags and "avx512f" not in flags


def native_bf16(device: torch.device) -> bool:
    """Whether the device multiplies bf16 in hardware (else bf16 is emulated and slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(NATIVE_BF16_FLAGS & cpu_feature_flags())


def resolve_device(name: str) -> torch.device:
    """`auto`: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got '{name}'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name}, but this machine has no CUDA device (use auto or cpu)")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N, got '{name}'")
    return device


def on_cpu(ec: EngineConfig, simulated: bool) -> bool:
    """Whether the engine runs on a CPU: this machine's, or the simulator's `cpu` profile."""
    if simulated:
        return ec.hardware is not None and ec.hardware.name == "cpu"
    return resolve_device(ec.model.device).type == "cpu"


def default_step_budget(ec: EngineConfig, simulated: bool) -> int:
    """Tokens per step for the device the engine runs on, or the simulator's device (its `cpu`
    profile is this machine's CPU)."""
    return STEP_BUDGET["cpu" if on_cpu(ec, simulated) else "cuda"]


def default_block_size(ec: EngineConfig, simulated: bool) -> int:
    """Tokens per KV block for the device the engine runs on (a simulated GPU keeps the GPU's)."""
    return BLOCK_SIZE["cpu" if on_cpu(ec, simulated) else "cuda"]


def default_dtype(ec: EngineConfig, simulated: bool) -> str:
    """bf16 where the device computes it natively, else fp32. A simulated GPU profile is bf16; the
    simulator's `cpu` profile is this machine's CPU."""
    if simulated and not on_cpu(ec, simulated):
        return "bf16"
    device = torch.device("cpu") if simulated else resolve_device(ec.model.device)
    return "bf16" if native_bf16(device) else "fp32"


def fill_device_defaults(ec: EngineConfig, simulated: bool) -> None:
    """A null `scheduler.max_num_batched_tokens`, a null `cache.block_size` (of a cache that has one)
    and `model.dtype=auto` become the device's defaults (where auto takes fp32 for want of native bf16,
    with an auto KV cache and auto fp32 linear weights stored in bf16); values the config gives stay."""
    if ec.scheduler.max_num_batched_tokens is None:
        ec.scheduler.max_num_batched_tokens = default_step_budget(ec, simulated)
    if hasattr(ec.cache, "block_size") and ec.cache.block_size is None:
        ec.cache.block_size = default_block_size(ec, simulated)
    if ec.model.dtype == "auto":
        ec.model.dtype = default_dtype(ec, simulated)
        # fp32 taken for want of native bf16 arithmetic: the KV cache is still stored in bf16 (half the
        # bytes decode reads, twice the tokens a pool holds; the kernels widen it), which left the
        # answers as they were (perplexity 17.527 against 17.539, KL 0.0000: reports/quant-eval-kv-zen3)
        # and served chat_longtail 1.14-1.16x faster on a 2-core Zen 3 (reports/avx2-prefill-kv-int8-chat_longtail)
        if ec.model.dtype == "fp32" and getattr(ec.cache, "dtype", None) == "auto":
            ec.cache.dtype = "bf16"
        # and the linears' packed weights too (fp32 products of bf16-rounded weights: more precise than the
        # bf16 model `auto` runs on CPUs with native bf16): half the bytes a step streams, 1.6-1.8x the
        # fp32 copy's speed at 1-4 rows on a 2-core Zen 3 (servelab_kernels/fp32_linear.py), batch-1 decode
        # 1.48-1.57x, 64-row steps unchanged (compute-bound); perplexity 17.571 against 17.539
        # (reports/bf16-weights-*-zen3, reports/quant-eval-bf16-weights-zen3)
        if ec.model.dtype == "fp32" and getattr(ec.backend, "fp32_linear_weights", None) == "auto" and \
                not simulated and fp32_tiles(resolve_device(ec.model.device)):
            ec.backend.fp32_linear_weights = "bf16"


def describe_dtype(ec: EngineConfig, device: torch.device) -> str | None:
    """A line for the engine's start-up log when fp32 runs because the CPU lacks native bf16 (said
    once the config is valid, beside the KV pool, so that a config error stays one line)."""
    if ec.model.dtype == "fp32" and device.type == "cpu" and not native_bf16(device):
        stored = []  # (what, the key that keeps it fp32)
        if fp32_tiles(device) and getattr(ec.backend, "fp32_linear_weights", None) == "bf16":
            stored.append(("linear weights", "backend.fp32_linear_weights"))
        if getattr(ec.cache, "dtype", None) == "bf16":
            stored.append(("KV cache", "cache.dtype"))
        kv = (f" ({' and '.join(w for w, _ in stored)} stored in bf16; fp32 with "
              f"{', '.join(f'{k}=fp32' for _, k in stored)})") if stored else ""
        return f"model: fp32, as this CPU has no native bf16 (AVX512-BF16 or AMX); model.dtype=auto takes it here{kv}"
    return None
