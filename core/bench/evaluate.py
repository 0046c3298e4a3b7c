"""`python -m core eval`: what quantization costs in quality, and what it buys in bytes and speed.

Every variant (a list of overrides: quant=int8, quant=int4 quant.awq=true, cache.dtype=int8, ...)
is compared with the unquantized baseline on the same model file:
- next-token distributions along the baseline's own greedy continuations of a fixed prompt set
  (chat, code, math): mean KL(baseline || variant) and top-1 agreement;
- greedy continuations of the variant itself: exact-match rate against the baseline's;
- perplexity on English text that is on every machine (CPython's LICENSE.txt);
- weight bytes, and decode speed at batch 1 and batch 32.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig

from core.bench.roofline import machine_info, weight_bytes
from core.config.compose import compose
from core.config.schema import section
from core.corpus import prose_text
from core.engine.components import engine_config
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.errors import ConfigError
from core.model.quantize import forward_prompt
from scenarios.workloads import DATA

PROMPTS = DATA / "eval_prompts.json"


@dataclass
class EvalConfig:
    name: str = "quant-eval"
    baseline: list = field(default_factory=lambda: ["model.dtype=fp32", "quant=none", "cache.dtype=auto"])
    variants: dict = field(default_factory=dict)
    only: list | None = None  # run just these variants (by name); add new ones with +eval.variants.NAME=[...]
    new_tokens: int = 32
    ppl_windows: int = 8
    ppl_window_len: int = 256
    speed_new_tokens: int = 48
    speed_batches: list = field(default_factory=lambda: [1, 32])
    report_dir: str = "reports"


def heldout_text() -> str:
    license_file = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_file.exists():
        return license_file.read_text(encoding="utf-8")
    text = prose_text()
    return text[-len(text) // 20 :]


def _kv_forward(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits through the variant's model, its kernels (the backend's layouts, as its steps
    take them), attention backend and KV-cache dtype."""
    layouts = getattr(engine.backend, "layouts", contextlib.nullcontext)  # the kernels the engine's steps take
    with layouts():
        return forward_prompt(engine.model, ids, engine.attention, engine.kv_spec).float()


def _prompt_ids(engine: Engine) -> dict[str, list[list[int]]]:
    data = json.loads(PROMPTS.read_text())["prompts"]
    tok = engine.tokenizer
    return {cat: [tok.encode_chat([{"role": "user", "content": p}]) if tok.chat_template else tok.encode(p)
                  for p in prompts] for cat, prompts in data.items()}


def _greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _decode_speed(engine: Engine, batch: int, new_tokens: int) -> float:
    """Decode tokens per second with `batch` sequences running (prefill excluded)."""
    for i in range(batch):
        engine.add_request([engine.tokenizer.bos_token_id or 1] + list(range(100 + i, 131 + i)),
                           SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    engine.step()
    while engine.last_step.num_prefill_tokens or engine.last_step.num_waiting:
        engine.step()
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        tokens += engine.last_step.num_decode_tokens
    return tokens / (time.perf_counter() - t0)


def evaluate_variant(engine: Engine, prompts, reference, ppl_windows) -> dict:
    cats = {}
    for cat, plist in prompts.items():
        kls, agree, exact = [], [], []
        mine = _greedy(engine, plist, len(reference[cat]["tokens"][0]))
        for ids, cont, base_lp, own in zip(plist, reference[cat]["tokens"], reference[cat]["logprobs"], mine):
            lp = torch.log_softmax(_kv_forward(engine, ids + cont)[len(ids) - 1 : -1], dim=-1)
            kls.append((base_lp.exp() * (base_lp - lp)).sum(-1).mean().item())
            agree.append((lp.argmax(-1) == base_lp.argmax(-1)).float().mean().item())
            exact.append(float(own == cont))
        cats[cat] = {"kl": sum(kls) / len(kls), "top1_agreement": sum(agree) / len(agree),
                     "greedy_exact_match": sum(exact) / len(exact)}
    nll, count = 0.0, 0
    for ids in ppl_windows:
        lp = torch.log_softmax(_kv_forward(engine, ids)[:-1], dim=-1)
        nll -= lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        count += len(ids) - 1
    return {"categories": cats, "perplexity": math.exp(nll / count)}


def _reference(base: Engine, ev: EvalConfig) -> tuple[dict, dict, list[list[int]]]:
    """The baseline's prompts, its greedy continuations with their logprobs, and the perplexity windows."""
    prompts = _prompt_ids(base)
    text_ids = base.tokenizer.encode(heldout_text(), add_special_tokens=False)
    step = max(1, (len(text_ids) - ev.ppl_window_len) // max(1, ev.ppl_windows))
    windows = [text_ids[i * step : i * step + ev.ppl_window_len] for i in range(ev.ppl_windows)]
    reference = {}
    for cat, plist in prompts.items():
        toks = _greedy(base, plist, ev.new_tokens)
        lps = [torch.log_softmax(_kv_forward(base, ids + cont)[len(ids) - 1 : -1], dim=-1)
               for ids, cont in zip(plist, toks)]
        reference[cat] = {"tokens": toks, "logprobs": lps}
    return prompts, reference, windows


def _variant(overrides: list[str], base_overrides: list[str], ev: EvalConfig, prompts, reference, windows) -> dict:
    engine = Engine(engine_config(compose(base_overrides + list(overrides))))
    r = {"overrides": list(overrides), "weight_bytes": weight_bytes(engine.model),
         "kv_bytes_per_token": engine.kv_spec.bytes_per_token,
         "kv_tokens": engine.allocator.num_blocks * engine.allocator.block_size}
    r.update(evaluate_variant(engine, prompts, reference, windows))
    r["decode_tok_s"] = {str(b): _decode_speed(engine, b, ev.speed_new_tokens) for b in ev.speed_batches}
    calib = getattr(engine.quantizer, "report", None) or {}
    if calib and "awq_mse" in next(iter(calib.values())):
        r["awq_mse_ratio"] = sum(v["awq_mse"] for v in calib.values()) / sum(v["rtn_mse"] for v in calib.values())
    if calib and "smooth_mse" in next(iter(calib.values())):
        r["smooth_mse_ratio"] = (sum(v["smooth_mse"] for v in calib.values())
                                 / sum(v["plain_mse"] for v in calib.values()))
        r["smooth_groups"] = sum(v["alpha"] is not None for v in calib.values()), len(calib)
    return r


def run_eval(cfg: DictConfig, base_overrides: list[str]) -> int:
    from tqdm import tqdm

    ev = section(EvalConfig, cfg.get("eval"), "eval")
    unknown = sorted(set(ev.only or []) - set(ev.variants))
    if unknown:
        raise ConfigError(f"unknown eval variant(s) {', '.join(unknown)}; available: {', '.join(ev.variants)}")
    base = Engine(engine_config(compose(base_overrides + list(ev.baseline))))
    prompts, reference, windows = _reference(base, ev)
    results = {"baseline": {"overrides": list(ev.baseline), "weight_bytes": weight_bytes(base.model),
                            "kv_bytes_per_token": base.kv_spec.bytes_per_token,
                            **evaluate_variant(base, prompts, reference, windows)}}
    del base
    gc.collect()
    chosen = {n: o for n, o in ev.variants.items() if ev.only is None or n in ev.only}
    for name, overrides in tqdm(list(chosen.items()), desc="variants", unit="variant"):
        results[name] = _variant(overrides, base_overrides, ev, prompts, reference, windows)
        gc.collect()
    ec = engine_config(cfg)
    report = {"name": ev.name, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info(),
              "model": ec.model.path or ec.model.name,
              "config": {"new_tokens": ev.new_tokens, "ppl_windows": ev.ppl_windows, "ppl_window_len": ev.ppl_window_len,
                         "prompts_per_category": {c: len(p) for c, p in prompts.items()}},
              "results": results}
    out = Path(ev.report_dir) / ev.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(eval_markdown(report))
    print(eval_markdown(report))
    print(f"report: {out / 'report.md'}")
    return 0


def eval_markdown(report: dict) -> str:
    res = report["results"]
    plain = ([], ["quant=none"], ["quant=none", "model.dtype=bf16"])  # the unquantized variant sizes are against
    ref_name = next((n for n, r in res.items() if n != "baseline" and r["overrides"] in plain), None)
    ref_bytes = res[ref_name]["weight_bytes"] if ref_name else res["baseline"]["weight_bytes"]
    cats = list(res["baseline"]["categories"])
    head = ["variant", "weight MB", f"x {ref_name or 'baseline'}", "KV B/token", "perplexity"]
    head += [f"{c} KL" for c in cats] + [f"{c} top-1" for c in cats] + [f"{c} exact" for c in cats]
    head += ["decode tok/s b=1", "decode tok/s b=32"]
    rows = []
    for name, r in res.items():
        row = [f"{name} (`{' '.join(r['overrides'])}`)", f"{r['weight_bytes'] / 1e6:.0f}", f"{r['weight_bytes'] / ref_bytes:.2f}",
               r.get("kv_bytes_per_token", "-"), f"{r['perplexity']:.3f}"]
        row += [f"{r['categories'][c]['kl']:.4f}" for c in cats]
        row += [f"{r['categories'][c]['top1_agreement'] * 100:.1f} %" for c in cats]
        row += [f"{r['categories'][c]['greedy_exact_match'] * 100:.0f} %" for c in cats]
        sp = r.get("decode_tok_s", {})
        row += [f"{sp['1']:.1f}" if "1" in sp else "-", f"{sp['32']:.1f}" if "32" in sp else "-"]
        rows.append(row)
    lines = [f"# servelab quantization eval: {report['name']}", "",
             f"- model: {report['model']}; machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
             f"torch {report['machine']['torch']}",
             f"- baseline: `{' '.join(res['baseline']['overrides'])}`; KL and top-1 along the baseline's greedy "
             f"continuations ({report['config']['new_tokens']} tokens) of {report['config']['prompts_per_category']} "
             f"prompts; exact = the variant's own greedy continuation equals the baseline's",
             f"- perplexity: {report['config']['ppl_windows']} windows of {report['config']['ppl_window_len']} tokens "
             "of CPython's LICENSE.txt (English, on every machine)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    awq = [(n, r["awq_mse_ratio"]) for n, r in res.items() if "awq_mse_ratio" in r]
    if awq:
        lines += ["", "AWQ-style scaling, layer output MSE on the calibration prompts relative to round-to-nearest: " +
                  ", ".join(f"{n}: {v:.3f}" for n, v in awq)]
    smooth = [(n, r["smooth_mse_ratio"], r["smooth_groups"]) for n, r in res.items() if "smooth_mse_ratio" in r]
    if smooth:
        lines += ["", "SmoothQuant-style smoothing, W8A8 layer output MSE on the calibration prompts relative to plain "
                  "W8A8 (groups smoothed of all): " + ", ".join(f"{n}: {v:.3f} ({g[0]}/{g[1]})" for n, v, g in smooth)]
    lines += ["", "Decode speed: tokens per second of decode steps only (prefill excluded), same machine, one run "
              "after the other; noise on this shared machine is +-10 % or more.", ""]
    return "\n".join(lines)
