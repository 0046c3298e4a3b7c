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
