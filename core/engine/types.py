"""The plain data every component shares: requests, sequences, a step's batch, its stats.

Shapes follow vLLM's V1 engine: a step is a packed (varlen) batch where each scheduled
sequence contributes `num_new_tokens` tokens, a prefill chunk or one decode token. A Sequence's
token state (computed tokens, outputs, status) is written by its scheduler only; text
(detokenization, stop strings) belongs to the output processor.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from core.errors import RequestError

MAX_N = 16  # samples per request


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; the OpenAI request fields, validated."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top logprobs to return per token (0: only the chosen)
    slo_ttft_s: float | None = None  # service-level targets (None: the scheduler's defaults)
    slo_tpot_s: float | None = None
    # P/D disaggregation: prompt tokens whose KV a prefill instance sent (simulator: loaded, not computed)
    remote_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(x, str) and x for x in self.stop):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(x, int) and x >= 0 for x in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if not (isinstance(self.remote_prefill_tokens, int) and self.remote_prefill_tokens >= 0):
            raise RequestError(f"remote_prefill_tokens must be a non-negative integer, got {self.remote_prefill_tokens!r}")
        for name, value in (("slo_ttft_s", self.slo_ttft_s), ("slo_tpot_s", self.slo_tpot_s)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise RequestError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED)


@dataclass
class RequestTimings:
    """Monotonic timestamps (time.perf_counter) of one sequence's life."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    prefill_done: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


_seq_ids = itertools.count()


class Sequence:
    """One token stream. A request with n > 1 owns n of them."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        priority: int = 0,
        arrival_time: float = 0.0,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict] = []
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        self.eos_token_ids = tuple(eos_token_ids)  # stop tokens unless params.ignore_eos
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.status = SequenceStatus.WAITING
        self.timings = RequestTimings(arrival=arrival_time)
        self.stop_reason: str | int | None = None  # the stop string or token id that ended it
        # speculative decoding: drafts waiting to be verified in the next step (not yet tokens of
        # the sequence), and what its verifies proposed and kept so far
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step reads one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens a scheduler may compute next: the uncomputed ones, then the pending drafts."""
        return self.num_tokens + len(self.spec_token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, {self.status.value})")


@dataclass
class ScheduledSeq:
    """This step's work for one sequence."""

    seq: Sequence
    num_new_tokens: int  # a prefill chunk, 1 for decode, 1 + k for speculative verify

    @property
    def needs_sample(self) -> bool:
        """True when this step's last token is the sequence's last known token: sample after it."""
        return self.seq.num_computed_tokens + self.num_new_tokens >= self.seq.num_tokens

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified in this step: the new tokens past the sequence's known tokens."""
        return max(0, self.seq.num_computed_tokens + self.num_new_tokens - self.seq.num_tokens)


@dataclass
class DecoderOutput:
    """What a decoder accepted this step, per sequence id: new tokens and (if asked) their logprobs."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[dict]] = field(default_factory=dict)
    spec: dict[int, tuple[int, int]] = field(default_factory=dict)  # speculative: (drafts verified, kept)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    started: float = 0.0  # when the step began (perf_counter): a sequence's first_scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(frozen=True)
class KVCacheSpec:
    """The model's KV geometry: what an allocator needs to size its pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_model_len: int

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes; an int8 cache adds one fp16
        scale per token and head."""
        per_head = self.head_dim * self.dtype.itemsize + (2 if self.dtype == torch.int8 else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head


@dataclass
class CacheStats:
    num_blocks: int
    num_free_blocks: int
    block_size: int
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass
class StepStats:
    """What one engine step did; handed to the step observers."""

    step: int
    time: float
    duration_s: float
    num_running: int
    num_waiting: int
    num_preempted: int
    num_prefill_tokens: int
    num_decode_tokens: int
    kv_usage: float
    prefix_queries: int  # cumulative over the allocator's life
    prefix_hits: int
    num_seqs: int = 0  # sequences in this step's batch
    num_sampled: int = 0  # rows that went through lm_head
    kv_tokens_read: int = 0  # sum of the batch's context lengths: KV read per layer
    attn_pairs: float = 0.0  # query-key pairs attended (sum over seqs of q * (ctx - (q - 1) / 2))
    num_drafts: int = 0  # speculative verifies in this step (sequences with drafts)
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which kept
    accepted_per_pos: list[int] = field(default_factory=list)  # kept drafts by position in their run
    engine: str = ""  # the engine's name (its served model name)
    predicted_s: float | None = None  # the engine's step-cost model's prediction, made before the step ran


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A request's state after a step: `delta_*` is what this step added (for streaming)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    deltas: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # index -> (text, ids)
