"""The eager CPU forward's C++ elementwise ops (servelab_kernels.cpu_ops: RMSNorm with the residual add,
rotary, silu-and-multiply) against their torch twins, inside real engine steps:
`python -m benchmarks.eager_ops`.

The default engine on the embedded model (bf16), three step shapes: 64 decodes, the same 64 plus a
fresh 512-token prompt prefilled in the step, and one decode (batch 1). Rounds alternate between
the C++ ops and the twins (`cpu_ops.disabled()`) on the same engine, so the machine's drift falls
on both; the report gives each side's median step time and the median and range of the per-round
ratios. Writes reports/eager-ops/report.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.ab import alternating_rounds, write_report
from benchmarks.profile_step import EAGER, decoding_engine
from servelab_kernels import cpu_ops

ROUNDS = 7


def side_by_side(step, n: int) -> dict:
    r = alternating_rounds(step, n, ROUNDS, cpu_ops.disabled)
    cpp, twin, ratios = r["mine"], r["baseline"], r["ratios"]
    return {"cpp_ms": statistics.median(cpp) * 1e3, "torch_ms": statistics.median(twin) * 1e3,
            "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)], "steps_a_round": n}


def measure() -> dict:
    from core.engine.types import SamplingParams

    engine = decoding_engine(EAGER, rows=64)
    fresh = iter(range(10**6))

    def mixed():  # the 64 decodes plus a fresh 512-token prompt, prefilled in this one step
        first = 5000 + 600 * next(fresh)
        engine.add_request(list(range(first, first + 512)), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()

    cases = {"decode, 64 rows": side_by_side(engine.step, 4), "64 decodes + a 512-token prefill": side_by_side(mixed, 2)}
    single = decoding_engine(EAGER, rows=1)
    cases["decode, batch 1"] = side_by_side(single.step, 20)
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.eager_ops")
    ap.add_argument("--out", default="reports/eager-ops")
    args = ap.parse_args(argv)
    if cpu_ops.load() is None:
        raise SystemExit("the C++ ops did not build here (a C++ compiler and Python's headers are needed)")
    from core.bench.roofline import machine_info

    cases, m = measure(), machine_info()
    rows = [f"| {name} | {c['torch_ms']:.1f} | {c['cpp_ms']:.1f} | {c['speedup']:.3f}x "
            f"({c['speedup_range'][0]:.3f}-{c['speedup_range'][1]:.3f}) |" for name, c in cases.items()]
    md = (f"# The eager CPU forward's elementwise ops: C++ against the torch twins\n\n"
          f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}\n"
          f"- engine: the default (continuous + paged, bf16) on the embedded model; {ROUNDS} rounds, alternating\n"
          f"- made by `python -m benchmarks.eager_ops`\n\n"
          "| step | torch twins, ms | C++ ops, ms | speed-up (range over rounds) |\n|---|---|---|---|\n"
          + "\n".join(rows) + "\n")
    write_report(args.out, md, {"machine": m, "rounds": ROUNDS, "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
