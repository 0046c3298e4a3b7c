"""servelab beside llama.cpp on the same GGUF file and machine: `python -m benchmarks.vs_llama_cpp`.

Build llama.cpp first (`bash benchmarks/llama_cpp_build.sh`, its binaries are found in its cache
or given with --bin). Two measurements, each run side by side in this one process's lifetime:

- batch-1 decode: `llama-bench -p 0 -n 128` (tg128, 2 threads) against servelab generating 128
  tokens for one request (tokens after the first over their time), `quant=gguf` and the defaults'
  dtype (bf16, or fp32 on CPUs without native bf16) as they run by default (decode steps as one C++
  call), and with decode steps through the eager forward (`backend.native_decode=false`) or, for
  gguf, inductor's graph (`backend.compile=true`, its compile paid in the warm-up);
- load: N streams back to back (GuideLLM's constant concurrency), fixed prompt/output lengths,
  the same locust bench (`python -m core bench`) against `llama-server -np N` and against
  servelab's own server: TTFT, inter-token latency and output throughput.

Writes reports/vs-llama-cpp/report.{md,json}; each load run keeps its full bench report beside.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def default_bin() -> Path:
    """Where benchmarks/llama_cpp_build.sh puts this CPU's build: a folder named by the first 10 hex
    digits of the SHA-1 of /proc/cpuinfo's first flags line (a native build is only good on its CPU)."""
    line = next((raw for raw in Path("/proc/cpuinfo").read_text().splitlines(keepends=True)
                 if re.match(r"(flags|Features)", raw)), platform.machine() + "\n")
    return Path.home() / ".cache" / "servelab" / "llama.cpp" / f"build-{hashlib.sha1(line.encode()).hexdigest()[:10]}" / "bin"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_bench(bin_dir: Path, gguf: Path, threads: int, reps: int) -> dict:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "128",
                          "-r", str(reps), "-o", "json"], check=True, capture_output=True, text=True).stdout
    row = json.loads(out)[0]
    return {"tok_s": row["avg_ts"], "stddev": row["stddev_ts"], "samples": row.get("samples_ts"),
            "build": row.get("build_commit"), "threads": row.get("n_threads")}


def servelab_batch1(overrides: list[str], reps: int) -> dict:
    """Tokens 2..129 of one greedy request over their wall time, `reps` times after a warm-up."""
    from core.config.compose import compose
    from core.engine.components import engine_config
    from core.engine.engine import Engine
    from core.engine.types import SamplingParams

    engine = Engine(engine_config(compose(overrides)))
    prompt = engine.tokenizer.encode("The history of the printing press")
    rates = []
    for rep in range(reps + 1):
        engine.add_request(prompt, SamplingParams(max_tokens=129, ignore_eos=True))
        stamps = []
        while engine.has_unfinished():
            if engine.step():
                stamps.append(time.perf_counter())
        if rep:  # the first run warms the caches and the allocator
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {"tok_s": statistics.median(rates), "min": min(rates), "max": max(rates), "samples": rates}


def bench(name: str, out_dir: Path, args, extra: list[str]) -> dict:
    """One `python -m core bench` run of the fixed load; its summary."""
    cmd = [sys.executable, "-m", "core", "bench", "scenario=chat_longtail", f"scenario.name={name}",
           f"scenario.users={args.streams}", f"scenario.spawn_rate={args.streams}", "scenario.rate_per_user=0",
           f"scenario.max_requests={args.requests}", "scenario.duration_s=900", "workload=fixed",
           f"workload.num_requests={args.requests}", f"workload.prompt_len={args.prompt}",
           f"workload.output_len={args.output}", f"run.name={name}", f"run.report_dir={out_dir}"] + extra
    subprocess.run(cmd, check=True)
    return json.loads((out_dir / name / "report.json").read_text())["summary"]


def llama_server_load(bin_dir: Path, gguf: Path, out_dir: Path, args) -> dict:
    port = _port()
    ctx = args.streams * (args.prompt + args.output + 64)
    server = subprocess.Popen([str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-np",
                               str(args.streams), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return bench("llama-server", out_dir, args, [f"target.url=http://127.0.0.1:{port}"])
    finally:
        server.terminate()
        server.wait(timeout=30)


def row(name: str, s: dict) -> str:
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    return (f"| {name} | {s['ttft_s']['p50']:.2f} / {s['ttft_s']['p99']:.2f} | {ms(s['itl_s']['p50'])} / "
            f"{ms(s['itl_s']['p99'])} | {ms(s['tpot_s']['p50'])} | {s['output_tok_s']:.1f} | {s['failures']} |")


EAGER = "backend.native_decode=false"  # decode steps through the eager forward (or the compiled graph)
LOAD_TAGS = ("gguf", "gguf-eager", "dense")  # the load runs (each a server start and a locust run)


def variants(dense: str) -> dict[str, tuple[str, list[str]]]:
    """name: (report tag, overrides); the default runs decode steps as one C++ call. The unquantized
    rows run the defaults, named by the dtype `model.dtype=auto` takes on this CPU (`dense`): bf16
    where it has native bf16, fp32 (with a bf16 KV cache) where bf16 would be emulated (AVX2-only
    x86), so they show what a user gets rather than an emulated path."""
    return {
        "servelab quant=gguf": ("gguf", ["quant=gguf"]),
        f"servelab quant=gguf {EAGER}": ("gguf-eager", ["quant=gguf", EAGER]),
        f"servelab quant=gguf backend.compile=true {EAGER}": ("gguf-compiled", ["quant=gguf", "backend.compile=true", EAGER]),
        f"servelab {dense} (the defaults)": ("dense", []),
        f"servelab {dense} {EAGER}": ("dense-eager", [EAGER]),
    }


def main(argv=None) -> int:
    from core.bench.roofline import machine_info
    from core.config.compose import compose
    from core.engine.components import engine_config
    from core.model.default_model import default_model_path

    ap = argparse.ArgumentParser(prog="python -m benchmarks.vs_llama_cpp")
    ap.add_argument("--bin", type=Path, default=None,
                    help="directory with llama-bench and llama-server (default: this CPU's build by the script)")
    ap.add_argument("--out", type=Path, default=Path("reports/vs-llama-cpp"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    args.bin = args.bin or default_bin()
    if not (args.bin / "llama-bench").exists():
        print(f"no llama.cpp build in {args.bin}: run `bash benchmarks/llama_cpp_build.sh` first", file=sys.stderr)
        return 2
    gguf = default_model_path()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(), "gguf": str(gguf), "args": {k: str(v) for k, v in vars(args).items()},
              "batch1": {"llama.cpp (llama-bench tg128)": llama_bench(args.bin, gguf, args.threads, args.reps)}}
    runs = variants(engine_config(compose([])).model.dtype)  # the dtype the defaults resolve to here
    for name, (_, ov) in runs.items():
        result["batch1"][name] = servelab_batch1(ov + [f"backend.num_threads={args.threads}"], args.reps)
    result["load"] = {f"llama-server -np {args.streams}": llama_server_load(args.bin, gguf, args.out, args)}
    for name, (tag, ov) in runs.items():
        if tag in LOAD_TAGS:
            result["load"][name] = bench(f"servelab-{tag}", args.out, args, ov)
    (args.out / "report.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    lines = [f"# servelab beside llama.cpp\n\n- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; "
             f"{args.threads} threads each\n- model: the same file, `{gguf.name}`\n"
             f"- made by `python -m benchmarks.vs_llama_cpp` (llama.cpp from `bash benchmarks/llama_cpp_build.sh`)\n",
             "## Batch-1 decode\n", "| engine | tok/s (median) | range | vs llama.cpp |", "|---|---|---|---|"]
    peer = result["batch1"]["llama.cpp (llama-bench tg128)"]["tok_s"]
    for name, r in result["batch1"].items():
        spread = f"± {r['stddev']:.1f} (stddev)" if "stddev" in r else f"{r['min']:.1f} - {r['max']:.1f}"
        lines.append(f"| {name} | {r['tok_s']:.1f} | {spread} | {r['tok_s'] / peer:.2f}x |")
    lines += [f"\n## {args.streams} streams back to back, {args.prompt} in / {args.output} out, {args.requests} requests\n",
              "| engine | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | TPOT p50 (ms) | output tok/s | failures | "
              "TTFT p50, output tok/s vs llama-server |", "|---|---|---|---|---|---|---|"]
    server = result["load"][f"llama-server -np {args.streams}"]
    lines += [row(name, s) + f" {server['ttft_s']['p50'] / s['ttft_s']['p50']:.2f}x better, "
              f"{s['output_tok_s'] / server['output_tok_s']:.2f}x |" for name, s in result["load"].items()]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
