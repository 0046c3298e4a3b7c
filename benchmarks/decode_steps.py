"""Decode steps by decode kernel and KV-cache dtype: `python -m benchmarks.decode_steps [--out DIR]`.

64 sequences decoding at contexts of 256, 512 and 1,024 tokens on the embedded model (the default
engine: continuous + paged, `model.dtype=auto`), one engine per configuration, all prefilled first:

- `base`: the defaults (the decode kernel this CPU builds: AMX tiles, AVX-512, or the AVX2 two-pass
  kernel on CPUs without AVX-512);
- `attention.decode=portable`: the portable C++ loop instead;
- `cache.dtype=bf16` (where the model runs fp32): K and V stored in bf16, half the bytes a step reads.

Each round times a few decode steps of every engine in turn (so the machine's drift falls on all of
them); the report gives each configuration's median ms a step and its per-round ratio to `base`
(median and range). A step here is the whole engine step (the layers, the head, sampling), so the
ratios are what a `decode_heavy` run would see at these contexts, without its prefill phase.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.ab import write_report
from benchmarks.profile_step import build

CONTEXTS, ROWS, ROUNDS, STEPS = (256, 512, 1024), 64, 7, 3


def configurations(model_dtype: str) -> dict[str, list[str]]:
    configs = {"base": [], "attention.decode=portable": ["attention.decode=portable"]}
    if model_dtype == "fp32":
        configs["cache.dtype=bf16"] = ["cache.dtype=bf16"]
    return configs


def decoding(overrides: list[str], context: int):
    """An engine with ROWS sequences whose prompts fill `context` tokens, every prompt prefilled."""
    from core.engine.types import SamplingParams

    engine = build(["cache.memory_gb=3.5", f"scheduler.max_num_seqs={ROWS}", "scheduler.max_num_batched_tokens=2048",
                    *overrides])
    for i in range(ROWS):
        engine.add_request([(1000 + 7 * i + j) % 40000 for j in range(context)],
                           SamplingParams(max_tokens=ROUNDS * STEPS + 8, ignore_eos=True))
    while engine.last_step is None or engine.last_step.num_prefill_tokens:
        engine.step()
    engine.step()
    return engine


def case(context: int, configs: dict[str, list[str]]) -> dict:
    engines = {}
    for name, overrides in configs.items():
        print(f"  {context} tokens: prefilling {ROWS} sequences for {name}", flush=True)
        engines[name] = decoding(overrides, context)
    times = {name: [] for name in engines}
    for _ in range(ROUNDS):
        for name, engine in engines.items():
            t = time.perf_counter()
            for _ in range(STEPS):
                engine.step()
            times[name].append((time.perf_counter() - t) / STEPS)
    out = {}
    for name, ts in times.items():
        ratios = sorted(b / t for b, t in zip(times["base"], ts))
        out[name] = {"ms": statistics.median(ts) * 1e3, "round_ms": [t * 1e3 for t in ts],
                     "speedup_vs_base": statistics.median(ratios), "range": [ratios[0], ratios[-1]]}
    del engines
    return out


def main(argv=None) -> int:
    from core.bench.roofline import machine_rates
    from core.config.compose import compose
    from core.engine.components import engine_config

    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_steps")
    ap.add_argument("--out", default="reports/decode-steps")
    args = ap.parse_args(argv)
    rates = machine_rates()
    dtype = engine_config(compose([])).model.dtype
    configs = configurations(dtype)
    results = {}
    for context in CONTEXTS:
        results[context] = case(context, configs)
        print({k: round(v["ms"], 1) for k, v in results[context].items()}, flush=True)
    lines = [f"# Decode steps by decode kernel and KV-cache dtype\n\n- machine: {rates['cpu']}, {rates['cores']} cores, "
             f"torch {rates['torch']}; the embedded model, the default engine (model.dtype=auto: {dtype} here)\n"
             f"- {ROWS} sequences decoding at each context, one engine per configuration; {ROUNDS} rounds of "
             f"{STEPS} steps of every engine in turn; medians over the rounds, the ratio to `base` taken round by "
             "round (its range in brackets)\n- made by `python -m benchmarks.decode_steps`\n",
             "| context | " + " | ".join(f"{n} ms/step" for n in configs) + " | " +
             " | ".join(f"{n} vs base" for n in configs if n != "base") + " |",
             "|---" * (2 * len(configs)) + "|"]
    for context, r in results.items():
        lines.append(f"| {context} | " + " | ".join(f"{r[n]['ms']:.1f}" for n in configs) + " | " +
                     " | ".join(f"{r[n]['speedup_vs_base']:.2f}x ({r[n]['range'][0]:.2f}-{r[n]['range'][1]:.2f})"
                                for n in configs if n != "base") + " |")
    lines.append("\nRatios above 1 mean `base` takes longer (the row is faster).")
    write_report(args.out, "\n".join(lines) + "\n", {"machine": rates, "model_dtype": dtype, "rows": ROWS,
                                                     "rounds": ROUNDS, "steps": STEPS, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
