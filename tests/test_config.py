"""Hydra composition into typed dataclasses."""

import pytest
import torch

from core.config import EngineConfig, SchedulerConfig
from core.config.compose import compose
from core.engine import defaults
from core.engine.components import engine_config
from core.engine.defaults import native_bf16
from core.errors import ConfigError
from plugins.cache.paged import PagedCacheConfig
from plugins.schedulers.continuous import ContinuousSchedulerConfig


def test_defaults_compose_to_typed_dataclasses():
    ec = engine_config(compose([]))
    assert isinstance(ec, EngineConfig) and isinstance(ec.scheduler, SchedulerConfig)
    assert (ec.model.name, ec.scheduler.name, ec.cache.name, ec.quant.name, ec.decoder.name, ec.backend.name) == (
        "smollm2-135m", "continuous", "paged", "none", "sampling", "torch")
    assert ec.model.path is None and ec.model.dtype == ("bf16" if native_bf16(torch.device("cpu")) else "fp32")


def test_overrides_reach_the_plugins_own_dataclasses():
    ec = engine_config(compose(["scheduler.max_num_seqs=3", "model.dtype=fp32", "scheduler.aging_steps=9",
                                "cache.block_size=32"]))
    assert ec.scheduler.max_num_seqs == 3 and ec.model.dtype == "fp32"
    # each plugin's section is its own dataclass, with its own keys typed
    assert isinstance(ec.scheduler, ContinuousSchedulerConfig) and ec.scheduler.aging_steps == 9
    assert isinstance(ec.cache, PagedCacheConfig) and ec.cache.block_size == 32


def test_an_unknown_plugin_key_is_rejected_with_the_valid_keys():
    with pytest.raises(ConfigError) as e:
        engine_config(compose(["+scheduler.agin_steps=9"]))
    msg = str(e.value)
    assert "scheduler 'continuous': unknown key 'agin_steps'" in msg and "aging_steps" in msg and "\n" not in msg
    # a key of the continuous scheduler means nothing to the static one
    with pytest.raises(ConfigError, match="scheduler 'static': unknown key 'aging_steps'; valid keys: name, "
                                          "max_num_seqs, max_num_batched_tokens"):
        engine_config(compose(["scheduler=static", "+scheduler.aging_steps=9"]))
    with pytest.raises(ConfigError, match="cache.block_size|unknown key 'block_size'"):
        engine_config(compose(["cache=contiguous", "+cache.block_size=8"]))


def test_a_type_error_names_the_key():
    with pytest.raises(ConfigError, match="aging_steps"):
        engine_config(compose(["scheduler.aging_steps=many"]))


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="model.dtype must be auto, fp32 or bf16, got 'fp8'"):
        engine_config(compose(["model.dtype=fp8"]))
    with pytest.raises(ConfigError, match="max_num_seqs must be positive"):
        engine_config(compose(["scheduler.max_num_seqs=0"]))


def test_unknown_group_value_names_the_choices():
    with pytest.raises(ConfigError, match="unknown backend 'jax'; available: simulator, torch"):
        engine_config(compose(["backend=jax"]))
    with pytest.raises(ConfigError, match="'hf' is a benchmark peer, not a backend: use peer=hf"):
        engine_config(compose(["backend=hf"]))


def test_a_component_chosen_by_name_keeps_only_the_common_and_given_keys():
    cfg = compose(["scheduler=sjf", "scheduler.max_wait_batches=2", "scheduler.max_num_seqs=3"])
    assert dict(cfg.scheduler) == {"name": "sjf", "max_num_seqs": 3, "max_num_batched_tokens": None,
                                   "max_wait_batches": 2}  # engine_config fills it per device


@pytest.mark.parametrize("overrides, budget", [
    ([], 128),  # the engine on this machine's CPU
    (["model.device=cpu", "scheduler=slo"], 1024),  # slo sizes its own steps; 1024 is only its cap
    (["backend=simulator", "hardware=h100-80gb", "model=llama-3.1-8b"], 1024),  # a simulated GPU
    (["scheduler.max_num_batched_tokens=512"], 512),  # a value given wins on any device
    (["scheduler=static"], 8192),
])
def test_the_step_budget_defaults_per_device(overrides, budget):
    assert engine_config(compose(overrides)).scheduler.max_num_batched_tokens == budget


@pytest.mark.parametrize("overrides, block_size", [
    ([], 64),  # the engine on this machine's CPU: longer contiguous runs per block for the decode kernel
    (["backend=simulator", "hardware=h100-80gb", "model=llama-3.1-8b"], 16),  # a simulated GPU
    (["cache.block_size=32"], 32),  # a value given wins
])
def test_the_kv_block_size_defaults_per_device(overrides, block_size):
    assert engine_config(compose(overrides)).cache.block_size == block_size


def test_an_allocator_built_in_code_takes_the_device_s_block_size():
    from core.api import KVCacheSpec
    from plugins.cache.paged import PagedAllocator, PagedCacheConfig

    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32, max_model_len=256)
    assert PagedAllocator(PagedCacheConfig(name="paged", memory_gb=0.001), spec, 4).block_size == 64
    with pytest.raises(ConfigError, match="cache.block_size must be positive, got 0"):
        PagedAllocator(PagedCacheConfig(name="paged", memory_gb=0.001, block_size=0), spec, 4)


def test_a_simulated_cpu_gets_the_cpu_step_budget():
    from dataclasses import replace

    from core.engine.defaults import default_step_budget
    from core.engine.hardware import HardwareProfile

    ec = engine_config(compose(["backend=simulator", "hardware=a100-80gb", "model=llama-3.1-8b"]))
    assert default_step_budget(ec, simulated=True) == 1024
    cpu = HardwareProfile(name="cpu", bf16_tflops=0.9, memory_bandwidth_gbs=50, memory_gb=24)
    assert default_step_budget(replace(ec, hardware=cpu), simulated=True) == 128


@pytest.mark.parametrize("flags, dtype", [({"avx2", "avx512f", "avx512_bf16"}, "bf16"), ({"avx2", "amx_bf16"}, "bf16"),
                                          ({"fp", "asimd", "bf16"}, "bf16"), ({"avx2", "fma"}, "fp32"), (set(), "fp32")])
def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it(monkeypatch, flags, dtype):
    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: flags)
    assert engine_config(compose(["model.device=cpu"])).model.dtype == dtype
    # a dtype the config names is kept whatever the CPU
    assert engine_config(compose(["model.device=cpu", "model.dtype=bf16"])).model.dtype == "bf16"


@pytest.mark.parametrize("overrides, cache_dtype", [([], "bf16"), (["model.dtype=fp32"], "auto"),
                                                    (["cache.dtype=fp32"], "fp32"), (["cache.dtype=int8"], "int8")])
def test_fp32_for_want_of_bf16_keeps_its_kv_cache_in_bf16(monkeypatch, overrides, cache_dtype):
    """model.dtype=auto taking fp32 (no native bf16) stores an auto cache in bf16; an fp32 model the
    config asks for keeps its cache in fp32 (auto), and a cache dtype the config names is kept."""
    from core.engine.components import kv_cache_spec
    from core.model.llama import ModelArgs

    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx2", "fma"})
    ec = engine_config(compose(["model.device=cpu", *overrides]))
    assert ec.model.dtype == "fp32" and ec.cache.dtype == cache_dtype
    # the linears' packed copies likewise: bf16 where auto took fp32, fp32 where the config named it
    assert ec.backend.fp32_linear_weights == ("auto" if "model.dtype=fp32" in overrides else "bf16")
    args = ModelArgs(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16)
    want = {"bf16": torch.bfloat16, "auto": torch.float32, "fp32": torch.float32, "int8": torch.int8}[cache_dtype]
    assert kv_cache_spec(ec, args).dtype == want
    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx512_bf16"})
    native = engine_config(compose(["model.device=cpu"]))
    assert native.model.dtype == "bf16" and native.cache.dtype == "auto"  # the cache follows a bf16 model
    assert native.backend.fp32_linear_weights == "auto"
    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx2", "fma"})
    named = engine_config(compose(["model.device=cpu", "backend.fp32_linear_weights=fp32"]))
    assert named.model.dtype == "fp32" and named.backend.fp32_linear_weights == "fp32"  # named: kept
    # AVX-512 without bf16 (Skylake to Ice Lake servers): fp32 and a bf16 cache, but oneDNN's kernels take
    # the linears there, over fp32 weights: no bf16 copy is claimed
    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx2", "fma", "avx512f"})
    skx = engine_config(compose(["model.device=cpu"]))
    assert (skx.model.dtype, skx.cache.dtype, skx.backend.fp32_linear_weights) == ("fp32", "bf16", "auto")


def test_fp32_for_want_of_bf16_is_said_at_engine_start_not_while_validating(monkeypatch, tiny_llama, caplog):
    """The reason is logged beside the KV pool once the engine builds: a config error before that
    stays the one line the CLI promises."""
    import logging
    from dataclasses import replace

    from core.engine.engine import Engine

    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx2", "fma"})
    with caplog.at_level(logging.INFO, logger="servelab"):
        ec = engine_config(compose(["model.device=cpu", f"model.path={tiny_llama}", "model.max_model_len=64"]))
        assert ec.model.dtype == "fp32" and caplog.text == ""
        Engine(ec)
    assert "model: fp32, as this CPU has no native bf16" in caplog.text
    assert ("(linear weights and KV cache stored in bf16; fp32 with backend.fp32_linear_weights=fp32, "
            "cache.dtype=fp32)") in caplog.text
    # where oneDNN's kernels take fp32 linears (AVX-512), a bf16 copy named in the config is not claimed
    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx2", "fma", "avx512f"})
    assert defaults.describe_dtype(ec, torch.device("cpu")).endswith(
        "(KV cache stored in bf16; fp32 with cache.dtype=fp32)")
    assert defaults.describe_dtype(replace(ec, model=replace(ec.model, dtype="bf16")), torch.device("cpu")) is None
    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx512_bf16"})
    assert defaults.describe_dtype(ec, torch.device("cpu")) is None  # fp32 asked for where bf16 is native


def test_auto_dtype_of_a_simulated_gpu_is_bf16(monkeypatch):
    monkeypatch.setattr(defaults, "cpu_feature_flags", lambda: {"avx2"})
    ec = engine_config(compose(["backend=simulator", "hardware=a100-80gb", "model=llama-3.1-8b"]))
    assert ec.model.dtype == "bf16"


def test_cpu_feature_flags_are_read_from_cpuinfo():
    flags = defaults.cpu_feature_flags()
    text = open("/proc/cpuinfo").read()
    assert flags and all(f in text for f in flags)


@pytest.mark.parametrize("value", ["fp16", "fp8"])
def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices(value):
    with pytest.raises(ConfigError, match=f"cache.dtype must be auto, fp32, bf16 or int8, got '{value}'"):
        engine_config(compose([f"cache.dtype={value}"]))


@pytest.mark.parametrize("cache, model, want", [("auto", "fp32", torch.float32), ("bf16", "fp32", torch.bfloat16),
                                                ("fp32", "bf16", torch.float32), ("int8", "bf16", torch.int8)])
def test_the_kv_cache_dtype_is_the_models_unless_named(cache, model, want):
    from core.engine.components import kv_cache_spec
    from core.model.llama import ModelArgs

    ec = engine_config(compose([f"cache.dtype={cache}", f"model.dtype={model}"]))
    spec = kv_cache_spec(ec, ModelArgs(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                                       num_heads=4, num_kv_heads=2, head_dim=16))
    assert spec.dtype == want
