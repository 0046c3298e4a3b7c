"""Quantized weights against bf16 inside real engine steps: `python -m benchmarks.quant_steps`.

One engine per configuration (bf16, `quant=int8`, `quant=gguf`, or `--quant ...`) on the embedded
model, five step shapes: 64 decodes; 64 decodes plus a fresh 64-token prompt prefilled in the same
step (128 tokens: the CPU's default step budget since 2026-12-06; this case since 2026-12-07), and
plus a 192-token one (256 tokens, the budget before); 8 decodes (since 2026-12-07); one decode (batch 1). Rounds alternate between the engines, so the machine's drift falls on all of
them; the report gives each one's median step time and the median and range of its per-round speed
against the unquantized model (> 1: faster). Where many-row INT8 steps run an integer GEMM (AMX tiles,
or oneDNN's INT8 GEMM on AVX512-VNNI), `int8` also runs without it (`int8 (dequantized GEMM)`,
servelab_kernels.cpu_quant.int_gemm(False): the weight dequantized to bf16 for each call), side by
side; where INT4 steps do (q4_gemm_int, AVX512-VNNI), `gguf` and `int4` the same. `--unpacked` adds
each INT8 quantizer without its packed weight copy (`(no packed copy)`, servelab_kernels.int8_pack: on
AVX512-VNNI oneDNN's INT8 GEMM over the plain weight, on AVX2 the GEMV up to 16 rows and fp32 panels of
the dequantized weight above, where the copy runs the vpmaddwd GEMM). A whole `compare`
runs its configurations one after the other, and on a shared 2-core machine their order can move a
5 % ratio. Writes reports/quant-steps/report.{md,json}.
"""

from __future__ import annotations

import argparse
import random
import statistics

from benchmarks.ab import mean_seconds, write_report
from benchmarks.profile_step import decoding_engine

ROUNDS = 9
PREFILLS = (64, 192)  # beside 64 decodes: a 128-token step (the CPU's default budget) and a 256-token one


def alternating(steps: dict, n: int) -> dict:
    """steps: name -> a function running one step; the first name is the reference (quant=none)."""
    for step in steps.values():
        step()  # warm
    times = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            times[name].append(mean_seconds(step, n))
    ref = next(iter(steps))
    out = {}
    for name, ts in times.items():
        speed = [r / t for r, t in zip(times[ref], ts)]
        out[name] = {"ms": statistics.median(ts) * 1e3, "speed_vs_none": statistics.median(speed),
                     "range": [min(speed), max(speed)]}
    return out


NO_INT = " (dequantized GEMM)"  # an engine stepped with servelab_kernels.cpu_quant.int_gemm(False)
NO_PACK = " (no packed copy)"  # INT8 layers made without their packed copy (servelab_kernels.int8_pack)
NO_DOT = " (14-bit VNNI GEMM)"  # W8A16 stepped with servelab_kernels.cpu_quant.bf16_dot(False)
# names beside the quantizers' own: their overrides
ALIASES = {"int8-w8a8": ["quant=int8", "quant.w8a8=true"],  # INT8 activations per token too
           "int8-w8a8-smooth": ["quant=int8", "quant.w8a8=true", "quant.smooth=true"]}  # and SmoothQuant-style scales


def variants(quants: list[str]) -> list[str]:
    """The quantizers to run; where INT8 or INT4 has an integer GEMM, those also without it, side by side."""
    from servelab_kernels import cpu_quant

    def has_int_gemm(q: str) -> bool:
        return cpu_quant.int_gemm_ready() if q == "int8" else q in ("gguf", "int4") and cpu_quant.int_gemm_built()

    dot = [q + NO_DOT for q in quants if q == "int8" and hasattr(cpu_quant.ops(), "q8_gemm_bf16")]
    return quants + dot + [q + NO_INT for q in quants if has_int_gemm(q)]


def base(q: str) -> str:
    return q.removesuffix(NO_INT).removesuffix(NO_PACK).removesuffix(NO_DOT)


def build(overrides: list[str], q: str, rows: int):
    from servelab_kernels import int8_pack

    with int8_pack.packing(not q.endswith(NO_PACK)):
        return decoding_engine(overrides, rows=rows)


def measure(quants: list[str]) -> tuple[dict, str]:
    from core.engine.types import SamplingParams
    from servelab_kernels import cpu_quant

    names = ["none"] + quants
    overrides = {q: ALIASES.get(base(q), [f"quant={base(q)}"]) for q in names}

    def stepper(engine, q):  # the engine's step, with the integer GEMM (NO_INT) or the bf16 dot GEMM (NO_DOT) off
        if not q.endswith((NO_INT, NO_DOT)):
            return engine.step
        switch = cpu_quant.int_gemm if q.endswith(NO_INT) else cpu_quant.bf16_dot

        def step():
            with switch(False):
                engine.step()
        return step

    engines = {q: build(overrides[q], q, 64) for q in names}
    rng = random.Random(0)

    def mixed(engine, q, tokens):
        def step():  # the 64 decodes plus a fresh prompt (random tokens: no prefix-cache hit), prefilled in this step
            prompt = [rng.randrange(1000, 49000) for _ in range(tokens)]
            engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            stepper(engine, q)()
        return step

    dtype = engines["none"].config.model.dtype
    cases = {"decode, 64 rows": alternating({q: stepper(e, q) for q, e in engines.items()}, 8)}
    for tokens in PREFILLS:
        cases[f"64 decodes + a {tokens}-token prefill"] = alternating(
            {q: mixed(e, q, tokens) for q, e in engines.items()}, 4)
    del engines
    eights = {q: build(overrides[q], q, 8) for q in names}
    cases["decode, 8 rows"] = alternating({q: stepper(e, q) for q, e in eights.items()}, 20)
    del eights
    singles = {q: build(overrides[q], q, 1) for q in names}
    cases["decode, batch 1"] = alternating({q: stepper(e, q) for q, e in singles.items()}, 30)
    return cases, dtype


def legend(quants: list[str]) -> str:
    """What each side-by-side variant in `quants` ran, on this machine's build."""
    from servelab_kernels import int8_pack

    unpacked = ("oneDNN's INT8 GEMM over the plain weight" if int8_pack.layout() == "vnni" else
                "the GEMV up to 16 rows, above them fp32 panels of the weight dequantized per call")
    parts = {NO_INT: "stepped without the integer GEMM, the weight dequantized to bf16 for each many-row call, "
                     "as CPUs without AMX or AVX512-VNNI run it",
             NO_PACK: f"INT8 layers without their packed weight copy ({unpacked})",
             NO_DOT: "W8A16 without the bf16 dot GEMM, two INT8 part rows a row at any number of rows"}
    said = [f"`{suffix.strip()}`: {text}" for suffix, text in parts.items() if any(q.endswith(suffix) for q in quants)]
    return "; ".join(["`none` is the unquantized model"] + said)


def render(cases: dict, quants: list[str], dtype: str, m: dict) -> str:
    names = ["none"] + quants
    head = "| step | " + " | ".join(f"{q} ms" for q in names) + " | " + \
        " | ".join(f"{q} speed / none (range)" for q in quants) + " |"
    rows = [head, "|" + "---|" * (1 + len(names) + len(quants))]
    for step, c in cases.items():
        rows.append(f"| {step} | " + " | ".join(f"{c[q]['ms']:.1f}" for q in names) + " | " +
                    " | ".join(f"{c[q]['speed_vs_none']:.3f}x ({c[q]['range'][0]:.2f}-{c[q]['range'][1]:.2f})"
                               for q in quants) + " |")
    return (f"# Quantized weights against the unquantized model, in real engine steps\n\n"
            f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}\n"
            f"- engines: the default (continuous + paged, model.dtype=auto: {dtype}) on the embedded model, one "
            f"per quantizer ({legend(quants)}); {ROUNDS} rounds, alternating\n"
            f"- made by `python -m benchmarks.quant_steps`\n\n" + "\n".join(rows) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quant_steps")
    ap.add_argument("--quant", nargs="+", default=["int8", "gguf"],
                    help=f"quantizers beside bf16 (or {', '.join(ALIASES)})")
    ap.add_argument("--out", default="reports/quant-steps")
    ap.add_argument("--unpacked", action="store_true",
                    help="INT8 quantizers also without their packed weight copy (VNNI or AVX2 layout), side by side")
    args = ap.parse_args(argv)
    from core.bench.roofline import machine_info

    quants = variants(args.quant)
    if args.unpacked:
        quants += [q + NO_PACK for q in args.quant if "quant=int8" in ALIASES.get(q, [f"quant={q}"])]
    cases, dtype = measure(quants)
    m = machine_info()
    md = render(cases, quants, dtype, m)
    write_report(args.out, md, {"machine": m, "rounds": ROUNDS, "dtype": dtype, "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
