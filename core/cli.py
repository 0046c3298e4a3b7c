"""Command-line front: `python -m core COMMAND [flags] [overrides...]`.

argparse takes the command word and its flags; Hydra's compose API takes the overrides, so
`python -m core run scheduler=static quant=none` works like a Hydra app without `@hydra.main`.
This module only parses and dispatches: each command lives with the part of core it drives.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from omegaconf import DictConfig

from core.bench.preflight import check_before_loading
from core.config.compose import compose, expand_sweeps, first_line, is_config_error
from core.config.schema import run_config
from core.errors import ConfigError, ServelabError


def cmd_plugins(args, cfg: DictConfig) -> int:
    from core.engine.registry import get_registry

    rows = [(c.kind, c.name, c.source) for c in get_registry().all()]
    widths = [max(len(r[i]) for r in rows + [("kind", "name", "from")]) for i in range(3)]
    print("  ".join(h.ljust(w) for h, w in zip(("kind", "name", "from"), widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    return 0


def cmd_generate(args, cfg: DictConfig) -> int:
    from core.engine.components import engine_config
    from core.engine.engine import Engine
    from core.engine.records import sequence_record
    from core.engine.types import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos)
    engine = Engine(engine_config(cfg))
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt_token_ids=ids, params=params, arrival_time=t0)
    sequence = engine.requests[rid].seqs[0]
    final = None
    if not args.json:
        print(args.prompt if not args.chat else "", end="", flush=True)
    while engine.has_unfinished():
        for out in engine.step():
            if not args.json:
                for text, _ in out.deltas.values():
                    print(text, end="", flush=True)
            final = out if out.finished else final
    t1 = time.perf_counter()
    seq = final.outputs[0]
    if args.json:
        r = sequence_record(sequence).to_dict()
        print(json.dumps({
            "request_id": rid, "prompt": args.prompt, "prompt_token_ids": ids, "text": seq.text,
            "token_ids": seq.token_ids, "finish_reason": seq.finish_reason,
            "timings": {k: r[k] for k in ("ttft_s", "tpot_s", "e2e_s", "prefill_s")}
            | {"tokens_per_s": len(seq.token_ids) / (t1 - t0)},
        }, indent=2))
    else:
        print(f"\n[{len(seq.token_ids)} tokens in {t1 - t0:.2f}s, finish_reason={seq.finish_reason}]",
              file=sys.stderr)
    return 0


def cmd_run(args, cfg: DictConfig) -> int:
    from core.bench.run import compare, run_benchmark

    if args.multirun:
        fixed, variants = expand_sweeps(args.overrides)
        return compare(rate_sweep_arrivals(fixed, variants), variants, None, run_config(cfg).name)
    return run_benchmark(cfg)


def rate_sweep_arrivals(fixed: list[str], variants: list[list[str]]) -> list[str]:
    """A sweep over workload.rate means open-loop arrivals at that rate: Poisson unless the command
    line names the arrival process."""
    swept = any(o.startswith("workload.rate=") for var in variants for o in var)
    named = any(o.startswith("workload.arrival=") for o in fixed + [o for var in variants for o in var])
    if swept and not named:
        print("workload.rate is swept: arrivals are Poisson (workload.arrival=poisson)")
        return fixed + ["workload.arrival=poisson"]
    return fixed


def cmd_compare(args, cfg: DictConfig) -> int:
    from core.bench.run import compare

    if not args.variant:
        raise ConfigError('compare needs at least one -v "OVERRIDES" (e.g. -v scheduler=static -v peer=hf)')
    return compare(list(args.overrides), [v.split() for v in args.variant], args.label, run_config(cfg).name)


def bench_overrides(overrides: list[str], multirun: bool) -> tuple[list[str], DictConfig]:
    """A `bench -m` sweep over users or rate becomes the stages of one curve report; the scenario
    names its workload unless the command line does."""
    if multirun:
        fixed, variants = expand_sweeps(overrides)
        stages: dict[str, list[str]] = {}
        for ov in (o for var in variants for o in var):
            key, _, value = ov.partition("=")
            stages.setdefault(key, [])
            if value not in stages[key]:
                stages[key].append(value)
        unknown = set(stages) - {"scenario.users", "scenario.rate_per_user"}
        if unknown:
            raise ConfigError(f"bench -m sweeps scenario.users or scenario.rate_per_user, not {', '.join(sorted(unknown))}")
        if "scenario.users" in stages:
            fixed.append(f"scenario.ramp=[{','.join(stages['scenario.users'])}]")
        if "scenario.rate_per_user" in stages:
            fixed.append(f"++scenario.ramp_rates=[{','.join(stages['scenario.rate_per_user'])}]")
        overrides = fixed
    cfg = compose(overrides)
    if not any(o.startswith("workload=") for o in overrides):
        overrides = overrides + [f"workload={cfg.scenario.workload}"]
        cfg = compose(overrides)
    return overrides, cfg


def cmd_bench(args, cfg: DictConfig) -> int:
    from core.bench.loadtest import run_bench

    overrides, cfg = bench_overrides(list(args.overrides), args.multirun)
    if args.variant and (cfg.scenario.ramp or cfg.scenario.get("ramp_rates")):
        raise ConfigError("bench -v compares one stage per variant; drop the ramp (or -m) or the variants")
    return run_bench(cfg, overrides, [v.split() for v in args.variant or []], args.label)


def cmd_serve(args, cfg: DictConfig) -> int:
    from core.engine.components import engine_config
    from core.replicas.ray_serve import serve_replicas, uses_ray
    from core.server.app import serve

    if uses_ray(engine_config(cfg).parallel):  # replicas: Ray Serve runs the servers
        return serve_replicas(cfg, args.overrides)
    return serve(cfg, args.overrides)


def cmd_eval(args, cfg: DictConfig) -> int:
    from core.bench.evaluate import run_eval

    # the variants are composed on top of the command line's own overrides
    return run_eval(cfg, [o for o in args.overrides if not o.startswith("eval.")])


def cmd_calibrate(args, cfg: DictConfig) -> int:
    from core.bench.calibrate import calibrate

    return calibrate(cfg, args.overrides)


def cmd_plan(args, cfg: DictConfig) -> int:
    from core.bench.plan import run_plan

    return run_plan(cfg)


def cmd_disagg(args, cfg: DictConfig) -> int:
    from core.bench.disagg_report import run_disagg

    return run_disagg(cfg)


COMMANDS = {"calibrate": cmd_calibrate, "plan": cmd_plan, "disagg": cmd_disagg, "run": cmd_run, "compare": cmd_compare, "plugins": cmd_plugins, "generate": cmd_generate,
            "eval": cmd_eval, "serve": cmd_serve, "bench": cmd_bench}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m core", description="servelab: a pluggable LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str):
        p = sub.add_parser(name, help=help)
        p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. scheduler=static model.dtype=bf16")
        return p

    add("run", "run the offline benchmark on a workload and write a report").add_argument(
        "-m", "--multirun", action="store_true",
        help="sweep comma-separated values (scheduler=static,continuous) into one comparison report")
    c = add("compare", "run several configurations on the same workload; one comparison report")
    c.add_argument("-v", "--variant", action="append", help='one configuration, e.g. -v "scheduler=static"')
    c.add_argument("--label", action="append", help="a name for each variant, in order")
    add("plan", "KV memory, concurrency and max_model_len for a model on hardware=NAME; with plan.slo=true "
        "the replicas for a request rate at the SLO targets (simulated)")
    add("disagg", "prefill/decode disaggregation against colocated replicas on the same devices, simulated: "
        "SLO attainment by rate, capacities and the break-even")
    add("calibrate", "fit this CPU's hardware profile (hardware=cpu) from measured steps, then check the simulator "
        "against real runs of calibrate.validate")
    add("plugins", "list every component by kind, name and the package it came from")
    add("eval", "quality, size and speed of quantization variants against the unquantized baseline")
    add("serve", "an OpenAI-compatible HTTP server with Prometheus metrics and guard rails")
    b = add("bench", "replay a locust scenario against servelab's server (started for you) or target.url=URL")
    b.add_argument("-m", "--multirun", action="store_true",
                   help="sweep scenario.users=1,2,4 or scenario.rate_per_user=... into one curve report")
    b.add_argument("-v", "--variant", action="append", help='one server configuration, e.g. -v "parallel.router=pow2"')
    b.add_argument("--label", action="append", help="a name for each variant, in order")
    g = add("generate", "generate a completion for one prompt, streamed to the terminal")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print text, token ids and timings as JSON")
    return parser


def parse_args(argv: list[str] | None):
    parser = build_parser()
    # Overrides may stand between the flags (`compare workload=x -v ... run.name=y`): argparse leaves
    # the ones after a flag unparsed, and they are overrides too.
    args, rest = parser.parse_known_args(argv)
    stray = [a for a in rest if a.startswith("-")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = list(args.overrides) + rest
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # run and compare report their set-up (KV-cache arithmetic); generate keeps stderr for errors
    level = logging.INFO if args.command in ("run", "compare", "eval", "serve", "bench", "calibrate") else logging.WARNING
    logging.basicConfig(level=level, format="servelab: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll is noise
    try:
        overrides = expand_sweeps(args.overrides)[0] if getattr(args, "multirun", False) else args.overrides
        if args.command in ("plan", "disagg") and not any(o.startswith("backend=") for o in overrides):
            overrides = ["backend=simulator"] + overrides  # their hardware is simulated hardware
        cfg = compose(overrides)
        check_before_loading(args.command, cfg)
        if int(os.environ.get("RANK", "0")) > 0:  # torchrun's other ranks serve rank 0's engine
            return run_worker(cfg)
        return COMMANDS[args.command](args, cfg)
    except ServelabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # Hydra's own override and composition errors are the user's to fix
        if is_config_error(e):
            print(f"error: {first_line(e)}", file=sys.stderr)
            return 2
        raise


def run_worker(cfg: DictConfig) -> int:
    from core.engine.components import build_worker_backend, engine_config
    from core.parallel.executor import worker_main

    ec = engine_config(cfg)
    worker_main(build_worker_backend, ec, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")
    return 0
