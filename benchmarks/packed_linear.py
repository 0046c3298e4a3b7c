"""bf16 Linears through oneDNN's packed weights (servelab_kernels.linear.Linear) against F.linear on the
plain weights: `python -m benchmarks.packed_linear`.

Two tables. SmolLM2's shapes (q/k/v fused, o, gate/up fused, down, the head) at 4-256 rows (at 4 and 8 rows the plain
side is the GEMV, whose sums differ from oneDNN's in order; on a CPU without AMX both sides take it): each
side the median of 7 rounds of 50 calls, alternating, with the results compared bit for bit. Then
real engine steps of the default engine on the embedded model (bf16): 64 decodes, the same plus a
fresh 512-token prompt prefilled in the step, 8 decodes (on AMX CPUs the packed GEMM's rows, the
GEMV's where packing is off), rounds alternating between packed and plain weights
(`servelab_kernels.linear.packing(False)`) on one engine. Writes reports/packed-linear/report.{md,json}.

`--dot` (CPUs where servelab_kernels.dot_linear serves: AVX512-BF16, no AMX) sets the dot-product
layout against what runs without it (`dot_linear.enabled(False)`): oneDNN's packed weights at 17-256
rows, the GEMV at fewer (the engine steps of 8 rows and of batch 1). `--fp32` (CPUs where
servelab_kernels.fp32_linear serves: AVX2, no AVX-512) sets its FMA tiles against F.linear on the plain
fp32 weights at 1-256 rows, in an engine with `model.dtype=fp32`. Their shape table holds 8 distinct
weights a shape (the head: 1), so few-row calls stream weights from memory as a model's do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import types

import torch

from benchmarks.ab import alternating_rounds, write_report
from benchmarks.profile_step import EAGER, decoding_engine
from servelab_kernels import dot_linear, fp32_linear
from servelab_kernels.linear import Linear, packing, use_packed

ROUNDS = 7
SHAPES = {"qkv (960 x 576)": (960, 576), "o (576 x 576)": (576, 576), "gate/up (3072 x 576)": (3072, 576),
          "down (576 x 1536)": (576, 1536), "head (49152 x 576)": (49152, 576)}
ROWS = (4, 8, 17, 64, 256)
DOT_ROWS = (17, 32, 64, 128, 256)  # --dot: past the GEMV's rows, where the two GEMMs differ


@dataclasses.dataclass(frozen=True)
class Layout:
    """A packed layout's A/B (--dot, --fp32): the layout against what runs with it turned off."""
    module: types.ModuleType  # dot_linear or fp32_linear: enabled(), ready()
    backend_attr: str  # the backend's switch for it (backend.dot_linear, backend.fp32_linear)
    dtype: torch.dtype
    overrides: list[str]  # the engine's
    rows: tuple[int, ...]
    distinct: int  # weights a shape in the shape table (the head: one)
    title: str
    cpus: str  # where it serves
    sides: tuple[str, str]  # the table's two columns: off, on
    test: str  # the test that bounds both
    cache_note: str


LAYOUTS = {
    "dot": Layout(dot_linear, "dot_linear", torch.bfloat16, [], DOT_ROWS, 1,
                  "bf16 Linears on dot products (servelab_kernels.dot_linear) against oneDNN's packed weights",
                  "AVX512-BF16 without AMX",
                  ("without it (oneDNN's packed weights; the GEMV up to 16 rows)", "dot-product layout"),
                  "tests/test_dot_linear.py", "one weight a shape, so warm in cache."),
    "fp32": Layout(fp32_linear, "fp32_linear", torch.float32, ["model.dtype=fp32"], (1, 4, 8, 16, 32, 64, 128, 256), 8,
                   "fp32 Linears on AVX2 FMA tiles (servelab_kernels.fp32_linear) against F.linear",
                   "AVX2 without AVX-512", ("F.linear (plain weights)", "FMA tiles"), "tests/test_fp32_linear.py",
                   "8 distinct weights a shape (the head: one), called in turn, so few-row calls read them from memory."),
}


def alternate(step, n: int, baseline=lambda: packing(False)) -> dict:
    """`step` as it is against `step` inside `baseline()` (what the other side of each round runs under)."""
    r = alternating_rounds(step, n, ROUNDS, baseline)
    packed, plain, ratios = r["mine"], r["baseline"], r["ratios"]
    return {"packed_ms": statistics.median(packed) * 1e3, "plain_ms": statistics.median(plain) * 1e3,
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)], "calls_a_round": n}


def shapes(rows_list=ROWS, baseline=lambda: packing(False), dtype=torch.bfloat16, distinct: int = 1) -> dict:
    """Each shape at each number of rows; `distinct` weights a shape called in turn (the head: one)."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        layers = [Linear(k, n, bias=False).requires_grad_(False) for _ in range(distinct if n < 10000 else 1)]
        for layer in layers:
            layer.weight.data = torch.randn(n, k, generator=gen).to(dtype)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            with baseline():
                plain = [layer(x) for layer in layers]

            def call():
                return [layer(x) for layer in layers]  # noqa: B023

            case = alternate(call, max(1, 50 // len(layers)) if n < 10000 else 5, baseline)
            case["identical"] = all(torch.equal(a, b) for a, b in zip(call(), plain))
            out[f"{name}, {rows} rows"] = case
    return out


@contextlib.contextmanager
def _layout_off(layout: str, *engines):
    """LAYOUTS[layout] off, also for these engines' steps (their backends set its switch around each
    step: backend.dot_linear, backend.fp32_linear)."""
    lay = LAYOUTS[layout]
    for e in engines:
        setattr(e.backend, lay.backend_attr, False)
    try:
        with lay.module.enabled(False):
            yield
    finally:
        for e in engines:
            setattr(e.backend, lay.backend_attr, True)


def steps(layout: str | None = None) -> dict:
    """Engine steps; with a layout of LAYOUTS, that layout against it off in the engine it serves."""
    from core.engine.types import SamplingParams

    overrides = LAYOUTS[layout].overrides if layout else EAGER  # a layout: its decode steps in the native plan
    engine, eights = decoding_engine(overrides, rows=64), decoding_engine(overrides, rows=8)
    baseline = (lambda: _layout_off(layout, engine, eights)) if layout else (lambda: packing(False))
    fresh = iter(range(10**6))

    def mixed():
        first = 5000 + 600 * next(fresh)
        engine.add_request(list(range(first, first + 512)), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()

    cases = {"decode, 64 rows": alternate(engine.step, 4, baseline),
             "64 decodes + a 512-token prefill": alternate(mixed, 2, baseline)}
    # 8 rows: on AMX CPUs the packed GEMM takes these from the GEMV (plain weights: the GEMV's 16 rows)
    cases["decode, 8 rows"] = alternate(eights.step, 10, baseline)
    if layout:  # these tiles take every row count: batch 1 too
        single = decoding_engine(overrides, rows=1)
        cases["decode, batch 1"] = alternate(single.step, 30, lambda: _layout_off(layout, single))
    return cases


def table(cases: dict, what: str, sides=("plain weights", "packed")) -> list[str]:
    lines = [f"| {what} | {sides[0]}, ms | {sides[1]}, ms | speed-up (range over rounds) |", "|---|---|---|---|"]
    for name, c in cases.items():
        same = "" if c.get("identical", True) else " (results differ)"
        lines.append(f"| {name} | {c['plain_ms']:.3f} | {c['packed_ms']:.3f} | {c['speedup']:.2f}x "
                     f"({c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f}){same} |")
    return lines


def main(argv=None) -> int:
    from core.bench.roofline import machine_info

    ap = argparse.ArgumentParser(prog="python -m benchmarks.packed_linear")
    ap.add_argument("--out", default="reports/packed-linear")
    ap.add_argument("--dot", action="store_true", help="the dot-product layout against oneDNN's packed weights")
    ap.add_argument("--fp32", action="store_true", help="fp32's FMA tiles against F.linear")
    args = ap.parse_args(argv)
    layout = "dot" if args.dot else "fp32" if args.fp32 else None
    if layout:
        lay = LAYOUTS[layout]
        if not lay.module.ready():
            raise SystemExit(f"{lay.module.__name__} does not serve on this CPU ({lay.cpus})")
        return layout_report(layout, args.out)
    probe = torch.zeros(32, 8, dtype=torch.bfloat16)
    if not use_packed(probe, probe):
        raise SystemExit("oneDNN with bf16 support is not available in this torch build")
    by_shape, by_step, m = shapes(), steps(), machine_info()
    md = ["# bf16 Linears through oneDNN's packed weights against F.linear", "",
          f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)",
          f"- {ROUNDS} rounds, alternating; made by `python -m benchmarks.packed_linear`", "",
          "## SmolLM2's shapes", "", *table(by_shape, "layer, rows"), "",
          "Results are bit-identical to the plain side's unless a row says otherwise (at 4-8 rows on AMX CPUs "
          "the plain side is the GEMV, which sums in another order: tests/test_linear.py bounds both).", "",
          "## Engine steps (default engine, embedded model, bf16)", "", *table(by_step, "step"), ""]
    write_report(args.out, "\n".join(md), {"machine": m, "rounds": ROUNDS, "shapes": by_shape, "steps": by_step})
    return 0


def layout_report(layout: str, out: str) -> int:
    from core.bench.roofline import machine_info
    from core.model.loader import DTYPES

    lay = LAYOUTS[layout]
    sides = lay.sides
    by_shape = shapes(lay.rows, lambda: lay.module.enabled(False), lay.dtype, lay.distinct)
    by_step, m = steps(layout), machine_info()
    md = [f"# {lay.title}", "",
          f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)",
          f"- {ROUNDS} rounds, alternating; made by `python -m benchmarks.packed_linear --{layout}`", "",
          "## SmolLM2's shapes", "", *table(by_shape, "layer, rows", sides), "",
          f"The two sum in another order ({lay.test} bounds both); {lay.cache_note}",
          "", f"## Engine steps (default engine{', ' + ' '.join(lay.overrides) if lay.overrides else ''}, embedded model, "
          f"{next(name for name, dtype in DTYPES.items() if dtype == lay.dtype)}; "
          "decode-only steps in the native plan)", "",
          *table(by_step, "step", sides), ""]
    write_report(out, "\n".join(md), {"machine": m, "rounds": ROUNDS, "shapes": by_shape, "steps": by_step})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
