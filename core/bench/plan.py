"""`python -m core plan`: the seed's KV-cache arithmetic as a tool, and replicas for an SLO.

For a model (a conf/model preset, a Hugging Face directory or a GGUF file: model.path=...) on a
hardware profile (hardware=NAME), at the configured dtype, KV dtype and tensor-parallel size:

- KV bytes per token (2 x layers x KV heads x head_dim x bytes) and per request at max_model_len;
- the weights, and the KV budget: utilization x memory, less weights and activations (vLLM's
  gpu_memory_utilization arithmetic);
- concurrency: budget / per-request KV in theory, times a safety margin in the plan (the seed's
  "40 GB / 2 GB = 20 in theory, plan 15");
- the max_model_len that covers a percentile of a workload's request lengths (as recorded:
  length_scale=1), and the concurrency it buys;
- with plan.slo=true, the replicas needed to serve plan.rate requests/s with at least 90 % of them
  inside the workload's TTFT and TPOT targets, found by running backend=simulator with the real
  scheduler and allocator at rate / replicas until it holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from core.config.schema import EngineConfig, section
from core.engine.components import kv_cache_spec
from core.engine.hardware import StepTimeModel, weight_bytes_per_param
from core.errors import ConfigError
from core.model.loader import DTYPES
from core.runner.memory import activation_reserve


@dataclass
class PlanConfig:
    safety_margin: float = 0.75  # share of the theoretical concurrency to plan for (the seed: 20 -> 15)
    memory_utilization: float = 0.9  # vLLM's gpu_memory_utilization
    percentile: float = 0.99  # max_model_len to cover this share of the workload's request lengths
    slo: bool = False  # also find the replicas for `rate` at the workload's SLO targets (simulated)
    rate: float = 1.0  # requests per second all replicas together must serve
    max_replicas: int = 16
    num_requests: int = 200  # requests per simulated replica run
    report_dir: str = "reports"
    name: str | None = None  # reports/<name>/; None: plan-<model>-<hardware>


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: float) -> float:
    """The seed's formula per token: K and V, in every layer, for every KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def concurrency(budget_bytes: float, per_request_bytes: float, safety_margin: float) -> tuple[int, int]:
    """(requests that fit in theory, requests to plan for)."""
    theory = max(0, math.floor(budget_bytes / per_request_bytes))
    return theory, math.floor(theory * safety_margin)


def covering_length(lengths: list[int], percentile: float) -> tuple[int, int]:
    """(the percentile of the lengths, a max_model_len covering it: the next multiple of 1,024)."""
    p = int(math.ceil(np.quantile(np.asarray(lengths), percentile)))
    return p, 1024 * math.ceil(p / 1024)


def model_memory(ec: EngineConfig, args) -> dict:
    """Weights and KV per token as the engine would hold them (quantization and KV dtype included)."""
    bytes_per_param = weight_bytes_per_param(ec.quant.name, DTYPES[ec.model.dtype].itemsize)
    params = StepTimeModel.param_counts(args)["total"]
    spec = kv_cache_spec(ec, args)
    return {"parameters": params, "bytes_per_param": bytes_per_param, "weight_bytes": params * bytes_per_param,
            "kv_bytes_per_token": spec.bytes_per_token, "kv_dtype": str(spec.dtype).removeprefix("torch.")}


def make_plan(ec: EngineConfig, wc, pc: PlanConfig) -> dict:
    from core.engine.components import model_args
    from scenarios.workloads import build_workload

    hw = ec.hardware
    if hw is None:
        raise ConfigError("plan needs hardware=NAME (a100-80gb, h100-80gb, h200-141gb, l4, cpu)")
    args = model_args(ec)
    tp = getattr(ec.backend, "tensor_parallel_size", 1)
    mem = model_memory(ec, args)
    sc = ec.scheduler
    reserve = activation_reserve(args, sc.max_num_batched_tokens, sc.max_num_seqs)
    budget = pc.memory_utilization * hw.memory_gb * 1e9 * tp - mem["weight_bytes"] - reserve * tp
    per_request = mem["kv_bytes_per_token"] * ec.model.max_model_len
    theory, planned = concurrency(budget, per_request, pc.safety_margin)
    recorded = dataclasses.replace(wc, length_scale=1.0, num_requests=max(wc.num_requests, 1000))
    workload = build_workload(recorded, 1 << 24)  # lengths as recorded, not cut to the model
    lengths = [r.prompt_len + r.output_len for r in workload.requests]
    p_len, covering = covering_length(lengths, pc.percentile)
    theory_at, planned_at = concurrency(budget, mem["kv_bytes_per_token"] * covering, pc.safety_margin)
    return {
        "model": ec.model.name, "hardware": dataclasses.asdict(hw), "tensor_parallel_size": tp,
        "dtype": ec.model.dtype, "quant": ec.quant.name, **mem, "max_model_len": ec.model.max_model_len,
        "kv_bytes_per_request": per_request, "memory_bytes": hw.memory_gb * 1e9 * tp,
        "memory_utilization": pc.memory_utilization, "activation_reserve_bytes": reserve * tp,
        "kv_budget_bytes": budget, "max_concurrency": theory, "planned_concurrency": planned,
        "safety_margin": pc.safety_margin,
        "workload": {"name": wc.name, "percentile": pc.percentile, "length_at_percentile": p_len,
                     "covering_max_model_len": covering, "max_concurrency": theory_at,
                     "planned_concurrency": planned_at, "requests_sampled": len(lengths)},
    }


def plan_markdown(p: dict) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    hw, w = p["hardware"], p["workload"]
    rows = [
        ("KV per token", f"{p['kv_bytes_per_token']:,} B ({p['kv_dtype']})"),
        (f"KV per request at max_model_len {p['max_model_len']:,}", gb(p["kv_bytes_per_request"])),
        ("weights", f"{gb(p['weight_bytes'])} ({p['parameters'] / 1e9:.2f} B parameters x {p['bytes_per_param']:g} B)"),
        ("memory", f"{gb(p['memory_bytes'])} ({hw['name']} x {p['tensor_parallel_size']})"),
        (f"KV budget (x {p['memory_utilization']}, less weights and activations)", gb(p["kv_budget_bytes"])),
        ("requests at max_model_len: in theory / planned", f"{p['max_concurrency']} / {p['planned_concurrency']} "
         f"(safety margin {p['safety_margin']})"),
        (f"`{w['name']}` length at p{w['percentile'] * 100:g}", f"{w['length_at_percentile']:,} tokens"),
        ("max_model_len covering it", f"{w['covering_max_model_len']:,}"),
        ("requests at that max_model_len: in theory / planned", f"{w['max_concurrency']} / {w['planned_concurrency']}"),
    ]
    lines = [f"# Plan: {p['model']} ({p['dtype']}, quant={p['quant']}) on {hw['name']} x {p['tensor_parallel_size']}",
             "", "| quantity | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    if p["kv_budget_bytes"] <= 0:
        lines += ["", f"**Does not fit**: {gb(p['weight_bytes'])} of weights and the activations leave no KV memory "
                  f"in {p['memory_utilization']} x {gb(p['memory_bytes'])}: quantize, or raise "
                  "backend.tensor_parallel_size."]
    if p.get("slo"):
        s = p["slo"]
        lines += ["", f"## Replicas for {s['rate']:g} req/s at TTFT <= {s['ttft_s']:g} s and TPOT <= "
                  f"{s['tpot_s'] * 1e3:.0f} ms (simulated)", "",
                  "| replicas | rate per replica | SLO attained | TTFT p99 (s) | TPOT p99 (ms) |", "|---|---|---|---|---|"]
        lines += [f"| {t['replicas']} | {t['rate_per_replica']:.3g} | {t['attained'] * 100:.1f} % | "
                  f"{t['ttft_p99_s']:.2f} | {t['tpot_p99_s'] * 1e3:.0f} |" for t in s["tried"]]
        n = s["replicas"]
        lines += ["", f"**{n} replica{'s' * (n > 1)}** serve it" if n else
                  f"**not met with {s['tried'][-1]['replicas']} replicas** (raise plan.max_replicas)"]
    return "\n".join(lines) + "\n"


def replicas_for_slo(cfg: DictConfig, ec: EngineConfig, wc, pc: PlanConfig) -> dict:
    """Fewest replicas (each one engine on the profile) whose simulated share of the load meets
    the targets for at least 90 % of requests."""
    from core.bench.driver import slo_targets
    from core.bench.run import measure_engine
    from core.bench.summary import summarize
    from core.config.schema import run_config

    rc = dataclasses.replace(run_config(cfg), warmup_requests=0, progress=False)
    if ec.backend.name != "simulator":
        raise ConfigError("plan.slo=true finds replicas by simulation: add backend=simulator")
    ttft, tpot = slo_targets(wc, rc)
    tried, found = [], None
    for k in range(1, pc.max_replicas + 1):
        load = dataclasses.replace(wc, arrival="poisson", rate=pc.rate / k, num_requests=pc.num_requests)
        m = measure_engine(ec, load, rc)
        s = summarize(m.records, m.duration_s, m.steps, ttft, tpot, num_rejected=len(m.rejected))
        tried.append({"replicas": k, "rate_per_replica": pc.rate / k, "attained": s["slo"]["attained"],
                      "ttft_p99_s": s["ttft_s"]["p99"], "tpot_p99_s": s["tpot_s"]["p99"]})
        if s["slo"]["attained"] >= 0.9:
            found = k
            break
    return {"rate": pc.rate, "ttft_s": ttft, "tpot_s": tpot, "replicas": found, "tried": tried}


def run_plan(cfg: DictConfig) -> int:
    from core.bench.driver import workload_config
    from core.engine.components import engine_config

    ec, wc = engine_config(cfg), workload_config(cfg)
    pc = section(PlanConfig, cfg.get("plan"), "plan")
    if not 0 < pc.safety_margin <= 1 or not 0 < pc.memory_utilization <= 1 or not 0 < pc.percentile <= 1:
        raise ConfigError("plan.safety_margin, plan.memory_utilization and plan.percentile must be in (0, 1]")
    p = make_plan(ec, wc, pc)
    if pc.slo:
        p["slo"] = replicas_for_slo(cfg, ec, wc, pc)
    out = Path(pc.report_dir) / (pc.name or f"plan-{ec.model.name}-{ec.hardware.name}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(p, indent=1))
    md = plan_markdown(p)
    (out / "report.md").write_text(md)
    print(md)
    print(f"report: {out / 'report.md'}")
    return 0
