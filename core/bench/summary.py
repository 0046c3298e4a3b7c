"""Aggregates of a run's per-request records (see core.engine.records): throughput, latency
percentiles, goodput against the SLOs, KV usage and prefix-cache hits."""

from __future__ import annotations

from core.engine.records import LATENCY_KEYS

PERCENTILES = (50, 90, 95, 99)


def percentiles(values: list[float]) -> dict:
    """mean and p50/p90/p95/p99 (linear interpolation) of the defined values."""
    import numpy as np

    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"n": 0}
    out = {"n": int(v.size), "mean": float(v.mean())}
    out.update({f"p{p}": float(np.percentile(v, p)) for p in PERCENTILES})
    out["max"] = float(v.max())
    return out


def meets_slo(record: dict, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """A request is good if its TTFT and TPOT are within the SLOs (TPOT undefined: only TTFT counts)."""
    if record.get("ttft_s") is None or record["ttft_s"] > slo_ttft_s:
        return False
    return record.get("tpot_s") is None or record["tpot_s"] <= slo_tpot_s


def summarize(records: list[dict], duration_s: float, steps: list[dict] | None = None,
              slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05, num_rejected: int = 0) -> dict:
    """Aggregates of one run: throughput, latency percentiles, KV usage, prefix hits, goodput.
    Refused requests (`num_rejected`) count against the SLO attainment: they were not served."""
    steps = steps or []
    n_out = sum(r["num_output_tokens"] for r in records)
    n_in = sum(r["num_prompt_tokens"] for r in records)
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    summary = {
        "num_requests": len(records),
        "duration_s": duration_s,
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "output_tok_s": n_out / duration_s if duration_s > 0 else 0.0,
        "total_tok_s": (n_in + n_out) / duration_s if duration_s > 0 else 0.0,
        "req_s": len(records) / duration_s if duration_s > 0 else 0.0,
        "goodput_req_s": good / duration_s if duration_s > 0 else 0.0,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s,
                "attained": good / (len(records) + num_rejected) if records or num_rejected else 0.0},
        "rejected": num_rejected,
        "preemptions": sum(r.get("num_preemptions", 0) for r in records),
    }
    for key in LATENCY_KEYS:
        values = [x for r in records for x in r.get(key) or []] if key == "itl_s" else [r.get(key) for r in records]
        summary[key] = percentiles(values)
    usage = [s["kv_usage"] for s in steps if s.get("kv_usage") is not None]
    if usage:
        summary["kv_usage"] = {"peak": max(usage), "mean": sum(usage) / len(usage)}
    if steps:
        queries = steps[-1].get("prefix_queries", 0)
        summary["prefix_cache"] = {
            "queries": queries, "hits": steps[-1].get("prefix_hits", 0),
            "hit_rate": steps[-1].get("prefix_hits", 0) / queries if queries else 0.0,
        }
        summary["num_steps"] = len(steps)
    cached = sum(r.get("num_cached_tokens", 0) for r in records)
    summary["prefix_hit_tokens"] = cached
    drafts = sum(s.get("num_drafts", 0) for s in steps)
    draft_tokens = sum(r.get("num_draft_tokens", 0) for r in records)
    if draft_tokens or drafts:
        accepted = sum(r.get("num_accepted_tokens", 0) for r in records)
        per_pos: list[int] = []
        for s in steps:
            for pos, n in enumerate(s.get("accepted_per_pos") or []):
                per_pos += [0] * (pos + 1 - len(per_pos))
                per_pos[pos] += n
        summary["spec_decode"] = {
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            # tokens a verify emits: the kept drafts plus the target's own token
            "mean_accepted_length": 1 + sum(per_pos) / drafts if drafts else 1.0,
            "accepted_per_pos": per_pos,
        }
    return summary
