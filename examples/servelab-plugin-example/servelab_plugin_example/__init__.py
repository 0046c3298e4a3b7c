"""Scheduler `sjf`: static batches formed shortest job first.

A job's size is its prompt plus its output budget (max_tokens). Forming each batch from the
shortest waiting jobs cuts mean latency when lengths are long-tailed, at the risk of starving
long jobs; `extra.max_wait_batches` (default 8) bounds that: a job passed over that many times
goes first.
"""

from __future__ import annotations

from core.config import SchedulerConfig
from core.interfaces import CacheAllocator
from core.plugins import hookimpl
from core.scheduler_base import QueueScheduler
from core.types import ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus


def job_size(seq: Sequence) -> int:
    return seq.num_prompt_tokens + seq.params.max_tokens


class ShortestJobFirstScheduler(QueueScheduler):
    """Queue bookkeeping (waiting/running lists, finish) comes from servelab's QueueScheduler;
    the batch-forming policy is this plugin's own."""

    def __init__(self, config: SchedulerConfig, allocator: CacheAllocator) -> None:
        super().__init__(config, allocator)
        self.max_wait_batches = int(config.extra.get("max_wait_batches", 8))
        self._passed_over: dict[int, int] = {}

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        self._passed_over[seq.seq_id] = 0

    def _order(self) -> list[Sequence]:
        starved = [s for s in self.waiting if self._passed_over[s.seq_id] >= self.max_wait_batches]
        rest = sorted((s for s in self.waiting if s not in starved), key=job_size)
        return starved + rest

    def schedule(self) -> SchedulerOutput:
        if self.running:
            for seq in self.running:
                if not self.allocator.allocate(seq, 1):
                    raise RuntimeError(f"sjf: no KV room to decode {seq}")
            return SchedulerOutput([ScheduledSeq(seq, 1) for seq in self.running])
        batch, budget = [], self.config.max_num_batched_tokens
        for seq in self._order():
            if len(batch) >= self.config.max_num_seqs:
                break
            if batch and seq.num_prompt_tokens > budget:
                continue
            if not self.allocator.allocate(seq, seq.num_prompt_tokens):
                break
            seq.status = SequenceStatus.RUNNING
            batch.append(ScheduledSeq(seq, seq.num_prompt_tokens))
            budget -= seq.num_prompt_tokens
        chosen = {s.seq.seq_id for s in batch}
        self.running = [s.seq for s in batch]
        self.waiting = [s for s in self.waiting if s.seq_id not in chosen]
        for seq in self.waiting:
            self._passed_over[seq.seq_id] += 1
        return SchedulerOutput(batch)

    def finish(self, seq: Sequence) -> None:
        super().finish(seq)
        self._passed_over.pop(seq.seq_id, None)


@hookimpl
def servelab_schedulers():
    return {"sjf": ShortestJobFirstScheduler}
