"""Per-request latency metrics from a sequence's monotonic timestamps.

TPOT = (e2e - TTFT) / (output tokens - 1); undefined (None) with a single output token.
"""

from __future__ import annotations

from core.types import Sequence


def request_metrics(seq: Sequence) -> dict:
    t = seq.timings
    first = t.first_token
    end = t.finished if t.finished is not None else (t.token_times[-1] if t.token_times else None)
    ttft = first - t.arrival if first is not None else None
    e2e = end - t.arrival if end is not None else None
    n_out = seq.num_output_tokens
    tpot = (e2e - ttft) / (n_out - 1) if (ttft is not None and e2e is not None and n_out > 1) else None
    itl = [b - a for a, b in zip(t.token_times, t.token_times[1:])]
    return {
        "request_id": seq.request_id,
        "index": seq.index,
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_output_tokens": n_out,
        "queue_s": (t.first_scheduled - t.arrival) if t.first_scheduled is not None else None,
        "prefill_s": (t.prefill_done - t.first_scheduled) if t.prefill_done and t.first_scheduled else None,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "itl_s": itl,
        "num_preemptions": seq.num_preemptions,
        "num_cached_tokens": seq.num_cached_tokens,
        "finish_reason": seq.status.value if seq.is_finished else None,
    }


PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "prefill_s")


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
              slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.05) -> dict:
    """Aggregates of one run: throughput, latency percentiles, KV usage, prefix hits, goodput."""
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
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s, "attained": good / len(records) if records else 0.0},
        "preemptions": sum(r.get("num_preemptions", 0) for r in records),
    }
    for key in LATENCIES:
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
    return summary
