"""Reports for people and machines: report.json, report.md and PNG plots under reports/<name>/."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from core.bench import plots as plotting
from core.bench.capacity import capacities, capacity_markdown, service_ceiling, step_cost_markdown
from core.bench.system_md import parallel_md, simulated_md
from core.config.schema import RunConfig

VERSION = 1
STEPS_FILE = "steps.json.gz"  # a report of several runs keeps their per-step records here, by run
LAT_ROWS = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"), ("queue", "queue_s"),
            ("prefill", "prefill_s"))


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def summary_table(results: list[dict]) -> str:
    """A fixed-width table for the terminal: one row per result."""
    head = ["run", "req/s", "out tok/s", "total tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "goodput", "roofline"]
    rows = []
    for r in results:
        s = r["summary"]
        rows.append([
            r["label"], _f(s["req_s"], 2), _f(s["output_tok_s"]), _f(s["total_tok_s"]),
            f"{_ms(s['ttft_s'].get('p50'))}/{_ms(s['ttft_s'].get('p99'))}",
            f"{_ms(s['tpot_s'].get('p50'))}/{_ms(s['tpot_s'].get('p99'))}",
            f"{s['slo']['attained'] * 100:.0f}%",
            f"{r['roofline']['fraction_of_roofline'] * 100:.1f}%" if r.get("roofline") else "-",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def _latency_table(s: dict) -> str:
    rows = []
    for label, key in LAT_ROWS:
        p = s.get(key, {})
        rows.append([label + " (ms)", _ms(p.get("mean")), _ms(p.get("p50")), _ms(p.get("p90")), _ms(p.get("p95")),
                     _ms(p.get("p99")), _ms(p.get("max"))])
    return _md_table(["latency", "mean", "p50", "p90", "p95", "p99", "max"], rows)


def _workload_md(w: dict) -> str:
    p, o = w["prompt_tokens"], w["output_tokens"]
    lines = [
        f"- workload **{w['name']}** ({w['kind']}), {w['num_requests']} requests, arrivals: {w['arrival']}",
        f"- prompt tokens: mean {p.get('mean')}, p50 {p.get('p50'):.0f}, p90 {p.get('p90'):.0f}, p99 {p.get('p99'):.0f}, "
        f"max {p.get('max')}; output tokens: mean {o.get('mean')}, p50 {o.get('p50'):.0f}, p99 {o.get('p99'):.0f}, max {o.get('max')}",
        f"- length scale x{w['length_scale']}; prompts cut to fit max_model_len: {w['num_capped']}",
    ]
    lines += [f"- {n}" for n in w.get("notes", [])]
    return "\n".join(lines)


def _roofline_md(r: dict, s: dict, device: str | None = None) -> str:
    f = r["workload_floor"]
    lines = [
        f"- {device or 'machine'}: {r['peak_gflops']:.0f} GFLOP/s matmul peak (model dtype), {r['mem_bandwidth_gbs']:.1f} "
        f"GB/s memory bandwidth (measured); weights {r['weight_bytes'] / 1e6:.0f} MB",
        f"- workload floor: {f['time_s']:.2f} s ({f['bound']}-bound: compute {f['compute_s']:.2f} s, memory "
        f"{f['memory_s']:.2f} s) = {_f(r['roofline_total_tok_s'])} total tok/s at most",
        f"- achieved: {s['duration_s']:.2f} s, **{r['fraction_of_roofline'] * 100:.1f} % of the roofline**",
    ]
    if r.get("schedule_floor"):
        sf = r["schedule_floor"]
        lines.append(f"- the schedule actually run ({sf['steps_compute_bound'] + sf['steps_memory_bound']} steps; "
                     f"{sf['steps_compute_bound']} compute-bound, {sf['steps_memory_bound']} memory-bound) could take "
                     f"{sf['time_s']:.2f} s at best")
    return "\n".join(lines)


def _header(result: dict) -> str:
    c = result["config"]
    comp = ", ".join(f"{k}={c[k]['name']}" for k in ("scheduler", "cache", "quant", "decoder", "backend", "attention")
                     if k in c)
    m = result["machine"]
    return (f"- model: {result['model']['path']} ({result['model']['architecture']}, {result['model']['dtype']}, "
            f"max_model_len {c['model']['max_model_len']})\n- components: {comp}; max_num_seqs "
            f"{c['scheduler']['max_num_seqs']}, max_num_batched_tokens {c['scheduler']['max_num_batched_tokens']}\n"
            f"- KV cache: {result['kv_cache']}\n"
            + (simulated_md(result["summary"]["simulated"]) if result["summary"].get("simulated") else
               f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)"
               + (f"; device: {m['device']}" if m.get("device_type") == "cuda" else "")) + parallel_md(result["summary"]))


def run_markdown(result: dict, plots: list[str]) -> str:
    s = result["summary"]
    kv = s.get("kv_usage")
    pc = s.get("prefix_cache", {})
    throughput = _md_table(
        ["requests", "rejected", "duration (s)", "req/s", "output tok/s", "total tok/s", "goodput (req/s)",
         "SLO attained", "preemptions"],
        [[s["num_requests"], s.get("rejected", 0), _f(s["duration_s"], 2), _f(s["req_s"], 3), _f(s["output_tok_s"]),
          _f(s["total_tok_s"]), _f(s["goodput_req_s"], 3), f"{s['slo']['attained'] * 100:.1f} %", s["preemptions"]]],
    )
    lines = [
        f"# servelab run: {result['label']}", "", _header(result), "", "## Workload", "", _workload_md(result["workload"]),
        "", "## Throughput", "", throughput, "",
        f"Goodput counts requests with TTFT <= {s['slo']['ttft_s']} s and TPOT <= {s['slo']['tpot_s'] * 1000:.0f} ms.",
        "", "## Latency", "", _latency_table(s), "",
        "TPOT = (e2e - TTFT) / (output tokens - 1); ITL = every gap between consecutive tokens.", "",
        "## KV cache", "",
        f"- usage: peak {kv['peak'] * 100:.1f} %, mean {kv['mean'] * 100:.1f} %" if kv else "- usage: not reported by this backend",
        f"- prefix cache: {pc.get('hits', 0)} of {pc.get('queries', 0)} prompt tokens hit ({pc.get('hit_rate', 0) * 100:.1f} %)",
        "", "## The physical limit", "",
        _roofline_md(result["roofline"], s, result["machine"].get("device")) if result.get("roofline") else "- not measured: the target is a server "
        "this process does not run (see its own metrics)", "",
    ]
    lines += spec_decode_md(s.get("spec_decode"))
    lines += step_cost_markdown(s)
    lines += server_metrics_md(result.get("server_metrics"))
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def spec_decode_md(spec: dict | None) -> list[str]:
    """Speculative decoding: how many drafts were checked and kept, per position in their run."""
    if not spec:
        return []
    per_pos = spec["accepted_per_pos"]
    by_pos = ", ".join(f"{n / spec['num_drafts'] * 100:.0f} %" for n in per_pos) if spec["num_drafts"] else "-"
    return ["## Speculative decoding", "",
            _md_table(["verifies", "draft tokens", "accepted", "acceptance rate", "mean accepted length"],
                      [[spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"],
                        f"{spec['acceptance_rate'] * 100:.1f} %", _f(spec["mean_accepted_length"], 2)]]), "",
            f"Share of verifies that kept a draft at position 1, 2, ...: {by_pos}. The mean accepted length counts "
            "the target's own token: tokens emitted per verify.", ""]


def server_metrics_md(metrics: dict | None) -> list[str]:
    """What the server itself counted per model over the run, beside the client's records."""
    if not metrics:
        return []
    rows = [[m, f"{v.get('requests', 0):.0f}", f"{v.get('generation_tokens', 0):.0f}",
             f"{v['prefix_hits'] / v['prefix_queries'] * 100:.1f} %" if v.get("prefix_queries") else "-"]
            for m, v in sorted(metrics.items())]
    return ["## What the server counted, per model (its /metrics)", "",
            _md_table(["model_name", "finished requests", "generated tokens", "prefix-cache hit rate"], rows), ""]


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def comparison_markdown(results: list[dict], plots: list[str]) -> str:
    base = results[0]
    head = ["run", "req/s", "output tok/s", "total tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
            "TPOT p99 (ms)", "E2E p99 (ms)", "goodput (req/s)", "preemptions", "prefix hits", "roofline"]
    rows = []
    for r in results:
        s = r["summary"]
        rows.append([r["label"], _f(s["req_s"], 3), _f(s["output_tok_s"]), _f(s["total_tok_s"]), _ms(s["ttft_s"].get("p50")),
                     _ms(s["ttft_s"].get("p99")), _ms(s["tpot_s"].get("p50")), _ms(s["tpot_s"].get("p99")),
                     _ms(s["e2e_s"].get("p99")), _f(s["goodput_req_s"], 3), s["preemptions"],
                     f"{s.get('prefix_cache', {}).get('hit_rate', 0) * 100:.1f} %",
                     f"{r['roofline']['fraction_of_roofline'] * 100:.1f} %"])
    ratios = []
    for r in results[1:]:
        s, b = r["summary"], base["summary"]
        ratios.append([r["label"], _ratio(s["output_tok_s"], b["output_tok_s"]), _ratio(s["total_tok_s"], b["total_tok_s"]),
                       _ratio(s["ttft_s"].get("p50"), b["ttft_s"].get("p50")), _ratio(s["ttft_s"].get("p99"), b["ttft_s"].get("p99")),
                       _ratio(s["tpot_s"].get("p50"), b["tpot_s"].get("p50")), _ratio(s["e2e_s"].get("p99"), b["e2e_s"].get("p99"))])
    lines = [
        f"# servelab comparison: {' vs '.join(r['label'] for r in results)}", "",
        "All runs in one invocation, on the same machine, the same workload and the same model file"
        + ("; rows run on backend=simulator are simulated (see each run's section)." if any(
            r["summary"].get("simulated") for r in results) else "."), "",
        _header(base), "", "## Workload", "", _workload_md(base["workload"]), "", "## Results", "", _md_table(head, rows), "",
        f"## Ratios against `{base['label']}`", "",
        _md_table(["run", "output tok/s", "total tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "E2E p99"], ratios), "",
        "Throughput ratios > 1 and latency ratios < 1 favour the row.", "",
    ] + capacity_markdown(results)
    spec = [[r["label"], f"{sd['acceptance_rate'] * 100:.1f} %", _f(sd["mean_accepted_length"], 2), sd["num_draft_tokens"]]
            for r in results if (sd := r["summary"].get("spec_decode"))]
    if spec:
        lines += ["## Speculative decoding", "",
                  _md_table(["run", "acceptance rate", "mean accepted length", "draft tokens"], spec), ""]
    for r in results:
        sim = r["summary"].get("simulated")
        lines += [f"### `{r['label']}`", ""] + ([simulated_md(sim), ""] if sim else []) + (
            [parallel_md(r["summary"]).strip(), ""] if r["summary"].get("parallel") else []) + [
            _latency_table(r["summary"]), "", _roofline_md(r["roofline"], r["summary"], r["machine"].get("device")), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def _compact(obj):
    """Round floats to microseconds-ish and drop raw token timestamps (ITLs keep the gaps)."""
    if isinstance(obj, float):
        return round(obj, 6)
    if isinstance(obj, dict):
        return {k: _compact(v) for k, v in obj.items() if k != "token_times_s"}
    if isinstance(obj, list):
        return [_compact(v) for v in obj]
    return obj


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(_compact(obj), default=str) + "\n")


def write_runs_json(out: Path, head: dict, key: str, results: list[dict]) -> None:
    """report.json of several runs (under `key`), their per-step records (most of the bytes: a rate
    sweep has thousands of steps per run) in STEPS_FILE, a list by run, gzip-compressed."""
    with gzip.open(out / STEPS_FILE, "wt") as f:
        f.write(json.dumps(_compact([r.get("steps", []) for r in results])) + "\n")
    runs = [{k: v for k, v in r.items() if k != "steps"} for r in results]
    _write_json(out / "report.json", {**head, "steps_file": STEPS_FILE, key: runs})


def write_run(result: dict, name: str, rc: RunConfig) -> Path:
    out = Path(rc.report_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    images = plotting.run_plots([result], out) if rc.plots else []
    _write_json(out / "report.json", result)
    (out / "report.md").write_text(run_markdown(result, images))
    return out


def write_comparison(results: list[dict], name: str, rc: RunConfig) -> Path:
    out = Path(rc.report_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    images = plotting.run_plots(results, out) if rc.plots else []
    write_runs_json(out, {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "report_version": VERSION,
                          "slo_capacity": capacities(results), "service_ceiling": service_ceiling(results)},
                    "runs", results)
    (out / "report.md").write_text(comparison_markdown(results, images))
    return out


def curve_markdown(results: list[dict], plots: list[str], knee: dict | None) -> str:
    slo = results[0]["summary"]["slo"]
    head = ["users", "requests", "failures", "req/s", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
            "TPOT p99 (ms)", "E2E p99 (ms)", "goodput (req/s)"]
    rows = [[r["users"], r["summary"]["num_requests"], r["summary"].get("failures", 0), _f(r["summary"]["req_s"], 3),
             _f(r["summary"]["output_tok_s"]), _ms(r["summary"]["ttft_s"].get("p50")), _ms(r["summary"]["ttft_s"].get("p99")),
             _ms(r["summary"]["tpot_s"].get("p50")), _ms(r["summary"]["tpot_s"].get("p99")),
             _ms(r["summary"]["e2e_s"].get("p99")), _f(r["summary"]["goodput_req_s"], 3)] for r in results]
    if knee:
        verdict = (f"**The knee: {knee['users']} users**, the first stage whose P99 TTFT "
                   f"({_ms(knee['ttft_p99'])} ms) breaks the SLO of {slo['ttft_s'] * 1000:.0f} ms.")
    else:
        verdict = f"No stage broke the P99 TTFT SLO of {slo['ttft_s'] * 1000:.0f} ms."
    lines = [f"# servelab load curve: {results[0]['label'].split(' users=')[0]}", "",
             f"- target: {results[0].get('target')}", "", _workload_md(results[0]["workload"]), "",
             "## Throughput against latency", "", _md_table(head, rows), "", verdict, ""]
    lines += capacity_markdown(results)
    lines += server_metrics_md(results[-1].get("server_metrics"))
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def find_knee(results: list[dict]) -> dict | None:
    for r in results:
        p99 = r["summary"]["ttft_s"].get("p99")
        if p99 is None or p99 > r["summary"]["slo"]["ttft_s"]:
            return {"users": r["users"], "ttft_p99": p99}
    return None


def write_curve(results: list[dict], name: str, rc: RunConfig) -> Path:
    out = Path(rc.report_dir) / name
    out.mkdir(parents=True, exist_ok=True)
    knee = find_knee(results)
    images = (plotting.run_plots(results, out) + [plotting.load_curve(results, out / "load_curve.png")]) if rc.plots else []
    write_runs_json(out, {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "report_version": VERSION,
                          "knee": knee, "slo_capacity": capacities(results),
                          "service_ceiling": service_ceiling(results)}, "stages", results)
    (out / "report.md").write_text(curve_markdown(results, images, knee))
    return out
