"""bf16 linears on AMX tiles (csrc/cpu_gemm_amx.cpp) against oneDNN's GEMM over its packed weights:
`python -m benchmarks.amx_linear [--out reports/amx-linear]` (CPUs with AMX-BF16 only).

Three tables, each side the median of alternating rounds (`servelab_kernels.amx_linear.enabled(False)` is
the oneDNN side, the layout servelab used on AMX CPUs before):

1. SmolLM2's shapes at 3-512 rows, one weight re-read (warm: in L2/L3), with the GEMV and F.linear
   over the plain weight beside them where they apply;
2. out of memory: the 120 layer linears of a step (30 layers x q/k/v, o, gate/up, down, distinct
   weights, 212 MB) one after another after a 512 MB read has pushed them out of the caches, as a
   decode step meets them, beside a read of the same bytes (a sum over an fp32 tensor of that size:
   the floor a step's weight reads cannot beat);
3. engine steps of the default engine on the embedded model (bf16): 64 decodes (the native plan),
   the same plus a fresh 512-token prompt, 8 decodes, 1 decode.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.ab import alternating_rounds, mean_seconds, write_report
from benchmarks.profile_step import decoding_engine
from servelab_kernels import amx_linear, cpu_ops
from servelab_kernels import linear as lin

ROUNDS = 7
SHAPES = {"qkv (960 x 576)": (960, 576), "o (576 x 576)": (576, 576), "gate/up (3072 x 576)": (3072, 576),
          "down (576 x 1536)": (576, 1536), "head (49152 x 576)": (49152, 576)}
ROWS = (3, 8, 16, 64, 128, 256, 384, 512)
CHAIN_ROWS = (1, 2, 3, 8, 16, 32, 64, 128, 256)


def _median_ms(fn, n: int) -> float:
    return statistics.median(mean_seconds(fn, n) for _ in range(ROUNDS)) * 1e3


def shapes() -> dict:
    out, gen = {}, torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        layer = lin.Linear(k, n, bias=False).requires_grad_(False)
        layer.weight.data = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
        for rows in ROWS:
            if n > 10000 and rows > 128:
                continue  # the head multiplies the sampled rows only
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            calls = max(3, int(2e8 / (2 * rows * n * k)))
            r = alternating_rounds(lambda: layer(x), calls, ROUNDS, lambda: amx_linear.enabled(False))  # noqa: B023
            case = {"tiles_ms": statistics.median(r["mine"]) * 1e3, "onednn_ms": statistics.median(r["baseline"]) * 1e3,
                    "speedup": statistics.median(r["ratios"]), "speedup_range": [min(r["ratios"]), max(r["ratios"])],
                    "f_linear_ms": _median_ms(lambda: F.linear(x, layer.weight), calls)}  # noqa: B023
            if rows <= lin.GEMV_ROWS:
                case["gemv_ms"] = _median_ms(lambda: lin.gemv(x, layer.weight), calls)  # noqa: B023
            with amx_linear.enabled(False):
                onednn = layer(x)
            case["equal_share"] = (layer(x) == onednn).double().mean().item()
            out[f"{name}, {rows} rows"] = case
    return out


def chain() -> dict:
    """A step's 120 layer linears out of memory, each side after the same cache-clearing read."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    layers = []
    for _ in range(30):
        for n, k in shapes:
            layer = lin.Linear(k, n, bias=False).requires_grad_(False)
            layer.weight.data = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
            layers.append(layer)
    weight_bytes = sum(m.weight.numel() * 2 for m in layers)
    sweep = torch.ones(128 << 20)  # 512 MB, read (not written: no dirty lines to write back in the timed part)
    probe = torch.ones(weight_bytes // 4)

    def cold(fn) -> float:
        sweep.sum()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    out = {}
    for rows in CHAIN_ROWS:
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}

        def step():
            for m in layers:
                m(xs[m.in_features])  # noqa: B023

        step()
        with amx_linear.enabled(False):
            step()
        t, o, g, r = [], [], [], []
        for _ in range(ROUNDS):
            t.append(cold(step))
            with amx_linear.enabled(False):
                o.append(cold(step))
            r.append(cold(probe.sum))
            if rows <= 3:
                g.append(cold(lambda: [lin.gemv(xs[m.in_features], m.weight) for m in layers]))  # noqa: B023
        ratios = [b / a for a, b in zip(t, o)]
        out[f"{rows} rows"] = {
            "tiles_ms": statistics.median(t) * 1e3, "onednn_ms": statistics.median(o) * 1e3,
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
            "read_ms": statistics.median(r) * 1e3, "read_gb_s": weight_bytes / statistics.median(r) / 1e9,
            "tiles_gb_s": weight_bytes / statistics.median(t) / 1e9,
            "gemv_ms": statistics.median(g) * 1e3 if g else None, "path": "gemv" if rows <= lin.gemv_rows() else "tiles"}
    return out


@contextlib.contextmanager
def onednn(engine):
    """The engine's steps on oneDNN's packed weights (as `backend.amx_linear=false`: the backend sets
    the process-wide switch around each step from its own setting)."""
    before, engine.backend.amx_linear = engine.backend.amx_linear, False
    try:
        yield
    finally:
        engine.backend.amx_linear = before


def steps() -> dict:
    from core.engine.types import SamplingParams

    engine = decoding_engine([], rows=64)
    fresh = iter(range(10**6))

    def mixed():
        first = 5000 + 600 * next(fresh)
        engine.add_request(list(range(first, first + 512)), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()

    def case(step, n, eng=engine):
        r = alternating_rounds(step, n, ROUNDS, lambda: onednn(eng))
        return {"tiles_ms": statistics.median(r["mine"]) * 1e3, "onednn_ms": statistics.median(r["baseline"]) * 1e3,
                "speedup": statistics.median(r["ratios"]), "speedup_range": [min(r["ratios"]), max(r["ratios"])]}

    cases = {"decode, 64 rows": case(engine.step, 4), "64 decodes + a 512-token prefill": case(mixed, 2)}
    for rows in (8, 1):
        e = decoding_engine([], rows=rows)
        cases[f"decode, {rows} row{'s' if rows > 1 else ''}"] = case(e.step, 10, e)
    return cases


def main(argv=None) -> int:
    from core.bench.roofline import machine_info

    ap = argparse.ArgumentParser(prog="python -m benchmarks.amx_linear")
    ap.add_argument("--out", default="reports/amx-linear")
    args = ap.parse_args(argv)
    if not amx_linear.ready() or cpu_ops.load() is None:
        raise SystemExit("this CPU (or build) has no AMX-BF16 tiles: nothing to compare")
    by_shape, by_chain, by_step, m = shapes(), chain(), steps(), machine_info()
    md = ["# bf16 linears on AMX tiles against oneDNN's packed weights", "",
          f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)",
          f"- {ROUNDS} rounds, tiles and oneDNN alternating (`servelab_kernels.amx_linear.enabled(False)`); medians, "
          "the speed-up's range over the rounds; made by `python -m benchmarks.amx_linear`", "",
          "## SmolLM2's shapes, one weight re-read (warm)", "",
          "| layer, rows | tiles ms | oneDNN packed ms | speed-up | F.linear ms | GEMV ms | equal to oneDNN's |",
          "|---|---|---|---|---|---|---|"]
    for name, c in by_shape.items():
        gemv = f"{c['gemv_ms']:.3f}" if "gemv_ms" in c else "-"
        md.append(f"| {name} | {c['tiles_ms']:.3f} | {c['onednn_ms']:.3f} | {c['speedup']:.2f}x "
                  f"({c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f}) | {c['f_linear_ms']:.3f} | {gemv} | "
                  f"{c['equal_share'] * 100:.1f} % |")
    md += ["", "## A step's 120 layer linears out of memory (212 MB of weights)", "",
           "| rows | servelab ms (path) | oneDNN packed ms | speed-up | GEMV ms | read of 212 MB, ms (GB/s) | "
           "servelab's weight GB/s |", "|---|---|---|---|---|---|---|"]
    for name, c in by_chain.items():
        gemv = f"{c['gemv_ms']:.2f}" if c["gemv_ms"] is not None else "-"
        md.append(f"| {name} | {c['tiles_ms']:.2f} ({c['path']}) | {c['onednn_ms']:.2f} | {c['speedup']:.2f}x "
                  f"({c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f}) | {gemv} | {c['read_ms']:.2f} "
                  f"({c['read_gb_s']:.1f}) | {c['tiles_gb_s']:.1f} |")
    md += ["", "At 1-2 rows both sides take the GEMV on AMX CPUs with tiles (servelab) and the oneDNN side's "
           "GEMV up to 3 rows.", "", "## Engine steps (default engine, embedded model, bf16)", "",
           "| step | tiles ms | oneDNN packed ms | speed-up |", "|---|---|---|---|"]
    for name, c in by_step.items():
        md.append(f"| {name} | {c['tiles_ms']:.2f} | {c['onednn_ms']:.2f} | {c['speedup']:.2f}x "
                  f"({c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f}) |")
    write_report(args.out, "\n".join(md) + "\n", {"machine": m, "rounds": ROUNDS, "shapes": by_shape,
                                                  "chain": by_chain, "steps": by_step})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
