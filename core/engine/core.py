"""The engine core: the one place that calls the components in order, one step at a time.

schedule -> model runner (inputs, once) -> execute -> accept -> update_from_output -> propose
(the next step's drafts, for speculative decoding).
Text is the output processor's business; this loop deals in token ids only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.engine.interfaces import has_capability
from core.engine.step_cost import SchedulerContext, StepShape
from core.engine.types import ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus, StepStats


@dataclass
class StepResult:
    """What one step changed: new tokens per sequence, in order, and the sequences that ended."""

    new_tokens: list[tuple[Sequence, list[int]]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    stats: StepStats | None = None


class EngineCore:
    def __init__(self, scheduler, allocator, backend, decoder, runner, hooks, context: SchedulerContext | None = None
                 ) -> None:
        self.scheduler, self.allocator, self.backend = scheduler, allocator, backend
        self.context = context or SchedulerContext()  # its cost model learns from every step here
        self.decoder, self.runner, self.hooks = decoder, runner, hooks
        self.can_fork = has_capability(allocator, "fork")
        self.copy_on_write = has_capability(allocator, "copy_on_write")
        self.pending_forks: dict[int, list[Sequence]] = {}  # parent seq id -> samples not yet forked
        self.step_count = 0
        self.last_stats: StepStats | None = None
        self.name = ""  # the engine's name, stamped on its step stats

    def add(self, seqs: list[Sequence]) -> None:
        """A request's sequences. With an allocator that can fork, the n samples share one prefill:
        only the first is scheduled; the others fork from it when its prompt is computed."""
        if len(seqs) > 1 and self.can_fork:
            self.scheduler.add(seqs[0])
            self.pending_forks[seqs[0].seq_id] = list(seqs[1:])
        else:
            for seq in seqs:
                self.scheduler.add(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: str | int | None = None,
               drop_tokens: int = 0) -> None:
        """End a sequence from outside the step (abort, stop string, with the tokens a step
        emitted after the stop string); samples not yet forked from it end with it (a parent only
        ends before forking when it is aborted)."""
        if drop_tokens:
            self.scheduler.finish(seq, status, stop_reason, drop_tokens=drop_tokens)
        else:  # a scheduler plugin written before speculative decoding need not know the argument
            self.scheduler.finish(seq, status, stop_reason)
        for child in self.pending_forks.pop(seq.seq_id, []):
            self.scheduler.finish(child, status)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        started = self.context.clock()
        out = self.scheduler.schedule()
        out.started = started
        if not out.scheduled:
            if self.scheduler.has_unfinished() and not out.preempted:
                raise RuntimeError("scheduler made no progress with work pending")
            return StepResult()
        tables = [self.allocator.block_table(s.seq) for s in out.scheduled]
        batch = self.runner.prepare(out.scheduled, tables, self.allocator.block_size)
        if self.copy_on_write:
            self.backend.copy_blocks(self.allocator.take_block_copies())
        logits = self.backend.execute(batch)
        stats, shape = self._stats(out, batch)
        stats.predicted_s = self.context.cost_model.predict(shape) if self.context.cost_model.ready else None
        sampling = [out.scheduled[i] for i in batch.sample_rows]
        logits, sampling = self._fork(out, logits, sampling)
        decoded = self.decoder.accept(logits, sampling, None)
        now = self.context.clock()
        before = [s.seq.num_output_tokens for s in sampling]
        finished = self.scheduler.update_from_output(out, decoded, now)
        new_tokens = [(s.seq, s.seq.output_token_ids[n:]) for s, n in zip(sampling, before)
                      if s.seq.num_output_tokens > n]
        # drafts for the next step (speculative decoders), kept on the sequences by the scheduler
        self.scheduler.set_drafts(self.decoder.propose(list(self.scheduler.running)))
        for verified, kept in decoded.spec.values():
            stats.num_drafts += 1
            stats.num_draft_tokens += verified
            stats.num_accepted_tokens += kept
            stats.accepted_per_pos += [0] * (kept - len(stats.accepted_per_pos))
            for pos in range(kept):
                stats.accepted_per_pos[pos] += 1
        self.step_count += 1
        stats.step, stats.time, stats.duration_s = self.step_count, now, now - started
        self.context.cost_model.observe(shape, stats.duration_s)
        stats.num_running, stats.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        stats.engine = self.name
        self._cache_stats(stats)
        self.last_stats = stats
        self.hooks.servelab_step_finished(step_stats=stats)
        return StepResult(new_tokens, finished, stats)

    def _fork(self, out: SchedulerOutput, logits: torch.Tensor, sampling: list[ScheduledSeq]):
        """Fork the pending samples of parents whose prompt is computed this step; each child
        draws its first token from its parent's logits row."""
        rows, children, row = [], [], 0
        for s in sampling:
            pending = self.pending_forks.get(s.seq.seq_id)
            if pending and not s.seq.num_output_tokens:
                del self.pending_forks[s.seq.seq_id]
                forked = self.scheduler.fork(s, pending)
                rows += [row] * len(forked)
                children += forked
            row += 1 + s.num_draft_tokens  # a verify row has a logits row per draft too
        if not children:
            return logits, sampling
        out.scheduled.extend(children)
        return torch.cat([logits, logits[rows]]), sampling + children

    def _stats(self, out: SchedulerOutput, batch) -> tuple[StepStats, StepShape]:
        """The step's stats and its cost-relevant shape (the features the step-cost model learns from)."""
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.seq.in_prefill)
        meta = batch.attn
        shape = StepShape(sampled=len(batch.sample_rows))
        for q, c in zip(meta.query_lens_cpu, meta.context_lens_cpu):
            shape.add(q, c, sampled=False)
        return StepStats(
            step=0, time=0.0, duration_s=0.0, num_running=0, num_waiting=0, num_preempted=len(out.preempted),
            num_prefill_tokens=prefill, num_decode_tokens=out.num_batched_tokens - prefill, kv_usage=0.0,
            prefix_queries=0, prefix_hits=0, num_seqs=len(out.scheduled), num_sampled=shape.sampled,
            kv_tokens_read=shape.kv_read, attn_pairs=shape.attn_pairs,
        ), shape

    def _cache_stats(self, stats: StepStats) -> None:
        cache = self.allocator.stats()
        stats.kv_usage, stats.prefix_queries, stats.prefix_hits = cache.usage, cache.prefix_queries, cache.prefix_hits
