"""The checks every command runs on its configuration before it loads anything."""

from __future__ import annotations

from omegaconf import DictConfig

from core.config.schema import run_config


def check_before_loading(command: str, cfg: DictConfig) -> None:
    """Every value a command reads, checked before any model loads: a bad one costs a second, not a load."""
    from core.engine.components import engine_config
    from core.replicas.ray_serve import check_replicas

    ec = engine_config(cfg)  # plugins' own keys included
    run_config(cfg)
    check_replicas(ec.parallel, command)
    if command in ("run", "compare", "bench"):
        from core.bench.driver import workload_config
        from scenarios.workloads import build_workload

        build_workload(workload_config(cfg), ec.model.max_model_len)  # lengths and arrivals only: no text yet
    if command in ("serve", "bench"):
        from core.config.schema import section
        from core.server.config import ServerConfig, validate

        validate(section(ServerConfig, cfg.get("server"), "server"), cfg.server.served_model_name or ec.model.name)
