"""Scheduler `continuous`: iteration-level batching with chunked prefill, priorities and preemption.

Every step: running sequences first (decodes, and the next chunk of partial prefills), then
waiting ones while the token budget (`max_num_batched_tokens`) and `max_num_seqs` allow. Long
prompts are split into chunks; at most `max_num_partial_prefills` prompts are mid-prefill at once
and at most `max_long_partial_prefills` of them long (over `long_prefill_token_threshold`, whose
chunks are capped at that size), so one long prompt cannot starve short ones. A finished
sequence leaves at once and a waiting one takes its place in the next step.

When the KV pool runs out, the victim (lowest priority, then latest arrival) is preempted by
recompute: its blocks are freed and it rejoins the waiting queue to be prefilled again.

Policies: `fcfs` (arrival order) and `priority` (lower value first, like vLLM), with aging:
every `aging_steps` steps spent waiting improve a sequence's effective priority by one, so
nothing starves.
"""

from __future__ import annotations

from core.config import SchedulerConfig
from core.errors import ConfigError
from core.interfaces import CacheAllocator
from core.plugins import hookimpl
from core.scheduler_base import QueueScheduler
from core.types import ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")


class ContinuousScheduler(QueueScheduler):
    def __init__(self, config: SchedulerConfig, allocator: CacheAllocator) -> None:
        if config.policy not in POLICIES:
            raise ConfigError(f"scheduler.policy must be one of {', '.join(POLICIES)}, got '{config.policy}'")
        super().__init__(config, allocator)
        x = config.extra
        self.enable_chunked_prefill = bool(x.get("enable_chunked_prefill", True))
        self.max_num_partial_prefills = int(x.get("max_num_partial_prefills", 4))
        self.max_long_partial_prefills = int(x.get("max_long_partial_prefills", 2))
        self.long_prefill_token_threshold = int(x.get("long_prefill_token_threshold", 512))
        self.aging_steps = int(x.get("aging_steps", 50))  # 0 disables aging
        self.step = 0
        self._enqueued_at: dict[int, int] = {}  # seq id -> step it (re)joined the queue

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self._enqueued_at[seq.seq_id] = self.step

    def effective_priority(self, seq: Sequence) -> float:
        if self.config.policy == "fcfs":
            return 0
        waited = self.step - self._enqueued_at.get(seq.seq_id, self.step)
        return seq.priority - (waited // self.aging_steps if self.aging_steps > 0 else 0)

    def _order_key(self, seq: Sequence):
        return (self.effective_priority(seq), seq.arrival_time, seq.seq_id)

    def _preempt_victim(self) -> Sequence:
        # lowest priority (largest value), then latest arrival
        return max(self.running, key=lambda s: (s.priority if self.config.policy == "priority" else 0,
                                                 s.arrival_time, s.seq_id))

    # ---- scheduling -----------------------------------------------------------------------

    def _is_long(self, seq: Sequence) -> bool:
        return seq.num_prompt_tokens > self.long_prefill_token_threshold

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining > 1 and self.enable_chunked_prefill and self._is_long(seq):
            remaining = min(remaining, self.long_prefill_token_threshold)
        return min(remaining, budget) if self.enable_chunked_prefill else (remaining if remaining <= budget else 0)

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.add(seq)
        preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        if self.config.policy == "priority":
            self.running.sort(key=self._order_key)
        # 1. running sequences: decodes and continuing prefill chunks
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue
            num_new = self._chunk(seq, budget)
            if num_new <= 0:
                continue
            while not self.allocator.allocate(seq, num_new):
                victim = self._preempt_victim()
                for i, s in enumerate(scheduled):  # it may already hold a slot in this step
                    if s.seq is victim:
                        budget += scheduled.pop(i).num_new_tokens
                        break
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        # 2. waiting sequences, unless this step already had to preempt (the pool is full)
        if not preempted:
            self.waiting.sort(key=self._order_key)
            partial = [s for s in self.running if s.in_prefill]
            num_partial = len(partial)
            num_long = sum(self._is_long(s) for s in partial)
            admitted = []
            for seq in self.waiting:
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                fresh = seq.num_computed_tokens == 0  # not a forked sample that already holds KV
                if fresh:
                    seq.num_computed_tokens = self.allocator.match_prefix(seq)
                prefill = seq.num_tokens - seq.num_computed_tokens > 1
                if prefill and num_partial >= self.max_num_partial_prefills:
                    if fresh:
                        seq.num_computed_tokens = 0
                    break
                if prefill and self._is_long(seq) and num_long >= self.max_long_partial_prefills:
                    if fresh:
                        seq.num_computed_tokens = 0
                    continue  # a long prompt waits for the long slot; shorter ones go ahead
                num_new = self._chunk(seq, budget)
                if num_new <= 0 or not self.allocator.allocate(seq, num_new):
                    if fresh:
                        seq.num_computed_tokens = 0
                    break
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                admitted.append(seq)
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                if seq.num_computed_tokens + num_new < seq.num_tokens:  # still mid-prefill after this chunk
                    num_partial += 1
                    num_long += self._is_long(seq)
            if admitted:
                ids = {s.seq_id for s in admitted}
                self.waiting = [s for s in self.waiting if s.seq_id not in ids]
        return SchedulerOutput(scheduled, preempted)

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._enqueued_at.pop(seq.seq_id, None)


@hookimpl
def servelab_schedulers():
    return {"continuous": ContinuousScheduler}
