"""The seed's GPU-scale claims, simulated: `python -m benchmarks.simulate_seed [--out reports/sim-seed]`.

Every row is `backend=simulator` with the real scheduler and allocator plugins on a model's shape
(conf/model/llama-2-7b.yaml: 32 layers x 32 heads x head_dim 128, the seed's KV example) and a
datasheet profile (conf/hardware/a100-80gb.yaml). The load is chat_longtail at its recorded
lengths (the Azure 2023 conversation trace, length_scale=1: p99 about 4,500 tokens). Three
experiments, each set beside the seed's own figures:

1. the tuning story: max_model_len 32K without chunked prefill against 8K with it, at 8 and 16
   concurrent users (a closed loop), with vLLM's paged cache and with a contiguous one that
   reserves max_model_len per request (where max_model_len costs memory);
2. static against continuous batching (the seed: static gets 1/3 to 1/2 of the throughput);
3. contiguous against paged KV (the seed: 2-4x the concurrency).

Writes report.md and report.json; each experiment's compare report sits beside them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COMMON = ["backend=simulator", "hardware=a100-80gb", "model=llama-2-7b", "workload=chat_longtail",
          "workload.length_scale=1.0", "run.warmup_requests=0", "run.progress=false", "scheduler.max_num_seqs=256"]
NO_CHUNKS_32K = ["model.max_model_len=32768", "scheduler.enable_chunked_prefill=false",
                 "scheduler.max_num_batched_tokens=32768"]
CHUNKS_8K = ["model.max_model_len=8192", "scheduler.max_num_batched_tokens=2048"]

EXPERIMENTS = {
    "tuning": {
        "title": "The tuning story: 32K without chunked prefill against 8K with it, 8 and 16 users",
        "seed": "TTFT over 2 s at 8 concurrent (32K); with 8K (covers p99) and chunked prefill, about 800 ms at 16 "
                "concurrent and about 2.5x the throughput",
        "common": ["workload.arrival=concurrent", "workload.num_requests=200"],
        "variants": {
            f"{cache}, {name}, {users} users": [f"cache={cache}", f"workload.concurrency={users}", *ov]
            for cache in ("contiguous", "paged") for name, ov in (("32K no chunking", NO_CHUNKS_32K),
                                                                  ("8K chunked", CHUNKS_8K)) for users in (8, 16)},
    },
    "static-vs-continuous": {
        "title": "Static against continuous batching (64 at a time, 500 requests at once)",
        "seed": "static batching gets 1/3 to 1/2 of continuous batching's throughput, worse the more lengths vary",
        "common": ["workload.num_requests=500", "scheduler.max_num_seqs=64", *CHUNKS_8K],
        "variants": {"static + contiguous": ["scheduler=static", "cache=contiguous",
                                             "scheduler.max_num_batched_tokens=65536"],  # whole prompts, as static does
                     "continuous + paged": ["scheduler=continuous", "cache=paged"]},
    },
    "contiguous-vs-paged": {
        "title": "Contiguous against paged KV (continuous batching, max_model_len 8K, 500 requests at once)",
        "seed": "PagedAttention: no fragmentation, 2-4x the throughput (the concurrency the memory holds)",
        "common": ["workload.num_requests=500", "scheduler=continuous", *CHUNKS_8K],
        "variants": {"contiguous": ["cache=contiguous"], "paged": ["cache=paged"]},
    },
}


def row(label: str, r: dict) -> dict:
    s = r["summary"]
    return {"label": label, "output_tok_s": s["output_tok_s"], "total_tok_s": s["total_tok_s"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p99_s": s["ttft_s"]["p99"], "tpot_p50_s": s["tpot_s"]["p50"],
            "peak_running": max((st["num_running"] for st in r["steps"]), default=0),
            "kv_peak": (s.get("kv_usage") or {}).get("peak"), "preemptions": s["preemptions"]}


def markdown(results: dict) -> str:
    lines = ["# The seed's GPU-scale claims, simulated", "",
             "- `backend=simulator hardware=a100-80gb model=llama-2-7b` (bf16, 13.5 GB of weights; the KV pool is "
             "0.9 x 80 GB less weights and activations); `chat_longtail` at its recorded lengths",
             "- made by `python -m benchmarks.simulate_seed`; every number below is simulated (the roofline step-time "
             "model of conf/hardware/a100-80gb.yaml), not measured", ""]
    for key, exp in EXPERIMENTS.items():
        rows = results[key]
        base = rows[0]
        lines += [f"## {exp['title']}", "", f"The seed: {exp['seed']}.", "",
                  "| configuration | output tok/s | x first row | TTFT p50 / p99 (s) | TPOT p50 (ms) | peak running | "
                  "peak KV | preemptions |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            kv = f"{r['kv_peak'] * 100:.0f} %" if r["kv_peak"] is not None else ""
            lines.append(f"| {r['label']} | {r['output_tok_s']:.0f} | {r['output_tok_s'] / base['output_tok_s']:.2f} | "
                         f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {r['tpot_p50_s'] * 1e3:.1f} | "
                         f"{r['peak_running']} | {kv} | {r['preemptions']} |")
        lines += ["", f"Full report: [{key}/report.md]({key}/report.md)", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    from core.bench import report
    from core.bench.run import run_one
    from core.config.compose import compose
    from core.config.schema import run_config

    ap = argparse.ArgumentParser(prog="python -m benchmarks.simulate_seed")
    ap.add_argument("--out", type=Path, default=Path("reports/sim-seed"))
    args = ap.parse_args(argv)
    results = {}
    for key, exp in EXPERIMENTS.items():
        runs = [run_one(compose(COMMON + exp["common"] + ov + ["run.plots=false"]), label=label)
                for label, ov in exp["variants"].items()]
        report.write_comparison(runs, key, run_config(compose(COMMON + [f"run.report_dir={args.out}"])))
        results[key] = [row(r["label"], r) for r in runs]
        print(f"{key}: done")
    (args.out / "report.json").write_text(json.dumps({"experiments": results}, indent=1))
    (args.out / "report.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
