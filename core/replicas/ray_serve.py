"""`serve parallel.replicas=N`: N servelab engines as Ray Serve replicas behind one OpenAI ingress.

Ray Serve does the cluster work (placing replicas, restarting dead ones, autoscaling between
`parallel.min_replicas` and `max_replicas`, routing through a request router); servelab brings
the engine, the OpenAI protocol and the prefix-affinity router. A local Ray instance is started
unless `parallel.ray_address` names a cluster (every node needs servelab installed).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from omegaconf import DictConfig, OmegaConf

from core.config.schema import ParallelConfig, section
from core.errors import ConfigError

log = logging.getLogger("servelab")

ROUTERS = {"prefix": "core.replicas.ray_router.PrefixAffinityRouter", "pow2": None}  # None: Ray's default
APP = "servelab"


def uses_ray(pc: ParallelConfig) -> bool:
    return pc.replicas > 1 or pc.ray_address is not None or pc.max_replicas is not None


def check_replicas(pc: ParallelConfig, command: str) -> None:
    """Every replica setting in one line each, before anything starts."""
    bounded = (pc.min_replicas is None) == (pc.max_replicas is None)
    checks = [
        (pc.replicas >= 1, f"parallel.replicas must be at least 1, got {pc.replicas}"),
        (bounded, "parallel.min_replicas and parallel.max_replicas are set together (autoscaling bounds)"),
        (not bounded or pc.min_replicas is None or 1 <= pc.min_replicas <= pc.replicas <= pc.max_replicas,
         f"autoscaling needs 1 <= parallel.min_replicas <= parallel.replicas <= parallel.max_replicas, got "
         f"{pc.min_replicas} <= {pc.replicas} <= {pc.max_replicas}"),
        (pc.router in ROUTERS or "." in pc.router,
         f"parallel.router={pc.router!r}: use prefix, pow2 or a RequestRouter class path (module.Class)"),
        (pc.router_block_chars >= 1, f"parallel.router_block_chars must be at least 1, got {pc.router_block_chars}"),
        (pc.router_max_imbalance >= 1, f"parallel.router_max_imbalance must be at least 1, got {pc.router_max_imbalance}"),
        (pc.target_ongoing_requests > 0, "parallel.target_ongoing_requests must be positive"),
        (pc.max_ongoing_requests >= 1, f"parallel.max_ongoing_requests must be at least 1, got {pc.max_ongoing_requests}"),
        (pc.replica_cpus is None or pc.replica_cpus > 0, f"parallel.replica_cpus must be positive, got {pc.replica_cpus}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if uses_ray(pc) and command not in ("serve", "bench"):
        raise ConfigError(f"parallel.replicas={pc.replicas} deploys replicas behind `serve` (and `bench`, which starts "
                          f"it); `{command}` drives one engine")
    if uses_ray(pc):
        require_ray(pc)


def require_ray(pc: ParallelConfig) -> None:
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        raise ConfigError(f"parallel.replicas={pc.replicas} runs on Ray Serve, which is not installed: "
                          "pip install 'servelab[ray]'") from None


def replica_cpus(pc: ParallelConfig) -> float:
    """Ray CPUs per replica: as set, or this machine's cores shared by as many replicas as there may be
    (the autoscaling ceiling too, or Ray could never place the replicas it scales up to)."""
    return pc.replica_cpus or max(1, (os.cpu_count() or 1) // (pc.max_replicas or pc.replicas))


def replica_options(pc: ParallelConfig, cuda: bool) -> dict:
    """The engine deployment's Ray Serve options."""
    opts = {
        "max_ongoing_requests": pc.max_ongoing_requests,
        "health_check_period_s": 2.0,  # a dead replica is noticed (and replaced) within seconds
        "health_check_timeout_s": 60.0,
        "graceful_shutdown_timeout_s": 10.0,
        "ray_actor_options": {"num_cpus": replica_cpus(pc), "num_gpus": pc.tensor_parallel_size if cuda else 0},
        "logging_config": {"log_level": "WARNING", "enable_access_log": False},
    }
    if pc.max_replicas is not None:
        opts["autoscaling_config"] = {"min_replicas": pc.min_replicas, "max_replicas": pc.max_replicas,
                                      "initial_replicas": pc.replicas,
                                      "target_ongoing_requests": pc.target_ongoing_requests}
    else:
        opts["num_replicas"] = pc.replicas
    router = ROUTERS.get(pc.router, pc.router)
    if router is not None:
        kwargs = {"block_chars": pc.router_block_chars, "max_imbalance": pc.router_max_imbalance} \
            if pc.router == "prefix" else {}
        opts["request_router_config"] = {"request_router_class": router, "request_router_kwargs": kwargs}
    return opts


def build_app(cfg: DictConfig, overrides: list[str]):
    from core.engine.components import engine_config, resolve_device
    from core.replicas.ray_app import OpenAIIngress, ServelabReplica

    ec = engine_config(cfg)
    pc = ec.parallel
    if not any(o.startswith("backend.num_threads=") for o in overrides):
        overrides = [*overrides, f"backend.num_threads={max(1, int(replica_cpus(pc)))}"]  # replicas share the cores
    replica = ServelabReplica.options(**replica_options(pc, resolve_device(ec.model.device).type == "cuda"))
    ingress = OpenAIIngress.options(max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0},
                                    logging_config={"log_level": "WARNING", "enable_access_log": False})
    container = OmegaConf.to_container(cfg, resolve=True)
    return ingress.bind(replica.bind(container, overrides, pc.ray_address is not None), pc.router, pc.replicas)


def serve_replicas(cfg: DictConfig, overrides: list[str]) -> int:
    """Start (or join) Ray, deploy, serve until SIGINT/SIGTERM, then take the application down."""
    import ray
    from ray import serve

    from core.replicas.ray_app import board
    from core.server.config import ServerConfig

    pc = section(ParallelConfig, cfg.get("parallel"), "parallel")
    sc = section(ServerConfig, cfg.get("server"), "server")
    check_replicas(pc, "serve")
    app = build_app(cfg, overrides)
    ray.init(address=pc.ray_address, namespace="servelab", include_dashboard=False, log_to_driver=True,
             logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    owned = board()  # noqa: F841 (held: the board lives as long as this process)
    try:
        serve.start(http_options={"host": sc.host, "port": sc.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        serve.run(app, name=APP, route_prefix="/")
        scale = (f"{pc.replicas} (autoscaling {pc.min_replicas}..{pc.max_replicas})" if pc.max_replicas is not None
                 else str(pc.replicas))
        log.info("serving %s replicas on Ray Serve (router=%s) at http://%s:%d", scale, pc.router, sc.host, sc.port)
        stop.wait()
    finally:
        if pc.ray_address is None:
            serve.shutdown()
        else:  # a shared cluster: take down only this application
            serve.delete(APP)
        ray.shutdown()
    return 0
