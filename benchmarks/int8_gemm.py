"""INT8 layers over their packed copy against the same layers without it and against fp32:
`python -m benchmarks.int8_gemm [--out reports/int8-gemm]`.

SmolLM2's shapes (q/k/v fused, o, gate/up fused, down, the head) at 1-512 rows of fp32 activations, three
sides called in turn each round (7 rounds, medians and per-round ratios): `fp32` (the unquantized Linear
as the engine runs it: servelab_kernels.fp32_linear's FMA tiles where they serve, else F.linear), `int8`
(Int8Linear with its packed copy: on AVX2 builds the vpmaddwd GEMM, on AVX512-VNNI builds VNNI's) and
`int8, no copy` (made inside int8_pack.packing(False): the GEMV up to its rows, then the build's GEMM
over the plain weight). 8 distinct weights a shape (the head: 1), so few-row calls stream weights from
memory as a model's do. GOPS counts 2 M N K operations a call. Writes report.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from benchmarks.ab import mean_seconds, write_report
from benchmarks.packed_linear import SHAPES
from servelab_kernels import fp32_linear, int8_pack
from servelab_kernels.cpu_quant_ref import q8_linear_ref
from servelab_kernels.linear import Linear
from servelab_kernels.quant import Int8Linear

ROUNDS = 7
ROWS = (1, 4, 8, 17, 64, 256, 512)
SIDES = ("fp32", "int8", "int8, no copy")


def layers_for(n: int, k: int, distinct: int, gen: torch.Generator) -> dict[str, list[nn.Module]]:
    sides = {side: [] for side in SIDES}
    for _ in range(distinct):
        lin = Linear(k, n, bias=False).requires_grad_(False)
        lin.weight.data = torch.randn(n, k, generator=gen) * 0.05
        sides["fp32"].append(lin)
        sides["int8"].append(Int8Linear.from_linear(lin))
        with int8_pack.packing(False):
            sides["int8, no copy"].append(Int8Linear.from_linear(lin))
    return sides


def measure(rows_list=ROWS, rounds: int = ROUNDS, distinct: int = 8) -> dict:
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        sides = layers_for(n, k, distinct if n < 10000 else 1, gen)
        for rows in rows_list:
            if n >= 10000 and rows > 64:
                continue  # the head runs for the rows that sample: a step's decodes
            x = torch.randn(rows, k, generator=gen)
            calls = {side: (lambda mods=mods: [m(x) for m in mods]) for side, mods in sides.items()}  # noqa: B023
            packed = sides["int8"][0]
            # the packed side is the twin's integer sums, bit for bit (where the build has a copy)
            exact = packed.packed is None or torch.equal(
                packed(x), q8_linear_ref(x, packed.weight_q, packed.scales))
            n_calls = max(1, 40 // len(sides["fp32"])) if n < 10000 else 4
            for call in calls.values():
                call()  # warm
            times = {side: [] for side in SIDES}
            for _ in range(rounds):
                for side, call in calls.items():
                    times[side].append(mean_seconds(call, n_calls) / len(sides[side]))
            case = {"exact": exact, "has_copy": packed.packed is not None}
            for side in SIDES:
                ms = statistics.median(times[side]) * 1e3
                case[side] = {"ms": ms, "gops": 2 * rows * n * k / (ms * 1e6)}
            for side in SIDES[1:]:
                ratios = [f / t for f, t in zip(times["fp32"], times[side])]
                case[side]["speed_vs_fp32"] = statistics.median(ratios)
                case[side]["range"] = [min(ratios), max(ratios)]
            copy = [u / p for p, u in zip(times["int8"], times["int8, no copy"])]
            case["copy_speedup"] = statistics.median(copy)
            case["copy_range"] = [min(copy), max(copy)]
            out[f"{name}, {rows} rows"] = case
            print(f"{name}, {rows} rows: " + ", ".join(f"{s} {case[s]['ms']:.3f} ms" for s in SIDES), flush=True)
    return out


def render(cases: dict, m: dict, layout: str | None) -> str:
    rows = ["| shape, rows | fp32 ms (GFLOP/s) | int8 ms (GOPS) | int8, no copy ms | int8 / fp32 speed (range) | "
            "copy / no copy speed (range) | int8 = twin |", "|---|---|---|---|---|---|---|"]
    for key, c in cases.items():
        i8 = c["int8"]
        rows.append(f"| {key} | {c['fp32']['ms']:.3f} ({c['fp32']['gops']:.0f}) | {i8['ms']:.3f} ({i8['gops']:.0f}) | "
                    f"{c['int8, no copy']['ms']:.3f} | {i8['speed_vs_fp32']:.2f}x ({i8['range'][0]:.2f}-{i8['range'][1]:.2f}) | "
                    f"{c['copy_speedup']:.2f}x ({c['copy_range'][0]:.2f}-{c['copy_range'][1]:.2f}) | "
                    f"{'yes' if c['exact'] else 'NO'} |")
    fp32 = "fp32_linear's FMA tiles" if fp32_linear.ready() else "F.linear"
    return ("# INT8 layers over their packed copy, without it, and fp32\n\n"
            f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; this build's packed layout: "
            f"{layout or 'none (both INT8 sides run the same path)'}\n"
            f"- fp32 rows; `fp32` runs {fp32}; `int8` Int8Linear with its packed copy, `int8, no copy` without "
            f"(the GEMV up to its rows, then the build's GEMM over the plain weight); {ROUNDS} rounds, the sides in "
            "turn each round, medians; 8 distinct weights a shape (the head: 1)\n"
            "- `int8 = twin`: the packed side's output equals `q8_linear_ref` (the 14-bit activations' exact sums) "
            "bit for bit\n- made by `python -m benchmarks.int8_gemm`\n\n" + "\n".join(rows) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.int8_gemm")
    ap.add_argument("--out", default="reports/int8-gemm")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = ap.parse_args(argv)
    from core.bench.roofline import machine_info

    torch.set_grad_enabled(False)
    cases = measure(tuple(args.rows))
    m = machine_info()
    layout = int8_pack.layout()
    write_report(args.out, render(cases, m, layout), {"machine": m, "layout": layout, "rounds": ROUNDS, "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
