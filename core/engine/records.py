"""The one per-request record: what every run, peer and load test writes for each request.

Written by the engine (through the `servelab_request_finished` observer), by the benchmark peers
and by the locust users in their own process, so this module imports nothing heavy. All times
are monotonic-clock seconds (`time.perf_counter`, CLOCK_MONOTONIC, comparable across processes on
one machine); `origin` is the run's start, which the relative `*_s` times are measured from.

TPOT = (e2e - TTFT) / (output tokens - 1); undefined (None) with a single output token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "prefill_s")


@dataclass
class RequestRecord:
    request_id: str
    index: int  # which of the request's n samples
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    itl_s: list[float]
    queue_s: float | None = None  # arrival -> first scheduled (None when the server is remote)
    prefill_s: float | None = None  # first scheduled -> prompt fully computed
    arrival_s: float = 0.0  # since the run's origin
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None  # load tests: HTTP status or a mid-stream error
    model: str | None = None  # load tests: the model name sent
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this sequence
    num_accepted_tokens: int = 0  # of which kept

    def to_dict(self) -> dict:
        # asdict's deep copy walks every float of the token lists: a shallow copy of them serves
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), list) else v for f in fields(self)}


def make_record(
    request_id: str, *, arrival: float, token_times: list[float], num_prompt_tokens: int,
    num_output_tokens: int | None = None, finished: float | None = None, first_scheduled: float | None = None,
    prefill_done: float | None = None, origin: float = 0.0, index: int = 0, **extra,
) -> RequestRecord:
    """A record from absolute timestamps. `num_output_tokens` defaults to the number of token
    times (a stream may carry several tokens in one chunk: then give the true count)."""
    n_out = len(token_times) if num_output_tokens is None else num_output_tokens
    end = finished if finished is not None else (token_times[-1] if token_times else None)
    ttft = token_times[0] - arrival if token_times else None
    e2e = end - arrival if end is not None else None
    tpot = (e2e - ttft) / (n_out - 1) if ttft is not None and e2e is not None and n_out > 1 else None
    return RequestRecord(
        request_id=request_id, index=index, num_prompt_tokens=num_prompt_tokens, num_output_tokens=n_out,
        ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, itl_s=[b - a for a, b in zip(token_times, token_times[1:])],
        queue_s=first_scheduled - arrival if first_scheduled is not None else None,
        prefill_s=prefill_done - first_scheduled if prefill_done is not None and first_scheduled is not None else None,
        arrival_s=arrival - origin, finish_s=end - origin if end is not None else None,
        token_times_s=[t - origin for t in token_times], **extra,
    )


def sequence_record(seq, origin: float = 0.0) -> RequestRecord:
    """The record of a finished (or aborted) engine Sequence."""
    t = seq.timings
    return make_record(
        seq.request_id, arrival=t.arrival, token_times=list(t.token_times), num_prompt_tokens=seq.num_prompt_tokens,
        num_output_tokens=seq.num_output_tokens, finished=t.finished, first_scheduled=t.first_scheduled,
        prefill_done=t.prefill_done, origin=origin, index=seq.index, num_preemptions=seq.num_preemptions,
        num_cached_tokens=seq.num_cached_tokens, finish_reason=seq.status.value if seq.is_finished else None,
        num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens,
    )
