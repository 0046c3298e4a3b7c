"""`python -m core run` and `compare`: drive a workload through the engine (or a peer) and report.

Requests are added at their arrival times (all at once for offline throughput); the engine
steps whenever it has work. Per-request records and per-step stats come from the observer
hooks, the same path any exporter plugin would use.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from core.config import EngineConfig, engine_config, run_config, section
from core.engine import Engine, resolve_model_path
from core.errors import RequestError
from core.loader import DTYPES
from core.metrics import summarize
from core.plugins import get_registry, hookimpl
from core.types import KVCacheSpec, SamplingParams, StepStats
from scenarios.workloads import Workload, WorkloadConfig, build_workload, materialize


@dataclass
class Recorder:
    """Observer plugin: keeps every finished request's metrics and every step's stats."""

    start: float
    records: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    token_times: dict[str, list[float]] = field(default_factory=dict)

    @hookimpl
    def servelab_request_finished(self, request_id, sequences, metrics):
        for seq, m in zip(sequences, metrics):
            m = dict(m)
            m["arrival_s"] = seq.timings.arrival - self.start
            m["finish_s"] = (seq.timings.finished or time.perf_counter()) - self.start
            m["token_times_s"] = [t - self.start for t in seq.timings.token_times]
            self.records.append(m)

    @hookimpl
    def servelab_step_finished(self, step_stats: StepStats):
        d = {k: v for k, v in step_stats.__dict__.items() if k != "time"}
        d["time_s"] = step_stats.time - self.start
        self.steps.append(d)


def workload_config(cfg: DictConfig) -> WorkloadConfig:
    return section(WorkloadConfig, cfg.get("workload"), "workload")


def default_run_name(ec: EngineConfig, wc: WorkloadConfig) -> str:
    return f"{wc.name}-{ec.scheduler.name}-{ec.cache.name}-{ec.quant.name}-{ec.backend.name}-{ec.model.dtype}"


def _params(output_len: int) -> SamplingParams:
    # Output length is forced, as in vLLM's benchmarks: greedy, ignore EOS, exactly output_len tokens.
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False)


def drive_engine(engine: Engine, workload: Workload, progress: bool = True):
    """Replay the workload's arrivals against the engine; returns (records, steps, duration_s, rejected)."""
    pending = sorted(workload.requests, key=lambda r: r.arrival_s)
    start = time.perf_counter()
    recorder = Recorder(start)
    pm = engine.registry.pm
    pm.register(recorder)
    bar = _progress(len(pending), workload.config.name, progress)
    i = 0
    rejected: list[dict] = []
    try:
        while i < len(pending) or engine.has_unfinished():
            now = time.perf_counter() - start
            while i < len(pending) and pending[i].arrival_s <= now:
                r = pending[i]
                i += 1
                try:
                    engine.add_request(prompt_token_ids=r.prompt_token_ids, params=_params(r.output_len),
                                       request_id=f"{r.index}", arrival_time=start + r.arrival_s)
                except RequestError as e:  # e.g. larger than the whole KV pool: counted, not fatal
                    rejected.append({"request_id": str(r.index), "reason": str(e)})
                    bar.update(1)
            if engine.has_unfinished():
                done_before = len(recorder.records)
                engine.step()
                bar.update(len(recorder.records) - done_before)
            elif i < len(pending):
                time.sleep(max(0.0, min(pending[i].arrival_s - now, 0.05)))
    finally:
        pm.unregister(recorder)
        bar.close()
    end = max((r["finish_s"] for r in recorder.records), default=0.0)
    return recorder.records, recorder.steps, end, rejected


def warm_up(engine: Engine, n: int) -> None:
    """Run a few small requests first so one-time costs (allocations, kernels) are not measured."""
    if n > 0:
        engine.generate([[engine.tokenizer.eos_token_id or 0] * 16] * n, SamplingParams(max_tokens=4, ignore_eos=True))


def run_one(cfg: DictConfig, label: str | None = None) -> dict:
    """Build, warm up, run one configuration on its workload; returns the report dict."""
    from core import report
    from core.roofline import CostModel, machine_rates, weight_bytes

    ec, rc, wc = engine_config(cfg), run_config(cfg), workload_config(cfg)
    registry = get_registry()
    backend = registry.get("backend", ec.backend.name)
    peer = getattr(backend.factory, "is_peer", False)
    rates = machine_rates(rc.remeasure_machine)
    if peer:
        from core.loader import load_model

        loaded = load_model(resolve_model_path(ec), ec.model.dtype, ec.model.max_model_len)
        tokenizer, args = loaded.tokenizer, loaded.args
    else:
        engine = Engine(ec)
        tokenizer, args, loaded = engine.tokenizer, engine.loaded.args, engine.loaded
    workload = build_workload(wc, ec.model.max_model_len)
    materialize(workload, tokenizer)
    if peer:
        runner = backend.factory(config=ec.backend)
        hf_model = runner.load(resolve_model_path(ec), ec.model.dtype)
        model_bytes = weight_bytes(hf_model)
        pad = tokenizer.eos_token_id or 0
        if rc.warmup_requests:
            from scenarios.workloads import RequestSpec

            runner.run(hf_model, [RequestSpec(i, 0.0, 16, 4, prompt_token_ids=[pad] * 16)
                                  for i in range(rc.warmup_requests)], ec.scheduler.max_num_seqs, pad)
        bar = _progress(len(workload.requests), wc.name, rc.progress)
        t0 = time.perf_counter()
        records, steps = runner.run(hf_model, workload.requests, ec.scheduler.max_num_seqs, pad, progress=bar)
        rejected = []
        kv_bytes_per_token = KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, DTYPES[ec.model.dtype],
                                         ec.model.max_model_len).bytes_per_token
        bar.close()
        duration = time.perf_counter() - t0
        del hf_model
    else:
        model_bytes = weight_bytes(engine.backend.model)
        warm_up(engine, rc.warmup_requests)
        base = engine.allocator.stats()
        records, steps, duration, rejected = drive_engine(engine, workload, rc.progress)
        for s in steps:  # counters are cumulative: count this run only
            s["prefix_queries"] -= base.prefix_queries
            s["prefix_hits"] -= base.prefix_hits
        kv_description = engine.allocator.describe() if hasattr(engine.allocator, "describe") else ""
        kv_bytes_per_token = engine.kv_spec.bytes_per_token
        del engine
    gc.collect()
    summary = summarize(records, duration, steps, rc.slo_ttft_s, rc.slo_tpot_s)
    summary["rejected"] = len(rejected)
    peak = rates["matmul_gflops"]["bf16" if ec.model.dtype == "bf16" else "fp32"]
    cost = CostModel(args, model_bytes, kv_bytes_per_token, peak, rates["mem_bandwidth_gbs"])
    floor = cost.workload_floor([r["num_prompt_tokens"] for r in records], [r["num_output_tokens"] for r in records])
    sched_floor = cost.schedule_floor(steps) if not peer else None
    roofline = {
        "peak_gflops": peak, "mem_bandwidth_gbs": rates["mem_bandwidth_gbs"], "weight_bytes": model_bytes,
        "workload_floor": floor, "schedule_floor": sched_floor,
        "fraction_of_roofline": floor["time_s"] / duration if duration > 0 else 0.0,
        "roofline_total_tok_s": (summary["prompt_tokens"] + summary["output_tokens"]) / floor["time_s"]
        if floor["time_s"] > 0 else None,
    }
    return {
        "label": label or default_run_name(ec, wc),
        "config": OmegaConf.to_container(cfg, resolve=True),
        "model": {"path": resolve_model_path(ec), "architecture": args.architecture, "dtype": ec.model.dtype,
                  "layers": args.num_layers, "hidden": args.hidden_size},
        "kv_cache": kv_description if not peer else "transformers DynamicCache (padded static batches)",
        "machine": {k: rates[k] for k in ("cpu", "cores", "torch_threads", "torch", "platform", "measured_at")},
        "workload": workload.describe(),
        "summary": summary,
        "roofline": roofline,
        "requests": sorted(records, key=lambda r: int(r["request_id"])),
        "rejected": rejected,
        "steps": steps,
        "report_version": report.VERSION,
    }


def run_benchmark(cfg: DictConfig) -> int:
    from core import report

    rc = run_config(cfg)
    result = run_one(cfg)
    name = rc.name or result["label"]
    out_dir = report.write_run(result, name, rc)
    print(report.summary_table([result]))
    print(f"report: {out_dir / 'report.md'}")
    return 0


def compare(base_overrides: list[str], variants: list[list[str]], labels: list[str] | None, name: str | None) -> int:
    """Run each variant (base overrides + its own) on the same workload; one comparison report."""
    from core import report
    from core.cli import compose

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
