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

from dataclasses import dataclass

from core.api import (
    ConfigError,
    QueueScheduler,
    ScheduledSeq,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
    hookimpl,
)

POLICIES = ("fcfs", "priority")


@dataclass
class ContinuousSchedulerConfig(SchedulerConfig):
    policy: str = "fcfs"  # fcfs | priority (lower value first)
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 4  # prompts mid-prefill at once
    max_long_partial_prefills: int = 2  # of which long (over the threshold)
    long_prefill_token_threshold: int = 512  # a longer prompt is prefilled in chunks of at most this
    aging_steps: int = 50  # priority: every N steps waiting improves effective priority by 1 (0: off)


class ContinuousScheduler(QueueScheduler):
    config_class = ContinuousSchedulerConfig

    def __init__(self, config: ContinuousSchedulerConfig, allocator, context=None) -> None:
        if config.policy not in POLICIES:
            raise ConfigError(f"scheduler.policy must be one of {', '.join(POLICIES)}, got '{config.policy}'")
        super().__init__(config, allocator, context)
        self.step = 0
        self._enqueued_at: dict[int, int] = {}  # seq id -> step it (re)joined the queue

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self._enqueued_at[seq.seq_id] = self.step

    def effective_priority(self, seq: Sequence) -> float:
        if self.config.policy == "fcfs":
            return 0
        waited = self.step - self._enqueued_at.get(seq.seq_id, self.step)
        aging = self.config.aging_steps
        return seq.priority - (waited // aging if aging > 0 else 0)

    def _order_key(self, seq: Sequence):
        return (self.effective_priority(seq), seq.arrival_time, seq.seq_id)

    def _preempt_victim(self) -> Sequence:
        # lowest priority (largest value), then latest arrival
        return max(self.running, key=lambda s: (s.priority if self.config.policy == "priority" else 0,
                                                 s.arrival_time, s.seq_id))

    def _is_long(self, seq: Sequence) -> bool:
        return seq.num_prompt_tokens > self.config.long_prefill_token_threshold

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        """How many of the `remaining` tokens to compute this step (0: not this step)."""
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        if remaining > 1 and self._is_long(seq):
            remaining = min(remaining, self.config.long_prefill_token_threshold)
        return min(remaining, budget)

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        out = SchedulerOutput()
        self._order_running()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:  # a step that had to preempt admits nothing: the pool is full
            self._schedule_waiting(out, budget)
        return out

    def _order_running(self) -> None:
        """The order running sequences get their tokens in (the budget may run out on the last)."""
        if self.config.policy == "priority":
            self.running.sort(key=self._order_key)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Decodes and continuing prefill chunks; preempts when the pool is full. Returns the budget left."""
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue
            num_new = self._chunk(seq, seq.num_pending_tokens, budget)
            if num_new <= 0:
                continue
            while not self.allocator.allocate(seq, num_new):
                victim = self._preempt_victim()
                for i, s in enumerate(out.scheduled):  # it may already hold a slot in this step
                    if s.seq is victim:
                        budget += out.scheduled.pop(i).num_new_tokens
                        break
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=self._order_key)
        chunk = {x.seq.seq_id: x.num_new_tokens for x in out.scheduled}
        # prompts still mid-prefill after this step's chunks (one whose last chunk runs now frees its place)
        partial = [s for s in self.running if s.in_prefill and s.num_computed_tokens + chunk.get(s.seq_id, 0) < s.num_tokens]
        num_partial, num_long = len(partial), sum(self._is_long(s) for s in partial)
        admitted = set()
        for seq in self.waiting:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            cached = self.allocator.match_prefix(seq)
            prefill = seq.num_tokens - cached > 1
            if prefill and num_partial >= self.config.max_num_partial_prefills:
                break
            if prefill and self._is_long(seq) and num_long >= self.config.max_long_partial_prefills:
                continue  # a long prompt waits for the long slot; shorter ones go ahead
            if not self._can_admit(seq):
                break
            num_new = self.allocate_fresh(seq, self._chunk(seq, seq.num_tokens - cached, budget), cached)
            if num_new == 0:
                break
            self.running.append(seq)
            admitted.add(seq.seq_id)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            if seq.num_computed_tokens + num_new < seq.num_tokens:  # still mid-prefill after this chunk
                num_partial += 1
                num_long += self._is_long(seq)
        if admitted:
            self.waiting = [s for s in self.waiting if s.seq_id not in admitted]

    def _can_admit(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may start now (beyond the budget and the seat limit): a hook
        for schedulers that control admission (`slo`: the decode step it adds must fit the target)."""
        return True

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason=None, now=None, drop_tokens: int = 0) -> None:
        super().finish(seq, status, stop_reason, now, drop_tokens)
        self._enqueued_at.pop(seq.seq_id, None)


@hookimpl
def servelab_schedulers():
    return {"continuous": ContinuousScheduler}
