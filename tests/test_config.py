"""Hydra composition into typed dataclasses."""

import pytest

from core.cli import compose
from core.config import EngineConfig, SchedulerConfig, engine_config
from core.errors import ConfigError


def test_defaults_compose_to_typed_dataclasses():
    ec = engine_config(compose([]))
    assert isinstance(ec, EngineConfig) and isinstance(ec.scheduler, SchedulerConfig)
    assert (ec.model.name, ec.scheduler.name, ec.cache.name, ec.quant.name, ec.decoder.name, ec.backend.name) == (
        "smollm2-135m", "continuous", "paged", "none", "sampling", "torch")
    assert ec.model.path is None and ec.model.dtype == "bf16"


def test_overrides_reach_the_dataclasses():
    ec = engine_config(compose(["scheduler.max_num_seqs=3", "model.dtype=fp32", "+scheduler.my_knob=7",
                                "scheduler.aging_steps=9"]))
    assert ec.scheduler.max_num_seqs == 3 and ec.model.dtype == "fp32"
    # plugin-specific keys arrive in `extra`
    assert ec.scheduler.extra["my_knob"] == 7 and ec.scheduler.extra["aging_steps"] == 9


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="model.dtype"):
        engine_config(compose(["model.dtype=fp8"]))
    with pytest.raises(ConfigError, match="max_num_seqs must be positive"):
        engine_config(compose(["scheduler.max_num_seqs=0"]))


def test_unknown_group_value_names_the_choices():
    with pytest.raises(ConfigError, match="unknown backend 'jax'; available: .*torch"):
        compose(["backend=jax"])
