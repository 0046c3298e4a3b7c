"""`python -m core calibrate`: fit this machine's CPU profile from measured steps, then check the
simulator against the real engine on whole workloads.

1. Grid: the real engine (the configured model, default bf16 on this CPU) runs decode-only steps
   of B rows at context C, and prefill chunks of T tokens; every step's shape and time is kept.
2. Fit: the profile's peaks are this machine's measured matmul rate and read bandwidth (the
   roofline's, core.bench.roofline); the fit finds the efficiencies (matmul, attention,
   bandwidth) by grid search and the per-step and per-sequence overheads by least squares, for
   the least squared relative error of the step times. Saved where `hardware=cpu` finds it.
3. Validation: each workload runs on the real backend and on `backend=simulator hardware=cpu`;
   the report sets predicted against measured throughput and TTFT/TPOT percentiles.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from core.config.schema import EngineConfig, section
from core.engine.hardware import HardwareProfile, StepTimeModel, calibrated_profile_path, weight_bytes_per_param
from core.model.loader import DTYPES


@dataclass
class CalibrateConfig:
    decode_batches: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    contexts: list[int] = field(default_factory=lambda: [128, 1024])
    prefill_tokens: list[int] = field(default_factory=lambda: [32, 128, 512, 1024])  # within the step budget
    reps: int = 5  # steps kept per grid point (after one unkept)
    validate: list[str] = field(default_factory=lambda: ["chat_longtail", "decode_heavy", "shared_prefix"])
    validate_overrides: list[str] = field(default_factory=list)  # e.g. [workload.num_requests=40]
    report_dir: str = "reports"
    name: str = "calibration-cpu"


FIELDS = ("tokens", "sampled", "kv_read", "pairs", "seqs", "duration_s")


def _keep(engine, samples: list[dict], label: str) -> None:
    s = engine.last_step
    samples.append({"point": label, "tokens": s.num_prefill_tokens + s.num_decode_tokens, "sampled": s.num_sampled,
                    "kv_read": s.kv_tokens_read, "pairs": s.attn_pairs, "seqs": s.num_seqs,
                    "duration_s": s.duration_s})


def measure_grid(engine, cc: CalibrateConfig, progress: bool = True) -> list[dict]:
    """Step shapes and times of the real engine over the grid (distinct random prompts: no prefix hits)."""
    from tqdm import tqdm

    from core.engine.types import SamplingParams

    rng = np.random.default_rng(0)
    vocab = min(engine.loaded.args.vocab_size, engine.tokenizer.vocab_size)

    def prompt(n: int) -> list[int]:
        return rng.integers(min(1000, vocab // 2), vocab, n).tolist()

    samples: list[dict] = []
    points = [(b, c) for b in cc.decode_batches for c in cc.contexts] + [(None, t) for t in cc.prefill_tokens]
    for batch, length in tqdm(points, desc="calibrate", disable=not progress, leave=False):
        if batch is None:  # one prefill chunk of `length` tokens, nothing else running
            for rep in range(cc.reps + 1):
                engine.add_request(prompt(length), SamplingParams(max_tokens=1, ignore_eos=True))
                engine.step()
                if rep:  # the first chunk (a longer prompt than the step budget is chunked)
                    _keep(engine, samples, f"prefill {engine.last_step.num_prefill_tokens}")
                while engine.has_unfinished():
                    engine.step()
            continue
        # long enough that none ends while the others prefill; aborted once measured
        params = SamplingParams(max_tokens=engine.max_model_len - length - 1, ignore_eos=True)
        ids = [engine.add_request(prompt(length), params) for _ in range(batch)]
        engine.step()
        while engine.last_step.num_prefill_tokens or engine.last_step.num_seqs < batch:
            engine.step()
        engine.step()  # unkept: the first decode-only step
        for _ in range(cc.reps):
            engine.step()
            _keep(engine, samples, f"decode {batch} x {length}")
        for rid in ids:
            engine.abort(rid)
    return samples


def fit_profile(samples: list[dict], base: HardwareProfile, model: StepTimeModel) -> tuple[HardwareProfile, dict]:
    """Efficiencies by grid search, overheads by weighted least squares (relative error)."""
    x = {k: np.array([s[k] for s in samples], dtype=float) for k in FIELDS}
    y, w = x["duration_s"], 1 / x["duration_s"]
    mm = np.linspace(0.1, 1.0, 19)[:, None, None, None]
    eb = np.linspace(0.05, 1.0, 20)[None, :, None, None]
    ea = np.geomspace(0.02, 1.0, 15)[None, None, :, None]
    # the simulator's own step time, every sample on every candidate profile at once, overheads apart
    grid = model.on(dataclasses.replace(base, matmul_efficiency=mm, bandwidth_efficiency=eb, attention_efficiency=ea,
                                        step_overhead_s=0.0, sequence_overhead_s=0.0))
    t = grid.step(x["tokens"], x["sampled"], x["kv_read"], x["pairs"], x["seqs"])
    parts = t.linear + t.lm_head + t.attention  # [mm, eb, ea, samples]
    resid = y - parts
    a = np.stack([np.ones_like(y), x["seqs"]], axis=1) * w[:, None]  # overhead + per-sequence, weighted
    coef, *_ = np.linalg.lstsq(a, (resid * w).reshape(-1, y.size).T, rcond=None)
    coef = np.clip(coef, 0, None)  # [2, combos]
    pred = parts.reshape(-1, y.size) + coef[0][:, None] + coef[1][:, None] * x["seqs"]
    err = ((pred - y) / y) ** 2
    best = int(err.sum(axis=1).argmin())
    i, j, k = np.unravel_index(best, parts.shape[:3])
    profile = dataclasses.replace(
        base, matmul_efficiency=float(mm.ravel()[i]), bandwidth_efficiency=float(eb.ravel()[j]),
        attention_efficiency=float(ea.ravel()[k]), step_overhead_s=float(coef[0, best]),
        sequence_overhead_s=float(coef[1, best]))
    rel = (pred[best] - y) / y
    by_point: dict[str, list[float]] = {}
    for s, r, p in zip(samples, rel, pred[best]):
        by_point.setdefault(s["point"], []).append((s["duration_s"], p, r))
    table = [{"point": k, "measured_s": float(np.median([m for m, _, _ in v])),
              "predicted_s": float(np.median([p for _, p, _ in v])),
              "relative_error": float(np.median([r for _, _, r in v]))} for k, v in by_point.items()]
    return profile, {"median_abs_relative_error": float(np.median(np.abs(rel))),
                     "p90_abs_relative_error": float(np.percentile(np.abs(rel), 90)), "points": table}


def base_profile(rates: dict, memory_gb: float) -> HardwareProfile:
    return HardwareProfile(name="cpu", bf16_tflops=rates["matmul_gflops"]["bf16"] / 1e3,
                           memory_bandwidth_gbs=rates["mem_bandwidth_gbs"], memory_gb=memory_gb,
                           default_memory_utilization=0.2,
                           source=f"fitted by `python -m core calibrate` on {rates['cpu']}, {rates['cores']} cores, "
                                  f"torch {rates['torch']}")


def calibrate(cfg: DictConfig, overrides: list[str]) -> int:
    from core.bench.calibration_report import validate, write_report
    from core.bench.driver import warm_up
    from core.bench.roofline import machine_rates
    from core.engine.components import engine_config
    from core.engine.engine import Engine
    from core.runner.memory import available_host_bytes

    cc = section(CalibrateConfig, cfg.get("calibrate"), "calibrate")
    ec: EngineConfig = engine_config(cfg)
    ec.scheduler.max_num_seqs = max(ec.scheduler.max_num_seqs, max(cc.decode_batches))
    rates = machine_rates(device="cpu")
    engine = Engine(ec)
    warm_up(engine, 2)
    samples = measure_grid(engine, cc)
    bpp = weight_bytes_per_param(ec.quant.name, DTYPES[ec.model.dtype].itemsize)
    base = base_profile(rates, available_host_bytes() / 1e9)
    profile, fit = fit_profile(samples, base, StepTimeModel(engine.loaded.args, base, bpp,
                                                            engine.kv_spec.bytes_per_token))
    del engine
    gc.collect()
    path = calibrated_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(profile), indent=1))
    print(f"profile: {path} (median step-time error {fit['median_abs_relative_error'] * 100:.1f} %)")
    out = Path(cc.report_dir) / cc.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(dataclasses.asdict(profile), indent=1))
    validation = validate(overrides, cc, out / "profile.json")
    write_report(out, profile, fit, samples, validation, rates)
    print(f"report: {out / 'report.md'}")
    return 0
