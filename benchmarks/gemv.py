"""The bf16 GEMV (servelab_kernels.linear) against oneDNN's GEMM (`F.linear`) at few rows, and in decode
steps: `python -m benchmarks.gemv`.

Micro-benchmark: SmolLM2-135M's linear shapes (fused qkv, o, fused gate-up, down, the head) at
1 to 32 activation rows (past `GEMV_ROWS`, to show where oneDNN takes over). A decode step reads its weights from memory (270 MB of them, far past
the last-level cache), so each call takes the next of enough copies of the weight to fill 384 MB:
the figure is GB/s of weights read out of memory, beside a read-bandwidth probe taken in the same
rounds. Engine: the default engine's decode steps of 1, 4 and 16 rows with the GEMV and without
(`GEMV_ROWS = 0`), rounds alternating; then the same with `backend.compile=true`, one engine whose
graph calls the GEMV op (`bf16_matmul`) beside one traced without it (oneDNN), rounds alternating
(`--no-compiled` skips that part: each graph takes about a minute to compile). Writes
reports/gemv/report.{md,json} and gemv.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.decode_attention import median_seconds
from servelab_kernels import cpu_ops
from servelab_kernels import linear as gemv

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate-up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}
ROWS = [1, 2, 4, 8, 16, 24, 32]
ROUNDS, CALLS = 5, 5
POOL_BYTES = 384 << 20


def rotating(fn_of_weight, weights: list[torch.Tensor]):
    """A call that takes the next weight copy each time (none in cache from its last use)."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        return fn_of_weight(weights[state["i"]])

    return call


def micro(probe: torch.Tensor) -> list[dict]:
    rows_out = []
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w0 = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        weights = [w0.clone() for _ in range(max(2, POOL_BYTES // w0.nbytes))]
        for m in ROWS:
            x = torch.randn(m, k, generator=g).bfloat16()
            gemv_call = rotating(lambda w, x=x: gemv.gemv(x, w), weights)
            gemm_call = rotating(lambda w, x=x: F.linear(x, w), weights)
            gemv_call(), gemm_call()
            t_gemv, t_gemm, bws = [], [], []
            for _ in range(ROUNDS):
                bws.append(probe.nbytes / median_seconds(probe.sum, 3) / 1e9)
                t_gemv.append(median_seconds(gemv_call, CALLS))
                t_gemm.append(median_seconds(gemm_call, CALLS))
            gemv_s, gemm_s = statistics.median(t_gemv), statistics.median(t_gemm)
            rows_out.append({"shape": name, "rows": m, "gemv_ms": gemv_s * 1e3, "gemm_ms": gemm_s * 1e3,
                             "gemv_gbs": w0.nbytes / gemv_s / 1e9, "gemm_gbs": w0.nbytes / gemm_s / 1e9,
                             "read_gbs": statistics.median(bws),
                             "speedup": statistics.median([b / a for a, b in zip(t_gemv, t_gemm)])})
            print(f"{name:18s} {m:3d} rows: GEMV {gemv_s * 1e3:7.3f} ms, GEMM {gemm_s * 1e3:7.3f} ms", flush=True)
    return rows_out


def engine_steps() -> dict:
    from benchmarks.profile_step import EAGER, decoding_engine

    out = {}
    for rows in (1, 4, 16):
        engine = decoding_engine(EAGER, rows=rows)
        n = 20 if rows == 1 else 10
        on, off = [], []
        saved = gemv.GEMV_ROWS, gemv.GEMV_ROWS_AMX
        for _ in range(ROUNDS + 1):
            on.append(median_seconds(engine.step, n))
            gemv.GEMV_ROWS = gemv.GEMV_ROWS_AMX = 0  # both: on AMX CPUs gemv_rows() reads the second
            try:
                off.append(median_seconds(engine.step, n))
            finally:
                gemv.GEMV_ROWS, gemv.GEMV_ROWS_AMX = saved
        on, off = on[1:], off[1:]  # the first round warms both paths
        ratios = [b / a for a, b in zip(on, off)]
        out[f"decode, {rows} rows"] = {"gemv_ms": statistics.median(on) * 1e3, "gemm_ms": statistics.median(off) * 1e3,
                                       "speedup": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
        print(rows, out[f"decode, {rows} rows"], flush=True)
    return out


def compiled_steps(rows_list=(1, 16)) -> dict:
    """backend.compile=true decode steps: the graph with the GEMV op against the graph without it."""
    from benchmarks.profile_step import EAGER, decoding_engine

    out = {}
    for rows in rows_list:
        engines = {}
        for on in (True, False):  # the choice is made while tracing, on the first step
            gemv._enabled_for_graphs = on
            try:
                engines[on] = decoding_engine(["backend.compile=true", *EAGER], rows=rows)
                engines[on].step()
            finally:
                gemv._enabled_for_graphs = True
        n = 20 if rows == 1 else 10
        on, off = [], []
        for _ in range(ROUNDS + 1):  # rounds alternating; the first warms both
            on.append(median_seconds(engines[True].step, n))
            off.append(median_seconds(engines[False].step, n))
        on, off = on[1:], off[1:]
        ratios = [b / a for a, b in zip(on, off)]
        out[f"compiled decode, {rows} rows"] = {
            "gemv_ms": statistics.median(on) * 1e3, "gemm_ms": statistics.median(off) * 1e3,
            "speedup": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
        print(rows, out[f"compiled decode, {rows} rows"], flush=True)
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(SHAPES):
        pts = [r for r in rows if r["shape"] == name]
        color = f"C{i}"
        ax.plot([r["rows"] for r in pts], [r["gemv_gbs"] for r in pts], "-o", color=color, label=f"{name} GEMV")
        ax.plot([r["rows"] for r in pts], [r["gemm_gbs"] for r in pts], "--x", color=color, label=f"{name} GEMM")
    bw = statistics.median(r["read_gbs"] for r in rows)
    ax.axhline(bw, color="k", lw=0.8, label=f"read bandwidth {bw:.0f} GB/s")
    ax.set_xlabel("activation rows")
    ax.set_ylabel("GB/s of weights read")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv")
    ap.add_argument("--out", default="reports/gemv")
    ap.add_argument("--no-compiled", action="store_true", help="skip the backend.compile=true steps")
    args = ap.parse_args(argv)
    if cpu_ops.load() is None or not cpu_ops.load().bf16_dot_native():
        raise SystemExit("the bf16 GEMV needs the C++ build and a CPU with AVX512-BF16")
    from core.bench.roofline import machine_info

    probe = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB, far past the last-level cache
    micro_rows, steps, m = micro(probe), engine_steps(), machine_info()
    if not args.no_compiled:
        steps.update(compiled_steps())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = ["# bf16 GEMV against oneDNN's GEMM at few rows\n",
          f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; GEMV rows here = {gemv.gemv_rows()}",
          f"- weights read from memory (copies rotated over {POOL_BYTES >> 20} MB); {ROUNDS} rounds of the median "
          f"of {CALLS} calls, beside a 1 GiB read-bandwidth probe\n- made by `python -m benchmarks.gemv`\n",
          "| shape | rows | GEMM ms | GEMV ms | GEMM GB/s | GEMV GB/s | read GB/s (probe) | speed-up (median of rounds) |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['shape']} | {r['rows']} | {r['gemm_ms']:.3f} | {r['gemv_ms']:.3f} | {r['gemm_gbs']:.1f} | "
           f"{r['gemv_gbs']:.1f} | {r['read_gbs']:.1f} | {r['speedup']:.2f}x |" for r in micro_rows]
    md += ["", "## Decode steps of the default engine (bf16, embedded model; `compiled`: backend.compile=true)", "",
           "| step | GEMM ms | GEMV ms | speed-up (range over rounds) |", "|---|---|---|---|"]
    md += [f"| {k} | {v['gemm_ms']:.1f} | {v['gemv_ms']:.1f} | {v['speedup']:.2f}x ({v['range'][0]:.2f}-{v['range'][1]:.2f}) |"
           for k, v in steps.items()]
    md.append("\n![GB/s against rows](gemv.png)\n")
    (out / "report.md").write_text("\n".join(md))
    (out / "report.json").write_text(json.dumps({"machine": m, "gemv_rows": gemv.gemv_rows(), "micro": micro_rows,
                                                 "steps": steps}, indent=2))
    plot(micro_rows, out / "gemv.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
