"""Where a step's time goes: `python -m benchmarks.profile_step [--out reports/profile-step] [overrides...]`.

Two steps of the default engine on the embedded model (continuous + paged, model.dtype=auto), under the torch
profiler: a decode-only step of 64 rows (64 sequences with 128-token prompts, all prefilled), and
a mixed step of those decodes plus one 512-token prefill chunk, and a decode step of one sequence
(batch 1, where the fixed cost of a step shows). Each is printed twice: by operator
(torch's own names) and by servelab stage (the engine's components, wrapped in profiler ranges
here, so production code carries no instrumentation). Writes report.md with both tables.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile, record_function

STAGES = {  # (object path on the engine, method) -> range name
    ("scheduler", "schedule"): "schedule",
    ("core.runner", "prepare"): "runner.prepare",
    ("attention", "plan"): "attention.plan",
    ("attention", "forward"): "attention (per layer)",
    ("backend", "execute"): "forward (all layers)",
    ("decoder", "accept"): "decoder.accept (sampling)",
    ("scheduler", "update_from_output"): "update_from_output",
    ("output", "process"): "output processor",
}


def instrument(engine) -> None:
    """Wrap each stage of this engine in a profiler range (instance attributes only)."""
    for (path, method), name in STAGES.items():
        obj = engine
        for part in path.split("."):
            obj = getattr(obj, part)
        fn = getattr(obj, method)

        def wrapped(*a, _fn=fn, _name=name, **kw):
            with record_function(_name):
                return _fn(*a, **kw)

        setattr(obj, method, functools.wraps(fn)(wrapped))
    model = engine.model
    for layer in model.model.layers:
        for attr, name in (("mlp", "mlp (per layer)"), ("input_layernorm", "norms"), ("post_attention_layernorm", "norms")):
            mod = getattr(layer, attr)
            mod.forward = _ranged(mod.forward, name)
        attn = layer.self_attn
        for proj in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj"):  # q/k/v fused by core.model.fuse or not
            m = getattr(attn, proj, None)
            if m is not None:
                m.forward = _ranged(m.forward, "qkv/o projections")
    model.compute_logits = _ranged(model.compute_logits, "lm_head (sampled rows)")
    native = getattr(engine.backend, "native_decode", None)
    if native is not None:  # its layers run in C++: they show in the operator table only
        native.forward = _ranged(native.forward, "native decode (all layers, one C++ call)")


def _ranged(fn, name):
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        with record_function(name):
            return fn(*a, **kw)

    return wrapped


# the eager forward for every step: what the A/B benchmarks of its kernels (eager_ops, gemv,
# packed_linear) measure, decode steps included (by default those run as one C++ call: native_decode)
EAGER = ["backend.native_decode=false"]


def build(overrides: list[str]):
    from core.config.compose import compose
    from core.engine.components import engine_config
    from core.engine.engine import Engine

    return Engine(engine_config(compose(overrides)))


def decoding_engine(overrides: list[str], rows: int = 64):
    from core.engine.types import SamplingParams

    # a budget of 1024 tokens, so that the mixed steps here carry the whole 512-token prompt
    engine = build(["scheduler.max_num_batched_tokens=1024"] + overrides + [f"scheduler.max_num_seqs={rows + 1}"])
    for i in range(rows):
        engine.add_request(list(range(1000 + i, 1128 + i)), SamplingParams(max_tokens=400, ignore_eos=True))
    while engine.last_step is None or engine.last_step.num_prefill_tokens:
        engine.step()
    return engine


def table(prof, stage_names: set[str], top: int = 18) -> tuple[str, str]:
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ops = sorted((e for e in events if e.key not in stage_names), key=lambda e: -e.self_cpu_time_total)[:top]
    by_op = ["| operator | calls | self ms | share |", "|---|---|---|---|"]
    by_op += [f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1e3:.2f} | {e.self_cpu_time_total / total * 100:.1f} % |"
              for e in ops]
    stages = sorted((e for e in events if e.key in stage_names), key=lambda e: -e.cpu_time_total)
    by_stage = ["| servelab stage | calls | total ms (children included) |", "|---|---|---|"]
    by_stage += [f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:.2f} |" for e in stages]
    return "\n".join(by_op), "\n".join(by_stage)


def profile_steps(engine, label: str, n: int, make_step) -> tuple[str, float]:
    for _ in range(2):  # warm
        make_step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            make_step()
        wall = (time.perf_counter() - t0) / n
    names = set(STAGES.values()) | {"mlp (per layer)", "norms", "qkv/o projections", "lm_head (sampled rows)",
                                    "native decode (all layers, one C++ call)"}
    by_op, by_stage = table(prof, names)
    return f"## {label}\n\n{n} steps profiled; {wall * 1e3:.1f} ms a step (wall, under the profiler)\n\n" \
           f"### By servelab stage\n\n{by_stage}\n\n### By operator (self time)\n\n{by_op}\n", wall


def native_note(engine) -> str:
    if getattr(engine.backend, "native_decode", None) is None:
        return "the eager forward (per-layer stages below)"
    return ("one C++ call (`backend.native_decode`): its layers show in the operator table only, "
            "under their kernels' names")


def main(argv=None) -> int:
    from core.engine.types import SamplingParams

    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_step")
    ap.add_argument("--out", default="reports/profile-step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    engine = decoding_engine(args.overrides)
    instrument(engine)
    decode_md, decode_wall = profile_steps(engine, "Decode-only step, 64 rows", args.steps, engine.step)

    fresh = iter(range(10**6))

    def mixed_step():  # the 64 decodes plus a fresh 512-token prompt (no prefix-cache hit), prefilled in this one step
        first = 5000 + 600 * next(fresh)
        engine.add_request(list(range(first, first + 512)), SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()

    mixed_md, mixed_wall = profile_steps(engine, "Mixed step: 64 decodes + one 512-token prefill chunk",
                                         args.steps, mixed_step)
    single = decoding_engine(args.overrides, rows=1)
    instrument(single)
    single_md, _ = profile_steps(single, "Decode step, batch 1", args.steps * 4, single.step)
    from core.bench.roofline import machine_info

    m = machine_info()
    md = (f"# Where a step's time goes\n\n- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}\n"
          f"- engine: the default (continuous + paged, {engine.config.model.dtype}), overrides: `{' '.join(args.overrides) or 'none'}`\n"
          f"- decode-only steps: {native_note(engine)}\n"
          f"- made by `python -m benchmarks.profile_step`\n\n{decode_md}\n{mixed_md}\n{single_md}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md)
    print(md)
    print(f"decode step {decode_wall * 1e3:.1f} ms; report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
