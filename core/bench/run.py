"""`python -m core run` and `compare`: drive a workload through the engine (or a peer) and report."""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from core.bench import report
from core.bench.driver import drive_engine, progress_bar, slo_targets, warm_up, workload_config
from core.bench.roofline import CostModel, machine_rates, weight_bytes
from core.bench.summary import summarize
from core.config.compose import compose
from core.config.schema import EngineConfig, PeerConfig, RunConfig, run_config
from core.engine.components import (
    engine_config,
    model_args,
    model_tokenizer,
    require_shedding,
    resolve_device,
    resolve_model_path,
)
from core.engine.engine import Engine
from core.engine.interfaces import has_capability
from core.engine.registry import get_registry
from core.engine.types import KVCacheSpec
from core.model.loader import DTYPES
from scenarios.workloads import WorkloadConfig, build_workload, materialize


@dataclass
class Measured:
    """What one run produced, engine or peer alike."""

    records: list[dict]
    steps: list[dict]
    duration_s: float
    args: object  # the model's ModelArgs
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache: str
    workload: object
    rejected: list[dict] = field(default_factory=list)
    is_peer: bool = False
    step_cost: dict | None = None  # the engine's online step-cost model at the end of the run
    simulated: dict | None = None  # backend=simulator: the hardware and the simulated time by part
    parallel: dict | None = None  # tensor parallel: ranks and the collectives' share of step time


def peer_config(cfg: DictConfig) -> PeerConfig | None:
    node = cfg.get("peer")
    return None if node is None else get_registry().config("peer", node)


def default_run_name(ec: EngineConfig, wc: WorkloadConfig, peer: PeerConfig | None) -> str:
    system = f"peer_{peer.name}" if peer else f"{ec.scheduler.name}-{ec.cache.name}-{ec.quant.name}-{ec.backend.name}"
    if not peer and ec.parallel.tensor_parallel_size > 1:
        system += f"-tp{ec.parallel.tensor_parallel_size}"
    if not peer and ec.decoder.name != "sampling":  # e.g. speculative-ngram: a run that decodes differently says so
        system += f"-{ec.decoder.name}" + (f"-{ec.decoder.method}" if hasattr(ec.decoder, "method") else "")
    return f"{wc.name}-{system}-{ec.model.dtype}"


def measure_engine(ec: EngineConfig, wc: WorkloadConfig, rc: RunConfig) -> Measured:
    workload = build_workload(wc, ec.model.max_model_len)  # a bad workload fails before the model loads
    engine = Engine(ec)
    materialize(workload, engine.tokenizer)
    warm_up(engine, rc.warmup_requests)
    base = engine.allocator.stats()
    comm = getattr(engine.backend, "comm", None)  # tensor parallel: rank 0's time in collectives
    comm0 = (comm.seconds, comm.calls) if comm else None
    records, steps, duration, rejected = drive_engine(engine, workload, rc.progress, slo_targets(wc, rc), rc.shed)
    parallel = None
    if comm:
        spent = comm.seconds - comm0[0]
        parallel = {"tensor_parallel_size": ec.parallel.tensor_parallel_size, "collective_s": spent,
                    "collective_calls": comm.calls - comm0[1],
                    "collective_share": spent / max(sum(st["duration_s"] for st in steps), 1e-9)}
    engine.close()
    for s in steps:  # counters are cumulative: count this run only
        s["prefix_queries"] -= base.prefix_queries
        s["prefix_hits"] -= base.prefix_hits
    kv = engine.allocator.describe() if has_capability(engine.allocator, "describe") else ""
    simulated = simulation_summary(engine.backend) if engine.model is None else None
    return Measured(records, steps, duration, engine.loaded.args,
                    engine.backend.weight_bytes if simulated else weight_bytes(engine.model),
                    engine.kv_spec.bytes_per_token, kv, workload, rejected,
                    step_cost=engine.core.context.cost_model.to_dict(), simulated=simulated, parallel=parallel)


def simulation_summary(backend) -> dict:
    spent = dataclasses.asdict(backend.spent)
    total = sum(spent.values()) or 1.0
    return {"hardware": dataclasses.asdict(backend.hardware), "describe": backend.describe(),
            "tensor_parallel_size": backend.config.tensor_parallel_size, "compute": backend.config.compute,
            "time_by_part_s": spent, "share_by_part": {k: v / total for k, v in spent.items()}}


def simulated_rates(ec: EngineConfig) -> dict:
    """The roofline section's rates for a simulated run: the profile's, over all its ranks."""
    hw, tp = ec.hardware, ec.backend.tensor_parallel_size
    peak = hw.peak_flops(ec.backend.compute) / 1e9 * tp
    return {"cpu": f"{hw.name} x {tp} (simulated)", "cores": None, "torch_threads": None, "torch": torch.__version__,
            "platform": "simulated", "measured_at": None, "device": f"{hw.name} x {tp} (simulated)",
            "device_type": "simulated", "cuda": None, "matmul_gflops": {"bf16": peak, "fp32": peak},
            "mem_bandwidth_gbs": hw.memory_bandwidth_gbs * tp}


def measure_peer(ec: EngineConfig, wc: WorkloadConfig, pc: PeerConfig, warmup: int, progress: bool) -> Measured:
    path = resolve_model_path(ec)
    args = model_args(ec)  # the geometry, for the roofline
    tokenizer = model_tokenizer(ec)
    workload = build_workload(wc, ec.model.max_model_len)
    materialize(workload, tokenizer)
    peer = get_registry().create("peer", pc)
    peer.load(ec.model, path, resolve_device(ec.model.device))
    pad = tokenizer.eos_token_id or 0
    if warmup:
        peer.warm_up(workload.requests, ec.scheduler.max_num_seqs, pad, warmup)
    bar = progress_bar(len(workload.requests), wc.name, progress)
    t0 = time.perf_counter()
    records, steps = peer.run(workload.requests, ec.scheduler.max_num_seqs, pad, progress=bar)
    duration = time.perf_counter() - t0
    bar.close()
    kv = KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, DTYPES[ec.model.dtype], ec.model.max_model_len)
    return Measured(records, steps, duration, args, peer.weight_bytes(), kv.bytes_per_token, peer.describe(),
                    workload, is_peer=True)


def roofline(m: Measured, summary: dict, dtype: str, rates: dict) -> dict:
    peak = rates["matmul_gflops"]["bf16" if dtype == "bf16" else "fp32"]
    cost = CostModel(m.args, m.weight_bytes, m.kv_bytes_per_token, peak, rates["mem_bandwidth_gbs"])
    floor = cost.workload_floor([r["num_prompt_tokens"] for r in m.records], [r["num_output_tokens"] for r in m.records])
    return {
        "peak_gflops": peak, "mem_bandwidth_gbs": rates["mem_bandwidth_gbs"], "weight_bytes": m.weight_bytes,
        "workload_floor": floor, "schedule_floor": None if m.is_peer else cost.schedule_floor(m.steps),
        "fraction_of_roofline": floor["time_s"] / m.duration_s if m.duration_s > 0 else 0.0,
        "roofline_total_tok_s": (summary["prompt_tokens"] + summary["output_tokens"]) / floor["time_s"]
        if floor["time_s"] > 0 else None,
    }


def check(cfg: DictConfig) -> tuple:
    """Every section of a run's config, checked before any model loads."""
    ec, rc, wc, pc = engine_config(cfg), run_config(cfg), workload_config(cfg), peer_config(cfg)
    if rc.shed and not pc:
        require_shedding(ec, "run.shed=true")
    return ec, rc, wc, pc


def run_one(cfg: DictConfig, label: str | None = None) -> dict:
    """Build, warm up, run one configuration on its workload; returns the report dict."""
    ec, rc, wc, pc = check(cfg)
    rates = simulated_rates(ec) if ec.hardware is not None and not pc else \
        machine_rates(rc.remeasure_machine, resolve_device(ec.model.device))
    m = measure_peer(ec, wc, pc, rc.warmup_requests, rc.progress) if pc else \
        measure_engine(ec, wc, rc)
    gc.collect()
    if torch.cuda.is_available():  # the next run (or peer) gets the device's memory back
        torch.cuda.empty_cache()
    summary = summarize(m.records, m.duration_s, m.steps, *slo_targets(wc, rc), num_rejected=len(m.rejected))
    if m.step_cost:
        summary["step_cost"] = m.step_cost
    if m.simulated:
        summary["simulated"] = m.simulated
    if m.parallel:
        summary["parallel"] = m.parallel
    args = m.args
    config = OmegaConf.to_container(cfg, resolve=True)
    if isinstance(config.get("scheduler"), dict):  # null in the config: the device's default, as it ran
        config["scheduler"]["max_num_batched_tokens"] = ec.scheduler.max_num_batched_tokens
    return {
        "label": label or default_run_name(ec, wc, pc),
        "config": config,
        "model": {"path": resolve_model_path(ec), "architecture": args.architecture, "dtype": ec.model.dtype,
                  "layers": args.num_layers, "hidden": args.hidden_size},
        "kv_cache": m.kv_cache,
        "machine": {k: rates.get(k) for k in ("cpu", "cores", "torch_threads", "torch", "platform", "measured_at",
                                              "device", "device_type", "cuda")},
        "workload": m.workload.describe(),
        "summary": summary,
        "roofline": roofline(m, summary, ec.model.dtype, rates),
        "requests": sorted(m.records, key=lambda r: int(r["request_id"])),
        "rejected": m.rejected,
        "steps": m.steps,
        "report_version": report.VERSION,
    }


def run_benchmark(cfg: DictConfig) -> int:
    rc = run_config(cfg)
    result = run_one(cfg)
    out_dir = report.write_run(result, rc.name or result["label"], rc)
    print(report.summary_table([result]))
    print(f"report: {out_dir / 'report.md'}")
    return 0


def compare(base_overrides: list[str], variants: list[list[str]], labels: list[str] | None, name: str | None) -> int:
    """Run each variant (base overrides + its own) on the same workload; one comparison report."""
    for var in variants:  # every variant checked before the first one runs
        check(compose(base_overrides + var))
    results = []
    for i, var in enumerate(variants):
        cfg = compose(base_overrides + var)
        label = labels[i] if labels and i < len(labels) else (" ".join(var) or "base")
        print(f"[{i + 1}/{len(variants)}] {label}")
        results.append(run_one(cfg, label))
        gc.collect()
    rc = run_config(compose(base_overrides + variants[0]))
    name = name or "compare-" + "-vs-".join(_slug(r["label"]) for r in results)
    out_dir = report.write_comparison(results, name, rc)
    print(report.summary_table(results))
    print(f"report: {out_dir / 'report.md'}")
    return 0


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s).strip("_")[:40]
