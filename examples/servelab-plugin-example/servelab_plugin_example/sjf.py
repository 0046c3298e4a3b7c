"""Scheduler `sjf`: static batches formed shortest job first (a job: prompt + max_tokens).

Forming each batch from the shortest waiting jobs cuts mean latency when lengths are long-tailed,
at the risk of starving long jobs: a job passed over `max_wait_batches` times goes first.
"""

from dataclasses import dataclass

from core.api import QueueScheduler, ScheduledSeq, SchedulerConfig, SchedulerOutput, Sequence, SequenceStatus


@dataclass
class SJFConfig(SchedulerConfig):
    max_wait_batches: int = 8


class ShortestJobFirstScheduler(QueueScheduler):
    """Queues, state updates and `finish` come from QueueScheduler; the batch policy is this."""

    config_class = SJFConfig

    def __init__(self, config: SJFConfig, allocator) -> None:
        super().__init__(config, allocator)
        self.passed_over: dict[int, int] = {}

    def schedule(self) -> SchedulerOutput:
        if self.running:  # room for the whole job was reserved at admission
            return SchedulerOutput([ScheduledSeq(s, 1) for s in self.running if self.allocator.allocate(s, 1)])
        size = lambda s: s.num_prompt_tokens + s.params.max_tokens  # noqa: E731
        starved = lambda s: self.passed_over.get(s.seq_id, 0) >= self.config.max_wait_batches  # noqa: E731
        batch, budget = [], self.config.max_num_batched_tokens
        for seq in sorted(self.waiting, key=lambda s: (not starved(s), size(s))):
            if len(batch) == self.config.max_num_seqs or (batch and seq.num_prompt_tokens > budget):
                break
            if not self.allocator.allocate(seq, min(size(seq), self.allocator.spec.max_model_len)):
                break
            seq.status = SequenceStatus.RUNNING
            batch.append(ScheduledSeq(seq, seq.num_prompt_tokens))
            budget -= seq.num_prompt_tokens
        self.running = [s.seq for s in batch]
        self.waiting = [s for s in self.waiting if s not in self.running]
        for seq in self.waiting:
            self.passed_over[seq.seq_id] = self.passed_over.get(seq.seq_id, 0) + 1
        return SchedulerOutput(batch)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason=None, now=None) -> None:
        super().finish(seq, status, stop_reason, now)
        self.passed_over.pop(seq.seq_id, None)
