"""What every scheduler shares: the queues, and the one place sequence state is written.

A plugin subclasses `QueueScheduler` and writes only `schedule`. Everything that changes a
Sequence after a step (computed tokens, output tokens, timings, status) happens here in
`update_from_output`, as in vLLM V1; forks for n > 1 go through `fork`; an end for any reason
goes through `finish`.
"""

from __future__ import annotations

from core.config.schema import SchedulerConfig
from core.engine.interfaces import CacheAllocator, has_capability
from core.engine.step_cost import SchedulerContext
from core.engine.types import DecoderOutput, ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus


def stop_status(seq: Sequence, token: int, max_model_len: int) -> tuple[SequenceStatus | None, int | None]:
    """Whether `token`, just appended, ends the sequence: EOS, a stop token id, or a length limit."""
    if not seq.params.ignore_eos and token in seq.eos_token_ids:
        return SequenceStatus.FINISHED_STOPPED, None
    if token in seq.params.stop_token_ids:
        return SequenceStatus.FINISHED_STOPPED, token
    if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH, None
    return None, None


class QueueScheduler:
    """Waiting and running lists, admission, retirement and the state updates. Subclasses
    implement `schedule`."""

    def __init__(self, config: SchedulerConfig, allocator: CacheAllocator, context: SchedulerContext | None = None
                 ) -> None:
        self.config = config
        self.allocator = allocator
        self.context = context or SchedulerContext()  # the engine's step-cost model and clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- helpers for `schedule` -----------------------------------------------------------

    def allocate_fresh(self, seq: Sequence, num_new_tokens: int, cached: int | None = None) -> int:
        """Admit a sequence that holds no KV yet: start after its cached prefix (`cached`, from
        allocator.match_prefix, looked up here if not given) and reserve up to `num_new_tokens`
        more. Returns the tokens reserved; 0 when the pool had no room (nothing changed then)."""
        cached = self.allocator.match_prefix(seq) if cached is None else cached
        n = min(seq.num_tokens - cached, num_new_tokens)
        seq.num_computed_tokens = cached
        if n <= 0 or not self.allocator.allocate(seq, n):
            seq.num_computed_tokens = 0
            return 0
        seq.num_cached_tokens = cached
        seq.status = SequenceStatus.RUNNING
        return n

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: free its KV; it rejoins the queue to be prefilled again."""
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.PREEMPTED
        self.add(seq)

    # ---- after the forward pass ------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, decoded: DecoderOutput, now: float) -> list[Sequence]:
        """Advance every scheduled sequence by its new tokens, append what the decoder accepted and
        finish what stops. Returns the sequences that finished this step."""
        finished = []
        max_len = self.allocator.spec.max_model_len
        for s in output.scheduled:
            seq = s.seq
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = output.started
            drafts = s.num_draft_tokens
            seq.num_computed_tokens += s.num_new_tokens
            seq.spec_token_ids = []
            if seq.seq_id in decoded.spec:
                verified, kept = decoded.spec[seq.seq_id]
                seq.num_draft_tokens += verified
                seq.num_accepted_tokens += kept
            if seq.timings.prefill_done is None and not seq.in_prefill:
                seq.timings.prefill_done = now
            logprobs = decoded.logprobs.get(seq.seq_id, [])
            for i, token in enumerate(decoded.token_ids.get(seq.seq_id, [])):
                seq.output_token_ids.append(token)
                if i < len(logprobs):
                    seq.output_logprobs.append(logprobs[i])
                if seq.timings.first_token is None:
                    seq.timings.first_token = now
                seq.timings.token_times.append(now)
                status, reason = stop_status(seq, token, max_len)
                if status is not None:
                    self.finish(seq, status, reason, now)
                    finished.append(seq)
                    break
            if drafts and not seq.is_finished:
                # the KV of rejected drafts (and of drafts after a stop) goes back: the cache holds
                # every token but the last, which the next step feeds
                seq.num_computed_tokens = seq.num_tokens - 1
                if has_capability(self.allocator, "truncate"):
                    self.allocator.truncate(seq, seq.num_computed_tokens)
        return finished

    def set_drafts(self, drafts: dict[int, list[int]]) -> None:
        """A speculative decoder's proposals for the next step, per running sequence id."""
        if not drafts:
            return
        for seq in self.running:
            if seq.seq_id in drafts and not seq.in_prefill:
                seq.spec_token_ids = list(drafts[seq.seq_id])

    def fork(self, row: ScheduledSeq, children: list[Sequence]) -> list[ScheduledSeq]:
        """n > 1: the parent (this step's `row`) computes the prompt's last chunk now; its samples
        share its KV and run from here. Each child's row advances exactly like the parent's."""
        parent = row.seq
        rows = []
        for child in children:
            self.allocator.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = SequenceStatus.RUNNING
            child.timings.first_scheduled = parent.timings.first_scheduled
            self.running.append(child)
            rows.append(ScheduledSeq(child, row.num_new_tokens))
        return rows

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: str | int | None = None,
               now: float | None = None, drop_tokens: int = 0) -> None:
        """A sequence ended (stop, length or abort): drop it wherever it is and free its KV. A
        sequence that already ended (at its length limit, with a stop string in its last text)
        only changes its reason. `drop_tokens`: the last output tokens to take back (a stop string
        ended the text before a speculative step's last tokens)."""
        if drop_tokens:
            del seq.output_token_ids[-drop_tokens:]
            del seq.timings.token_times[-drop_tokens:]
            del seq.output_logprobs[len(seq.output_token_ids):]
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        if not seq.is_finished:
            seq.timings.finished = self.context.clock() if now is None else now
        seq.status, seq.stop_reason = status, stop_reason

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError
