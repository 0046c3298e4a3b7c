"""bf16 Linears through oneDNN's packed weights (servelab_kernels.linear.Linear) against F.linear on the
plain weights: `python -m benchmarks.packed_linear`.

Two tables. SmolLM2's shapes (q/k/v fused, o, gate/up fused, down, the head) at 4-256 rows (at 4 and 8 rows the plain
side is the GEMV, whose sums differ from oneDNN's in order; on a CPU without AMX both sides take it): each
side the median of 7 rounds of 50 calls, alternating, with the results compared bit for bit. Then
real engine steps of the default engine on the embedded model (bf16): 64 decodes, the same plus a
fresh 512-token prompt prefilled in the step, 8 decodes (on AMX CPUs the packed GEMM's rows, the
GEMV's where packing is off), rounds alternating between packed and plain weights
(`servelab_kernels.linear.packing(False)`) on one engine. Writes reports/packed-linear/report.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.ab import alternating_rounds, write_report
from benchmarks.profile_step import EAGER, decoding_engine
from servelab_kernels.linear import Linear, packing, use_packed

ROUNDS = 7
SHAPES = {"qkv (960 x 576)": (960, 576), "o (576 x 576)": (576, 576), "gate/up (3072 x 576)": (3072, 576),
          "down (576 x 1536)": (576, 1536), "head (49152 x 576)": (49152, 576)}
ROWS = (4, 8, 17, 64, 256)


def alternate(step, n: int) -> dict:
    r = alternating_rounds(step, n, ROUNDS, lambda: packing(False))
    packed, plain, ratios = r["mine"], r["baseline"], r["ratios"]
    return {"packed_ms": statistics.median(packed) * 1e3, "plain_ms": statistics.median(plain) * 1e3,
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)], "calls_a_round": n}


def shapes() -> dict:
    out = {}
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        layer = Linear(k, n, bias=False).requires_grad_(False)
        layer.weight.data = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
            with packing(False):
                plain = layer(x)
            case = alternate(lambda: layer(x), 50 if n < 10000 else 5)  # noqa: B023
            case["identical"] = bool(torch.equal(layer(x), plain))
            out[f"{name}, {rows} rows"] = case
    return out


def steps() -> dict:
    from core.engine.types import SamplingParams

    engine = decoding_engine(EAGER, rows=64)
    fresh = iter(range(10**6))

    def mixed():
        first = 5000 + 600 * next(fresh)
        engine.add_request(list(range(first, first + 512)), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()

    cases = {"decode, 64 rows": alternate(engine.step, 4), "64 decodes + a 512-token prefill": alternate(mixed, 2)}
    # 8 rows: on AMX CPUs the packed GEMM takes these from the GEMV (plain weights: the GEMV's 16 rows)
    cases["decode, 8 rows"] = alternate(decoding_engine(EAGER, rows=8).step, 10)
    return cases


def table(cases: dict, what: str) -> list[str]:
    lines = [f"| {what} | plain weights, ms | packed, ms | speed-up (range over rounds) |", "|---|---|---|---|"]
    for name, c in cases.items():
        same = "" if c.get("identical", True) else " (results differ)"
        lines.append(f"| {name} | {c['plain_ms']:.3f} | {c['packed_ms']:.3f} | {c['speedup']:.2f}x "
                     f"({c['speedup_range'][0]:.2f}-{c['speedup_range'][1]:.2f}){same} |")
    return lines


def main(argv=None) -> int:
    from core.bench.roofline import machine_info

    ap = argparse.ArgumentParser(prog="python -m benchmarks.packed_linear")
    ap.add_argument("--out", default="reports/packed-linear")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
