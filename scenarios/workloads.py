"""Workloads: how many requests, how long their prompts and outputs, when they arrive.

The same definitions feed the offline benchmark (`python -m core run`) and the locust scenarios.
Long-tail lengths come from quantile tables derived from public traces (scenarios/data/), sampled
by inverse CDF; they are rescaled to the model's context and the report says by how much.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.corpus import PromptSource
from core.errors import ConfigError
from scenarios.edits import edit_request
from scenarios.traces import read_trace

DATA = Path(__file__).parent / "data"
KINDS = ("fixed", "uniform", "quantiles", "shared_prefix", "trace", "edit")
ARRIVALS = ("all_at_once", "poisson", "gamma", "trace", "concurrent")


@dataclass
class WorkloadConfig:
    name: str = "chat_longtail"
    kind: str = "quantiles"  # fixed | uniform | quantiles | shared_prefix | trace | edit
    num_requests: int = 64
    seed: int = 0
    text: str = "prose"  # prose | code: the corpus prompts are cut from
    # fixed / uniform (uniform draws from [min, max])
    prompt_len: int = 128
    output_len: int = 128
    prompt_len_min: int = 16
    prompt_len_max: int = 1024
    output_len_min: int = 16
    output_len_max: int = 256
    # quantiles: a table in scenarios/data, rescaled so a request at `scale_quantile` of both
    # prompt and output fits max_model_len ("auto"), or by a given factor
    table: str | None = None
    length_scale: Any = "auto"
    scale_quantile: float = 0.99
    # shared_prefix: every prompt = one of num_prefixes system prompts + a unique question
    num_prefixes: int = 4
    prefix_len: int = 512
    suffix_len_min: int = 16
    suffix_len_max: int = 128
    # trace replay: Azure CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or Mooncake JSONL
    path: str | None = None
    format: str = "auto"  # auto | azure | mooncake
    time_scale: float = 1.0  # > 1 slows the trace down, < 1 speeds it up
    block_tokens: int = 512  # Mooncake hash-id block size before rescaling
    # arrivals
    arrival: str = "all_at_once"  # all_at_once | poisson | gamma | trace | concurrent
    rate: float = 4.0  # requests per second (poisson, gamma)
    concurrency: int = 8  # concurrent: a closed loop of this many users (GuideLLM's constant concurrency)
    burstiness: float = 1.0  # gamma: coefficient of variation of the gaps (1 = Poisson)
    # the targets every request carries (SamplingParams.slo_*) and goodput counts; None: run.slo_*
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestSpec:
    """One request of a workload. `prompt_token_ids` is filled by `materialize`."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prefix_id: int | None = None  # shared_prefix: which system prompt
    hash_ids: list[int] | None = None  # trace: Mooncake prefix blocks
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class Workload:
    config: WorkloadConfig
    requests: list[RequestSpec]
    scale: float = 1.0  # factor applied to trace/table lengths
    num_capped: int = 0  # requests whose prompt was cut to fit max_model_len
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        return {
            "name": self.config.name, "kind": self.config.kind, "num_requests": len(self.requests),
            "arrival": self.config.arrival + (f" at {self.config.rate:g} req/s" if self.config.arrival in
                                              ("poisson", "gamma") else "") + (
                f" ({self.config.concurrency} users, each sending its next request when the last ends)"
                if self.config.arrival == "concurrent" else ""), "length_scale": round(self.scale, 4), "num_capped": self.num_capped,
            "prompt_tokens": _stats(p), "output_tokens": _stats(o), "notes": self.notes,
        }


def _stats(a: np.ndarray) -> dict:
    if a.size == 0:
        return {}
    return {"mean": round(float(a.mean()), 1), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": int(a.max()), "total": int(a.sum())}


def load_table(name: str) -> dict:
    path = DATA / f"{name}.json"
    if not path.exists():
        available = ", ".join(sorted(p.stem for p in DATA.glob("*.json")))
        raise ConfigError(f"unknown length table '{name}'; available: {available}")
    return json.loads(path.read_text())


def sample_quantiles(table: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    """Inverse-CDF sampling from a quantile table, linear between its points."""
    return np.interp(rng.random(n), table["probs"], table["values"])


def table_cdf(table: dict, x: np.ndarray, left: bool = False) -> np.ndarray:
    """The CDF that `sample_quantiles` draws from, F(x) (or its left limit F(x-)); plateaus of
    equal quantile values (discrete lengths) are atoms. For tests and reports."""
    v, p = np.asarray(table["values"], dtype=float), np.asarray(table["probs"], dtype=float)
    x = np.asarray(x, dtype=float)
    idx = np.searchsorted(v, x, side="left" if left else "right") - 1  # last point below (or at) x
    out = np.where(idx >= 0, p[np.clip(idx, 0, None)], 0.0)
    nxt = np.clip(idx + 1, 0, len(v) - 1)
    inside = (idx >= 0) & (idx < len(v) - 1) & (v[nxt] > v[np.clip(idx, 0, None)])
    frac = np.where(inside, (x - v[np.clip(idx, 0, None)]) / np.where(inside, v[nxt] - v[np.clip(idx, 0, None)], 1), 0)
    return np.clip(out + frac * (p[nxt] - out) * inside, 0.0, 1.0)


def ks_distance(table: dict, samples: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance between samples and the table's distribution (atoms allowed)."""
    u, counts = np.unique(np.asarray(samples, dtype=float), return_counts=True)
    n = counts.sum()
    ecdf = np.cumsum(counts) / n
    return float(max(np.max(np.abs(ecdf - table_cdf(table, u))),
                     np.max(np.abs(table_cdf(table, u, left=True) - (ecdf - counts / n)))))


# ---- arrivals -------------------------------------------------------------------------------


def arrival_times(cfg: WorkloadConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start; a closed loop (`concurrent`) has none in advance: the driver sends
    each request when a user's previous one ends."""
    if cfg.arrival == "concurrent":
        if cfg.concurrency < 1:
            raise ConfigError(f"workload.concurrency must be at least 1, got {cfg.concurrency}")
        return np.zeros(n)
    if cfg.arrival == "all_at_once":
        return np.zeros(n)
    if cfg.rate <= 0:
        raise ConfigError(f"workload.rate must be positive for {cfg.arrival} arrivals, got {cfg.rate}")
    if cfg.arrival == "poisson":
        gaps = rng.exponential(1.0 / cfg.rate, n)
    elif cfg.arrival == "gamma":
        if cfg.burstiness <= 0:
            raise ConfigError(f"workload.burstiness must be positive, got {cfg.burstiness}")
        shape = 1.0 / cfg.burstiness**2  # CV of a gamma = 1/sqrt(shape)
        gaps = rng.gamma(shape, 1.0 / (cfg.rate * shape), n)
    else:
        raise ConfigError(f"workload.arrival must be one of {', '.join(ARRIVALS)}, got '{cfg.arrival}'")
    gaps[0] = 0.0
    return np.cumsum(gaps)


# ---- builders -------------------------------------------------------------------------------


def _fit(prompt: np.ndarray, output: np.ndarray, max_model_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Integer lengths with prompt >= 1, output >= 1 and prompt + output <= max_model_len."""
    output = np.clip(np.rint(output), 1, max_model_len - 1).astype(int)
    prompt = np.maximum(np.rint(prompt), 1).astype(int)
    room = max_model_len - output
    capped = int((prompt > room).sum())
    return np.minimum(prompt, room), output, capped


def _scale_for(cfg: WorkloadConfig, p_hi: float, o_hi: float, max_model_len: int) -> float:
    if cfg.length_scale == "auto":
        return min(1.0, max_model_len / (p_hi + o_hi))
    scale = float(cfg.length_scale)
    if scale <= 0:
        raise ConfigError(f"workload.length_scale must be 'auto' or positive, got {cfg.length_scale}")
    return scale


def build_workload(cfg: WorkloadConfig, max_model_len: int) -> Workload:
    if cfg.kind not in KINDS:
        raise ConfigError(f"workload.kind must be one of {', '.join(KINDS)}, got '{cfg.kind}'")
    if cfg.kind == "trace":
        return _trace_workload(cfg, max_model_len)
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    if n <= 0:
        raise ConfigError(f"workload.num_requests must be positive, got {n}")
    scale, notes, prefix_ids = 1.0, [], [None] * n
    if cfg.kind == "fixed":
        prompt, output = np.full(n, cfg.prompt_len), np.full(n, cfg.output_len)
    elif cfg.kind == "uniform":
        prompt = rng.integers(cfg.prompt_len_min, cfg.prompt_len_max + 1, n)
        output = rng.integers(cfg.output_len_min, cfg.output_len_max + 1, n)
    elif cfg.kind == "quantiles":
        if not cfg.table:
            raise ConfigError("workload.table must name a length table for kind=quantiles")
        table = load_table(cfg.table)
        pt, ot = table["prompt_tokens"], table["output_tokens"]
        q = cfg.scale_quantile
        scale = _scale_for(cfg, float(np.interp(q, pt["probs"], pt["values"])),
                           float(np.interp(q, ot["probs"], ot["values"])), max_model_len)
        prompt = sample_quantiles(pt, n, rng) * scale
        output = sample_quantiles(ot, n, rng) * scale
        notes.append(f"lengths from {table['source']} ({table['citation']}), multiplied by {scale:.4f} so that a "
                     f"request at the p{q * 100:g} prompt and p{q * 100:g} output fits max_model_len={max_model_len}; "
                     f"longer prompts are cut to fit")
    elif cfg.kind == "edit":
        # prompt: an edit instruction around a window of real code (prompt_len in [min, max]);
        # output: the edited code, about as long as the code it copies (set by `materialize`)
        prompt = rng.integers(cfg.prompt_len_min, cfg.prompt_len_max + 1, n)
        output = prompt.copy()
        notes.append("code editing: an instruction to rename the window's most used identifier, then the code; the "
                     "answer copies the code with the edit (output length = the edited code's tokens + 16)")
    else:  # shared_prefix
        prefix_ids = rng.integers(0, cfg.num_prefixes, n).tolist()
        prompt = cfg.prefix_len + rng.integers(cfg.suffix_len_min, cfg.suffix_len_max + 1, n)
        output = np.full(n, cfg.output_len)
        notes.append(f"{cfg.num_prefixes} shared system prompts of {cfg.prefix_len} tokens + a unique question")
    prompt, output, capped = _fit(prompt, output, max_model_len)
    arrivals = arrival_times(cfg, n, rng)
    reqs = [RequestSpec(i, float(arrivals[i]), int(prompt[i]), int(output[i]), prefix_id=prefix_ids[i])
            for i in range(n)]
    return Workload(cfg, reqs, scale, capped, notes)


def _trace_workload(cfg: WorkloadConfig, max_model_len: int) -> Workload:
    if not cfg.path:
        raise ConfigError("workload=trace needs workload.path=FILE (an Azure CSV or a Mooncake JSONL)")
    path = Path(cfg.path).expanduser()
    rows = read_trace(path, cfg.format)
    if cfg.num_requests > 0:
        rows = rows[: cfg.num_requests]
    if not rows:
        raise ConfigError(f"trace {path} has no requests")
    prompt = np.array([r["prompt"] for r in rows], dtype=float)
    output = np.array([r["output"] for r in rows], dtype=float)
    scale = _scale_for(cfg, float(np.quantile(prompt, cfg.scale_quantile)),
                       float(np.quantile(output, cfg.scale_quantile)), max_model_len)
    p, o, capped = _fit(prompt * scale, output * scale, max_model_len)
    if cfg.arrival == "trace":
        arrivals = np.array([r["t"] for r in rows]) * cfg.time_scale
    else:
        arrivals = arrival_times(cfg, len(rows), np.random.default_rng(cfg.seed))
    reqs = [RequestSpec(i, float(arrivals[i]), int(p[i]), int(o[i]), hash_ids=rows[i]["hash_ids"])
            for i in range(len(rows))]
    notes = [f"replayed {len(rows)} requests of {path.name}, lengths x{scale:.4f}, times x{cfg.time_scale:g}"]
    return Workload(cfg, reqs, scale, capped, notes)


def materialize(workload: Workload, tokenizer) -> None:
    """Fill every request's prompt with real text of exactly its token length."""
    cfg = workload.config
    source = PromptSource(tokenizer, cfg.text, cfg.seed)
    prefixes: dict[int, list[int]] = {}
    blocks: dict[int, list[int]] = {}
    block_len = max(1, int(math.ceil(cfg.block_tokens * workload.scale)))
    for r in workload.requests:
        if r.prefix_id is not None:
            prefix = prefixes.setdefault(r.prefix_id, source.prompt(min(cfg.prefix_len, r.prompt_len)))
            r.prompt_token_ids = prefix + source.prompt(r.prompt_len - len(prefix))
        elif r.hash_ids:
            # equal hash ids are identical blocks, so prefix sharing in the trace is real here
            ids: list[int] = []
            for h in r.hash_ids:
                ids += blocks.setdefault(h, source.prompt(block_len))
                if len(ids) >= r.prompt_len:
                    break
            if len(ids) < r.prompt_len:
                ids += source.prompt(r.prompt_len - len(ids))
            r.prompt_token_ids = ids[: r.prompt_len]
        elif cfg.kind == "edit":
            edit_request(r, source, tokenizer)
        else:
            r.prompt_token_ids = source.prompt(r.prompt_len)

