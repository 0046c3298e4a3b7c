"""Decode steps as one C++ call (`backend.native_decode`, core/model/decode_plan.py) against the eager
forward, inside real engine steps: `python -m benchmarks.native_decode`.

The default engine on the embedded model, bf16, `quant=int8` and `quant=gguf`, decode-only steps of
1, 4, 16 and 64 rows (sequences with 128-token prompts, all prefilled). Rounds alternate between the
plan and the eager forward (`native_decoding(False)`) on the same engine, so the machine's drift
falls on both; the report gives each side's median step time and the median and range of the
per-round ratios. The two compute the same logits bit for bit (tests/test_cpu_decode.py); what
differs is the Python between the kernels. Writes reports/native-decode/report.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.ab import alternating_rounds, write_report
from benchmarks.profile_step import decoding_engine
from core.model.decode_plan import native_decoding

ROUNDS = 7
ROWS = (1, 4, 16, 64)
ENGINES = {"bf16": [], "int8": ["quant=int8"], "gguf": ["quant=gguf"]}


def steps_a_round(rows: int) -> int:
    """Steps a round: about 16 rows' worth, and at most 24, so that the 2 x ROUNDS rounds end well
    before the sequences' 400 tokens (profile_step.decoding_engine) run out."""
    return max(4, min(24, 64 // rows))


def measure(engines: dict[str, list[str]], rows_list=ROWS) -> dict:
    cases = {}
    for name, overrides in engines.items():
        for rows in rows_list:
            engine = decoding_engine(overrides, rows=rows)
            if engine.backend.native_decode is None:
                raise SystemExit(f"{name}: the native decode plan does not apply here")
            n = steps_a_round(rows)
            assert 2 * (ROUNDS * n + 1) < 400, "the rounds would outlast the sequences"
            r = alternating_rounds(engine.step, n, ROUNDS, lambda: native_decoding(False))
            native, eager, ratios = r["mine"], r["baseline"], r["ratios"]
            cases[f"{name}, {rows} rows"] = {
                "engine": name, "rows": rows, "native_ms": statistics.median(native) * 1e3,
                "eager_ms": statistics.median(eager) * 1e3, "speedup": statistics.median(ratios),
                "speedup_range": [min(ratios), max(ratios)], "steps_a_round": steps_a_round(rows)}
            print(f"{name}, {rows} rows: {cases[f'{name}, {rows} rows']['speedup']:.3f}x", flush=True)
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.native_decode")
    ap.add_argument("--out", default="reports/native-decode")
    args = ap.parse_args(argv)
    from core.bench.roofline import machine_info

    cases, m = measure(ENGINES), machine_info()
    rows = [f"| {c['engine']} | {c['rows']} | {c['eager_ms']:.2f} | {c['native_ms']:.2f} | {c['speedup']:.3f}x "
            f"({c['speedup_range'][0]:.3f}-{c['speedup_range'][1]:.3f}) | {1e3 / c['native_ms']:.1f} |"
            for c in cases.values()]
    md = (f"# Decode steps as one C++ call against the eager forward\n\n"
          f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}\n"
          f"- engine: the default (continuous + paged) on the embedded model; decode-only steps over 128-token "
          f"prompts; {ROUNDS} rounds, alternating on the same engine\n"
          f"- made by `python -m benchmarks.native_decode`\n\n"
          "| engine | rows | eager, ms a step | native, ms a step | speed-up (range over rounds) | native steps/s |\n"
          "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    write_report(args.out, md, {"machine": m, "rounds": ROUNDS, "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
