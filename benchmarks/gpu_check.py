"""The GPU check (issue 11): `python -m benchmarks.gpu_check` on a CUDA machine, about 5 minutes
on one H200 from a fresh install (benchmarks/gpu_run.sh installs the carried wheels first).

1. the device's own roofline: HBM read bandwidth and the bf16 matmul peak, measured;
2. a kernel table: each Triton kernel against its torch reference (and SDPA where comparable):
   time, GB/s or TFLOP/s as a share of the measured peak, and its error against the reference;
3. servelab runs on dummy weights: batch 1, decode_heavy and chat_longtail on the Llama-3.2-1B
   shape, batch 1 on the Llama-3.1-8B shape; and the transformers static-cache peer (compiled,
   CUDA graphs) on the same shapes;
4. one report: report.md, report.json and kernels.png / runs.png in --out (default reports/gpu-check).

Every stage has a share of a time budget (--budget-s); what would overrun is skipped and the
report says so, so the check always ends with a report.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path

import torch

from benchmarks import gpu_kernels

TARGETS = {  # issue 11's targets on one H200
    "1b-batch1": ("output tok/s", 600.0), "8b-batch1": ("output tok/s", 180.0),
    "1b-decode_heavy": ("output tok/s", 30_000.0), "decode attention 128 x 2048": ("% of HBM", 70.0),
}


def engine_runs(tokenizer: str | None) -> list[tuple[str, list[str]]]:
    tok = [f"model.tokenizer={tokenizer}"] if tokenizer else []
    tok += ["cache.memory_utilization=0.5"]  # far more than the runs need; room for the peers' compiles
    one = ["workload=fixed", "workload.prompt_len=128", "run.warmup_requests=1", "scheduler.max_num_seqs=1"]
    return [
        ("1b-batch1", ["model=llama-3.2-1b", *tok, *one, "workload.num_requests=3", "workload.output_len=256"]),
        ("1b-decode_heavy", ["model=llama-3.2-1b", *tok, "workload=decode_heavy", "scheduler.max_num_seqs=128",
                             "scheduler.max_num_batched_tokens=8192"]),
        ("1b-chat_longtail", ["model=llama-3.2-1b", *tok, "workload=chat_longtail", "scheduler.max_num_batched_tokens=4096"]),
        ("8b-batch1", ["model=llama-3.1-8b", *tok, *one, "workload.num_requests=2", "workload.output_len=256"]),
        ("hf-static-1b-batch1", ["model=llama-3.2-1b", *tok, *one, "workload.num_requests=2", "workload.output_len=256",
                                 "peer=hf", "peer.cache=static"]),
        ("hf-static-1b-64x256", ["model=llama-3.2-1b", *tok, "workload=fixed", "workload.num_requests=64",
                                 "workload.prompt_len=128", "workload.output_len=256", "scheduler.max_num_seqs=64",
                                 "run.warmup_requests=1", "peer=hf", "peer.cache=static"]),
        ("hf-static-8b-batch1", ["model=llama-3.1-8b", *tok, *one, "workload.num_requests=2", "workload.output_len=128",
                                 "peer=hf", "peer.cache=static"]),
        ("hf-dynamic-1b-batch1", ["model=llama-3.2-1b", *tok, *one, "workload.num_requests=1", "workload.output_len=128",
                                  "peer=hf", "peer.cache=dynamic"]),
    ]


def summarize_run(label: str, result: dict, wall: float) -> dict:
    s = result["summary"]
    tpot = s["tpot_s"].get("p50")
    system = "servelab"
    if label.startswith("hf-"):
        system = f"transformers {label.split('-')[1]} cache"
    return {"label": label, "system": system, "wall_s": wall, "requests": s["num_requests"], "output_tok_s": s["output_tok_s"],
            "total_tok_s": s["total_tok_s"], "ttft_p50_s": s["ttft_s"].get("p50"), "ttft_p99_s": s["ttft_s"].get("p99"),
            "tpot_p50_s": tpot, "tpot_p99_s": s["tpot_s"].get("p99"), "tok_s_per_stream": 1 / tpot if tpot else None,
            "fraction_of_roofline": result["roofline"]["fraction_of_roofline"], "kv_cache": result["kv_cache"]}


def run_engines(tokenizer: str | None, deadline: float, log) -> list[dict]:
    from core.bench.run import run_one
    from core.config.compose import compose

    rows = []
    runs = engine_runs(tokenizer)
    for i, (label, overrides) in enumerate(runs):
        left = deadline - time.perf_counter()
        if left < 25:
            rows.append({"label": label, "skipped": f"time budget spent ({left:.0f} s left)"})
            continue
        log(f"[run {i + 1}/{len(runs)}] {label}: {' '.join(overrides)}")
        t0 = time.perf_counter()
        try:
            result = run_one(compose(overrides + ["run.progress=false", "run.plots=false"]), label)
            rows.append(summarize_run(label, result, time.perf_counter() - t0))
            log(f"    {rows[-1]['output_tok_s']:.1f} out tok/s, TPOT p50 {1000 * (rows[-1]['tpot_p50_s'] or 0):.2f} ms")
        except Exception as e:  # one failure must not lose the rest of the report
            rows.append({"label": label, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
            log(f"    failed: {e}")
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def verdicts(kernels: list[dict], runs: list[dict]) -> list[dict]:
    got = {r["label"]: r for r in runs if "output_tok_s" in r}
    out = []
    for name, (unit, target) in TARGETS.items():
        if unit == "% of HBM":
            k = next((k for k in kernels if k.get("case") == name and k.get("impl") == "triton"), None)
            value = k["fraction"] * 100 if k and k.get("fraction") else None
        else:
            r = got.get(name)
            value = r["output_tok_s"] if r else None
        out.append({"target": name, "unit": unit, "wanted": target, "measured": value,
                    "met": value is not None and value >= target})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    ap.add_argument("--out", default="reports/gpu-check")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the embedded model's)")
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument("--skip-runs", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the GPU check needs a CUDA device")
        return 2
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "log.txt", "w")

    def log(msg: str) -> None:
        line = f"[{time.perf_counter() - start:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    from core.bench.roofline import machine_rates

    rates = machine_rates(remeasure=True, device=torch.device("cuda"))
    log(f"{rates['device']}: HBM read {rates['mem_bandwidth_gbs']:.0f} GB/s, bf16 matmul "
        f"{rates['matmul_gflops']['bf16'] / 1e3:.0f} TFLOP/s")
    kernels = gpu_kernels.kernel_table(rates, log)
    runs = [] if args.skip_runs else run_engines(args.tokenizer, start + args.budget_s, log)
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": rates, "kernels": kernels, "runs": runs,
              "targets": verdicts(kernels, runs), "wall_s": time.perf_counter() - start}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    gpu_kernels.write_markdown(report, out)
    log(f"report: {out / 'report.md'} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
