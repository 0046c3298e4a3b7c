"""The ranks of a tensor-parallel engine: starting them, feeding them each step, stopping them.

Rank 0 is the engine: its scheduler and allocator decide each step, and `DistributedBackend`
broadcasts every backend call (the step's inputs, block copies, the KV pool's size) to the other
ranks before running its own shard, so all ranks enter the model's collectives together. The
other ranks run `worker_loop`: the same model load, slice and quantization, their shard of the
KV cache, and the calls they are sent. The ranks are either started by the engine
(torch.multiprocessing, spawn) or by torchrun (`RANK`/`WORLD_SIZE` in the environment: rank 0 runs
the command, the others `python -m core` sends to `worker_loop`), multi-node included.

A rank that dies breaks the process group's connections: the next collective fails on rank 0,
which names the dead rank and stops (RankDiedError), never waits; a worker whose rank 0 died
exits the same way.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import signal
import socket
import sys
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from core.errors import ConfigError, ServelabError
from core.parallel.tensor_parallel import STATS, Shard, connect_model, plan_shard, slice_model

log = logging.getLogger("servelab")


class RankDiedError(ServelabError):
    """A tensor-parallel rank is gone: the engine cannot run another step."""


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_parallel(config) -> None:
    """What tensor parallelism cannot serve, said before anything loads."""
    pc, world = config.parallel, config.parallel.tensor_parallel_size
    if world < 1:
        raise ConfigError(f"parallel.tensor_parallel_size must be at least 1, got {world}")
    if world == 1:
        return
    if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) != world:
        raise ConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes; parallel.tensor_parallel_size is "
                          f"{world}")
    if pc.distributed_backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"parallel.distributed_backend must be auto, gloo or nccl, got '{pc.distributed_backend}'")
    if config.quant.name == "gguf":
        raise ConfigError("quant=gguf does not shard over tensor-parallel ranks yet: use quant=int8 or int4")
    if config.quant.name == "int4" and getattr(config.quant, "awq", False):
        raise ConfigError("quant.awq=true calibrates on the whole model; with tensor_parallel_size > 1 use awq=false")
    if getattr(config.decoder, "method", None) == "self":
        raise ConfigError("decoder.method=self drafts with the sharded target on rank 0 alone: use ngram or draft")
    if getattr(config.backend, "compile", False) or getattr(config.backend, "cuda_graphs", None):
        raise ConfigError("backend.compile and backend.cuda_graphs are not supported with tensor_parallel_size > 1")


def check_int4_groups(args, world: int, group_size: int) -> None:
    """An INT4 group must not straddle two ranks, or the shards would not be the full quantization."""
    for r in range(world):
        s = plan_shard(args, r, world)
        for name, start, length, full in (("attention heads", s.q0 * args.head_dim, s.nq * args.head_dim,
                                           args.num_heads * args.head_dim),
                                          ("intermediate size", s.i0, s.ni, args.intermediate_size)):
            if start % group_size or ((start + length) % group_size and start + length != full):
                raise ConfigError(f"quant.group_size={group_size} splits a group of the {name} between ranks at "
                                  f"tensor_parallel_size={world}: pick a group size that divides each rank's share")


def shard_model(model, quantizer, config, rank: int, world: int) -> tuple[torch.nn.Module, Shard]:
    """The full model -> this rank's quantized, connected shard."""
    shard = plan_shard(model.args, rank, world)
    slice_model(model, shard)
    model = quantizer.quantize(model)
    connect_model(model, shard)
    return model, shard


def local_spec(spec, shard: Shard):
    from dataclasses import replace

    return replace(spec, num_kv_heads=shard.nkv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend_name(config) -> str:
    name = config.parallel.distributed_backend
    return ("nccl" if torch.cuda.is_available() and config.model.device != "cpu" else "gloo") if name == "auto" else name


def init_group(config, rank: int, world: int, init_method: str) -> None:
    dist.init_process_group(_backend_name(config), init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=config.parallel.timeout_s))


class Workers:
    """Rank 0's handle on the other ranks: started here, or by torchrun."""

    def __init__(self, config, build) -> None:
        world = config.parallel.tensor_parallel_size
        self.procs: list = []
        if launched_by_torchrun():
            init_group(config, 0, world, "env://")
            return
        init = f"tcp://127.0.0.1:{config.parallel.master_port or _free_port()}"
        threads = max(1, (os.cpu_count() or 1) // world)
        ctx = mp.get_context("spawn")
        for r in range(1, world):
            p = ctx.Process(target=worker_main, args=(build, config, r, world, init, threads), daemon=True,
                            name=f"servelab-tp{r}")
            p.start()
            self.procs.append(p)
        torch.set_num_threads(threads)
        starting = threading.Event()
        threading.Thread(target=self._watch_start, args=(starting,), daemon=True).start()
        try:
            init_group(config, 0, world, init)
        finally:
            starting.set()

    def _watch_start(self, done: threading.Event) -> None:
        """While rank 0 waits for the others to join (an uninterruptible wait), a rank that dies ends it."""
        while not done.wait(0.2):
            dead = self.dead()
            if dead:
                print(f"error: {dead} while starting; the engine stops", file=sys.stderr, flush=True)
                os._exit(2)

    def dead(self) -> str | None:
        """Which started rank has exited, and how."""
        for r, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exited with code {p.exitcode}"
                return f"tensor-parallel rank {r} (pid {p.pid}) {how}"
        return None

    def wait_dead(self, seconds: float) -> str | None:
        for p in self.procs:
            p.join(seconds / max(1, len(self.procs)))
        return self.dead()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to leave (terminate the stragglers) and leave the process group."""
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(config, args, build) -> Workers:
    """Rank 0 starts (or, under torchrun, meets) the others, after the checks that need the model's shape."""
    if config.quant.name == "int4":
        check_int4_groups(args, config.parallel.tensor_parallel_size, config.quant.group_size)
    plan_shard(args, 0, config.parallel.tensor_parallel_size)
    return Workers(config, build)


class DistributedBackend:
    """Rank 0's backend: every call goes to all ranks, then to its own shard."""

    def __init__(self, inner, workers: Workers) -> None:
        self.inner, self.workers, self.closed = inner, workers, False
        self.comm = STATS
        atexit.register(self.close)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _call(self, method: str, *args):
        try:
            dist.broadcast_object_list([(method, args)], src=0)
            return getattr(self.inner, method)(*args)
        except (RuntimeError, dist.DistBackendError) as e:
            dead = self.workers.wait_dead(2.0)  # a killed process's exit can trail its broken sockets
            if dead is None and not isinstance(e, dist.DistBackendError) and "onnection" not in str(e):
                raise  # not the process group's failure
            cause = str(e).splitlines()[0][:160]
        # Outside the except block: the failed collective's traceback (whose frames hold the process
        # group) is released, so the broken group is torn down here and now. Kept alive as the new
        # error's __context__, it was torn down at interpreter exit instead, where gloo can abort.
        self.closed = True
        self.workers.shutdown(timeout=1.0)
        gc.collect()
        raise RankDiedError(f"{dead or 'a tensor-parallel rank stopped answering'}; the engine stops ({cause})")

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._call("init_kv_cache", num_blocks, block_size)

    def copy_blocks(self, copies) -> None:
        if copies:
            self._call("copy_blocks", copies)

    def execute(self, batch):
        return self._call("execute", batch)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            dist.broadcast_object_list([("stop", ())], src=0)
        except (RuntimeError, dist.DistBackendError):
            pass
        self.workers.shutdown()


def worker_loop(build, config, rank: int, world: int) -> None:
    backend = build(config, rank, world)
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        method, args = msg[0]
        if method == "stop":
            return
        getattr(backend, method)(*args)


def worker_main(build, config, rank: int, world: int, init_method: str, threads: int | None = None) -> None:
    """A worker rank's whole life; any failure (rank 0 gone included) ends it with one line.
    `build(config, rank, world)` makes its backend (core.engine.components.build_worker_backend)."""
    if threads:
        torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is rank 0's to handle: it stops the ranks
    try:
        init_group(config, rank, world, init_method)
        worker_loop(build, config, rank, world)
    except (RuntimeError, dist.DistBackendError, ServelabError) as e:
        print(f"servelab: tensor-parallel rank {rank} stops: {str(e).splitlines()[0][:200]}", file=sys.stderr)
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
