"""Scheduler `static`: the batch runs to completion before the next one starts.

The baseline the seed describes: requests are grouped once (FCFS, up to max_num_seqs and
max_num_batched_tokens prompt tokens), prefilled together, then decoded step by step; a request
that finishes early leaves its seat empty until the whole batch is done.
"""

from __future__ import annotations

from core.api import QueueScheduler, ScheduledSeq, SchedulerOutput, Sequence, SequenceStatus, hookimpl


class StaticScheduler(QueueScheduler):
    def schedule(self) -> SchedulerOutput:
        if self.running:
            return SchedulerOutput([self._decode(seq) for seq in self.running])
        batch: list[ScheduledSeq] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prompt = seq.num_tokens
            if batch and prompt > budget:
                break
            # Reserve room for the whole sequence now, so the batch can always run to the end.
            longest = min(seq.num_prompt_tokens + seq.params.max_tokens, self.allocator.spec.max_model_len)
            if not self.allocator.allocate(seq, longest):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(ScheduledSeq(seq, prompt))
            budget -= prompt
        return SchedulerOutput(batch)

    def _decode(self, seq: Sequence) -> ScheduledSeq:
        # Room for the whole sequence was reserved at admission (drafts never run past it), so
        # this cannot fail; a speculative decoder's drafts ride along with the decode token.
        num_new = seq.num_pending_tokens
        if not self.allocator.allocate(seq, num_new):
            raise RuntimeError(f"static scheduler: no KV room to decode {seq}")
        return ScheduledSeq(seq, num_new)


@hookimpl
def servelab_schedulers():
    return {"static": StaticScheduler}
