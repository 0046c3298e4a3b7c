"""The sweep behind `python -m core disagg` and its report: colocated against each P:D split at
every rate, SLO capacities, and the break-even rate and transfer bandwidth (see core.bench.disagg)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from omegaconf import DictConfig

from core.bench.capacity import slo_capacity
from core.bench.disagg import BASELINES, DisaggConfig, baseline_config, check, disagg_config, simulate
from core.errors import ConfigError


def split_label(p: int, n: int) -> str:
    return f"{p}P:{n - p}D"


def point(label: str, kind: str, rate: float, s: dict, **extra) -> dict:
    t = s["transfer_s"]
    return {"config": label, "kind": kind, "rate": rate, **extra, "attained": s["slo"]["attained"],
            "goodput_req_s": s["goodput_req_s"], "output_tok_s": s["output_tok_s"],
            "ttft_p50_s": s["ttft_s"].get("p50"), "ttft_p99_s": s["ttft_s"].get("p99"),
            "tpot_p50_s": s["tpot_s"].get("p50"), "tpot_p99_s": s["tpot_s"].get("p99"),
            "itl_p99_s": s["itl_s"].get("p99"), "attained_by_tpot": s["attained_by_tpot"],
            "transfer_p50_s": t["p50"] if t else None, "transfer_wait_p99_s": t["wait_p99"] if t else None,
            "busy_share": s["busy_share"], "rejected": s["rejected"], "num_requests": s["num_requests"]}


def crossing(xs: list[float], diff: list[float], margin: float) -> float | None:
    """The break-even along xs (sweep order): where `diff` (disaggregated minus colocated
    attainment) rises past `margin` to stay past it at every later x, interpolated from the point
    before; None if it is not past the margin at the last x. A lead that comes and goes is noise."""
    wins = [d > margin + 1e-9 for d in diff]
    if not wins or not wins[-1]:
        return None
    i = len(wins) - 1
    while i > 0 and wins[i - 1]:
        i -= 1
    if i == 0:
        return xs[0]
    d0, d1 = diff[i - 1], diff[i]
    return xs[i - 1] + (xs[i] - xs[i - 1]) * (margin - d0) / (d1 - d0)


def lead(a: float, b: float, margin: float) -> float:
    """How far `a` is past `b` and a relative margin on it (positive: `a` wins)."""
    return a - b * (1 + margin)


def capacity(points: list[dict], config: str, key, attainment: float) -> float:
    """A configuration's SLO capacity, interpolated (0 when even its lowest rate missed; the
    highest rate tried when none missed, a lower bound), scored by `key` (a point's attainment)."""
    cap = slo_capacity([(p["rate"], key(p)) for p in points if p["config"] == config], attainment)
    return cap["interpolated_req_s"] or 0.0


def tpot_break_even(points: list[dict], targets: list[float], attainment: float, margin: float) -> dict:
    """Every configuration's SLO capacity at each TPOT target (the same runs re-scored), and per
    colocated baseline the loosest target at which the best split's capacity wins: tighter TPOT
    targets favour a decode pool that never waits for a prefill."""
    targets = sorted(targets)
    configs = {p["config"]: p["kind"] for p in points}
    caps = {c: [capacity(points, c, lambda p, t=t: p["attained_by_tpot"][t], attainment) for t in targets]
            for c in configs}
    best = [max(caps[c][i] for c, k in configs.items() if k == "disaggregated") for i in range(len(targets))]
    out = {}
    for base in (c for c, k in configs.items() if k == "colocated"):
        # from the loosest target down, over the targets that either side can serve at all
        served = [(t, lead(b, c, margin)) for t, b, c in zip(targets, best, caps[base]) if max(b, c) > 0][::-1]
        out[base] = crossing([t for t, _ in served], [d for _, d in served], 0.0)
    return {"targets": targets, "capacities": caps, "best_split": best, "tpot_s": out}


def bandwidth_break_even(points: list[dict], margin: float) -> dict | None:
    """Against the strongest colocated baseline at that rate: from which bandwidth the split wins."""
    bw = sorted((p for p in points if "bandwidth_gbs" in p), key=lambda p: p["bandwidth_gbs"])
    if not bw:
        return None
    rate = bw[0]["rate"]
    base = max((p for p in points if p["kind"] == "colocated" and p["rate"] == rate and "bandwidth_gbs" not in p),
               key=lambda p: p["attained"])
    xs = [p["bandwidth_gbs"] for p in bw]
    return {"rate": rate, "config": bw[0]["config"], "baseline": base["config"], "colocated_attained": base["attained"],
            "bandwidth_gbs": crossing(xs, [lead(p["attained"], base["attained"], margin) for p in bw], 0.0)}


def run_sweep(ec, loaded, wc, rc, dc: DisaggConfig, bar) -> list[dict]:
    """Every configuration at every rate (and the bandwidth sweep); `loaded`: the model's shape and
    tokenizer, shared by every instance of every run."""
    from core.bench.driver import slo_targets
    from scenarios.workloads import build_workload, materialize

    slo = slo_targets(wc, rc)
    gbs = dc.transfer_gbs or ec.hardware.interconnect_gbs
    targets = sorted(set(dc.tpot_targets) | {slo[1]})  # the run's own TPOT target among them
    configs = [(BASELINES[k], "colocated", baseline_config(ec, k), None) for k in dc.colocated] + \
        [(split_label(p, dc.instances), "disaggregated", ec, p) for p in dc.prefill_instances]
    points, loads = [], {}

    def one(label, kind, cfg, p, rate, gbs, **extra):
        bar.set_postfix_str(f"{label} at {rate:g} req/s, {gbs:g} GB/s")
        s = simulate(cfg, loaded, loads[rate], p, dc.instances, gbs, dc.transfer_latency_s, slo, bar, targets)
        points.append(point(label, kind, rate, s, transfer_gbs=gbs if p else None, **extra))

    for rate in dc.rates:
        load = dataclasses.replace(wc, arrival="poisson", rate=rate, num_requests=dc.num_requests)
        loads[rate] = build_workload(load, ec.model.max_model_len)
        materialize(loads[rate], loaded.tokenizer)
        for label, kind, cfg, p in configs:
            one(label, kind, cfg, p, rate, gbs)
    if dc.bandwidths:
        rate = dc.bandwidth_rate or max(dc.rates)
        if rate not in loads:
            raise ConfigError(f"disagg.bandwidth_rate={rate:g} must be one of disagg.rates")
        best = max((q for q in points if q["rate"] == rate and q["kind"] == "disaggregated"), key=lambda q: q["attained"])
        label, kind, cfg, p = next(c for c in configs if c[0] == best["config"])
        for b in dc.bandwidths:
            one(label, kind, cfg, p, rate, b, bandwidth_gbs=b)
    return points


def summarize_sweep(points: list[dict], dc: DisaggConfig) -> dict:
    main = [p for p in points if "bandwidth_gbs" not in p]
    configs = list(dict.fromkeys(p["config"] for p in main))
    caps = {c: slo_capacity([(p["rate"], p["attained"]) for p in main if p["config"] == c], dc.attainment)
            for c in configs}
    targets = sorted(main[0]["attained_by_tpot"])
    return {"capacities": caps, "bandwidth": bandwidth_break_even(points, dc.margin),
            "tpot": tpot_break_even(main, targets, dc.attainment, dc.margin)}


def _f(x, fmt: str, scale: float = 1.0) -> str:
    return "" if x is None else format(x * scale, fmt)


def markdown(meta: dict, points: list[dict], result: dict) -> str:
    slo = meta["slo"]
    lines = [f"# Prefill/decode disaggregation against colocated, simulated: {meta['model']} on "
             f"{meta['instances']} x {meta['hardware']}", "",
             f"- **simulated** (backend=simulator, the roofline step-time model of conf/hardware/{meta['hardware']}.yaml); "
             f"`{meta['workload']}` with Poisson arrivals, {meta['num_requests']} requests a point, scheduler "
             f"`{meta['scheduler']}` (max_num_batched_tokens {meta['max_num_batched_tokens']:,}), max_model_len "
             f"{meta['max_model_len']:,}; \"colocated, whole prompts\": chunked prefill off",
             f"- KV transfer: {meta['transfer_gbs']:g} GB/s per rank and prefill instance (one transfer at a time), "
             f"{meta['transfer_latency_s'] * 1e3:g} ms each; {meta['kv_bytes_per_token']:,} B of KV per token",
             f"- SLO: TTFT <= {slo[0]:g} s and TPOT <= {slo[1] * 1e3:g} ms; capacity: the highest rate with at least "
             f"{meta['attainment'] * 100:g} % of requests within both; a side wins when it leads by more than "
             f"{meta['margin'] * 100:g} % of the other's figure", "",
             "| rate (req/s) | configuration | SLO attained | goodput (req/s) | output tok/s | TTFT p50 / p99 (s) | "
             "TPOT p50 / p99 (ms) | ITL p99 (ms) | KV transfer p50 (ms) | time in steps: prefill / decode |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in (q for q in points if "bandwidth_gbs" not in q):
        b = p["busy_share"]
        busy = f"{b['both'] * 100:.0f} %" if "both" in b else f"{b['prefill'] * 100:.0f} % / {b['decode'] * 100:.0f} %"
        lines.append(f"| {p['rate']:g} | {p['config']} | {p['attained'] * 100:.1f} % | {p['goodput_req_s']:.2f} | "
                     f"{p['output_tok_s']:.0f} | {_f(p['ttft_p50_s'], '.2f')} / {_f(p['ttft_p99_s'], '.2f')} | "
                     f"{_f(p['tpot_p50_s'], '.1f', 1e3)} / {_f(p['tpot_p99_s'], '.1f', 1e3)} | "
                     f"{_f(p['itl_p99_s'], '.0f', 1e3)} | {_f(p['transfer_p50_s'], '.1f', 1e3)} | {busy} |")
    lines += ["", "## SLO capacity", "", "| configuration | capacity (req/s, on the grid) | interpolated | first miss |",
              "|---|---|---|---|"]
    for c, cap in result["capacities"].items():
        lines.append(f"| {c} | {_f(cap['capacity_req_s'], 'g')} | {_f(cap['interpolated_req_s'], '.2f')} | "
                     f"{_f(cap['first_miss_req_s'], 'g')} |")
    lines += ["", "## Break-even", ""] + tpot_markdown(result["tpot"], slo) + bandwidth_markdown(result["bandwidth"],
                                                                                                   points)
    return "\n".join(lines) + "\n"


def tpot_markdown(tp: dict, slo) -> list[str]:
    ts = tp["targets"]
    lines = [f"SLO capacity (req/s, interpolated) at TTFT <= {slo[0]:g} s and each TPOT target, the same runs re-scored "
             "(0: even the lowest rate missed; at the highest rate tried: never missed, a lower bound):", "",
             "| configuration | " + " | ".join(f"TPOT <= {t * 1e3:g} ms" for t in ts) + " |", "|---" * (len(ts) + 1) + "|"]
    for c, caps in tp["capacities"].items():
        lines.append(f"| {c} | " + " | ".join(f"{x:.2f}" for x in caps) + " |")
    lines.append("")
    for base, x in tp["tpot_s"].items():
        lines.append(f"- **TPOT target, against {base}**: disaggregation (its best split) has the larger SLO capacity "
                     f"at TPOT targets of **{x * 1e3:.1f} ms** and tighter (interpolated)" if x is not None else
                     f"- **TPOT target, against {base}**: {base} has as large an SLO capacity (within the margin) or "
                     "larger at every TPOT target tried: disaggregation does not pay against it here")
    return lines + ["", "Disaggregation's decode pool never waits for a prefill, so its tokens keep their pace, but it "
                    "holds every decode on fewer devices (less KV memory, larger batches), and its prefill pool is "
                    "smaller than the whole; colocated steps that carry prefill tokens stall the decodes in them."]


def bandwidth_markdown(bw: dict | None, points: list[dict]) -> list[str]:
    if not bw:
        return []
    lines = ["", f"Transfer bandwidth at {bw['rate']:g} req/s ({bw['config']}; the strongest colocated baseline there, "
             f"{bw['baseline']}, attains {bw['colocated_attained'] * 100:.1f} %):", "",
             "| GB/s per rank | SLO attained | TTFT p99 (s) | KV transfer p50 (ms) | transfer queueing p99 (ms) |",
             "|---|---|---|---|---|"]
    for p in sorted((q for q in points if "bandwidth_gbs" in q), key=lambda q: q["bandwidth_gbs"]):
        lines.append(f"| {p['bandwidth_gbs']:g} | {p['attained'] * 100:.1f} % | {_f(p['ttft_p99_s'], '.2f')} | "
                     f"{_f(p['transfer_p50_s'], '.1f', 1e3)} | {_f(p['transfer_wait_p99_s'], '.1f', 1e3)} |")
    x = bw["bandwidth_gbs"]
    return lines + ["", f"- **bandwidth**: disaggregation beats {bw['baseline']} from **{x:.3g} GB/s** per rank" if x
                    is not None else f"- **bandwidth**: at none of the bandwidths tried does disaggregation beat "
                    f"{bw['baseline']} at this rate"]


def run_disagg(cfg: DictConfig) -> int:
    from tqdm import tqdm

    from core.bench.driver import slo_targets, workload_config
    from core.config.schema import run_config
    from core.engine.components import engine_config, kv_cache_spec, shape_only

    ec, wc, rc = engine_config(cfg), workload_config(cfg), run_config(cfg)
    dc = disagg_config(cfg)
    check(dc, ec)
    if not (dc.transfer_gbs or ec.hardware.interconnect_gbs):
        raise ConfigError(f"hardware '{ec.hardware.name}' has no interconnect: set disagg.transfer_gbs")
    runs = (len(dc.colocated) + len(dc.prefill_instances)) * len(dc.rates) + len(dc.bandwidths)
    with tqdm(total=runs * dc.num_requests, desc="disagg", unit="req", disable=not rc.progress) as bar:
        loaded = shape_only(ec)
        points = run_sweep(ec, loaded, wc, rc, dc, bar)
    result = summarize_sweep(points, dc)
    kv = kv_cache_spec(ec, loaded.args)  # the configured cache dtype's, as the instances hold it
    meta = {"model": ec.model.name, "hardware": ec.hardware.name, "instances": dc.instances, "workload": wc.name,
            "num_requests": dc.num_requests, "scheduler": ec.scheduler.name, "max_model_len": ec.model.max_model_len,
            "max_num_batched_tokens": ec.scheduler.max_num_batched_tokens, "slo": list(slo_targets(wc, rc)),
            "transfer_gbs": dc.transfer_gbs or ec.hardware.interconnect_gbs, "transfer_latency_s": dc.transfer_latency_s,
            "kv_bytes_per_token": kv.bytes_per_token, "attainment": dc.attainment, "margin": dc.margin,
            "tensor_parallel_size": ec.backend.tensor_parallel_size, "simulated": True}
    out = Path(dc.report_dir) / (dc.name or f"disagg-{ec.model.name}-{ec.hardware.name}-{wc.name}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"meta": meta, "points": points, **result}, indent=1))
    md = markdown(meta, points, result)
    from core.bench.plots import disagg_plot

    plot = disagg_plot(points, meta, out / "attainment.png")
    (out / "report.md").write_text(md + (f"\n![SLO attainment against rate]({Path(plot).name})\n" if plot else ""))
    print(md)
    print(f"report: {out / 'report.md'}")
    return 0
