"""Configuration: typed dataclasses (schema) and Hydra composition (compose)."""

from core.config.compose import compose, expand_sweeps
from core.config.schema import (
    BASE_CONFIGS,
    COMPONENT_KINDS,
    ENGINE_KINDS,
    AttentionConfig,
    BackendConfig,
    CacheConfig,
    DecoderConfig,
    EngineConfig,
    ModelConfig,
    PeerConfig,
    QuantConfig,
    RunConfig,
    SchedulerConfig,
    run_config,
    section,
)

__all__ = [
    "BASE_CONFIGS", "COMPONENT_KINDS", "ENGINE_KINDS", "AttentionConfig", "BackendConfig", "CacheConfig",
    "DecoderConfig", "EngineConfig", "ModelConfig", "PeerConfig", "QuantConfig", "RunConfig", "SchedulerConfig",
    "compose", "expand_sweeps", "run_config", "section",
]
