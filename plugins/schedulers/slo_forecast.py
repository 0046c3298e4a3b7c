"""The `slo` scheduler's forecast of a new request's TTFT, for load shedding (`server.shed=true`):
the steps `schedule` would plan, played forward on the engine's step-cost model."""

from __future__ import annotations

import math

from core.api import Sequence, StepShape

INF = math.inf


class ForecastMixin:
    """`predict_ttft` for SloScheduler (it uses that class's targets, cost model and chunk sizing)."""

    def predict_ttft(self, seq: Sequence) -> float:
        """Seconds from now until a sequence not yet queued would get its first token if queued now.
        The steps are played forward on the cost model: the running decodes each step, then the
        prefills ahead of it (those mid-prefill, then the waiting ones with earlier deadlines, then
        its own) in chunks sized as `schedule` would size them (long prompts capped, the step held
        under the decodes' TPOT allowance, no more prompts mid-prefill than the limits allow)."""
        if not self._ready:
            return 0.0
        self._now = self.context.clock()
        deadline = self._now + self.ttft_target(seq)
        # [tokens done, prompt tokens, long, started]
        queue = [[s.num_computed_tokens, s.num_tokens, self._is_long(s), True] for s in self.running if s.in_prefill]
        queue += [[0, s.num_tokens, self._is_long(s), False] for s in sorted(self.waiting, key=self.deadline)
                  if not self._is_late(s) and self.deadline(s) <= deadline]
        own = [0, seq.num_tokens, self._is_long(seq), False]
        queue.append(own)
        decodes = StepShape()
        for s in self.running:
            if not s.in_prefill:
                decodes.add(1, s.num_tokens + 1)
        limit = self._step_limit(seq) if decodes.tokens else INF
        elapsed = 0.0
        while True:  # one iteration per step until its own prefill is done
            elapsed += self._cost(self._play_step(queue, decodes, limit))
            if own[0] >= own[1]:
                return elapsed
            queue = [item for item in queue if item[0] < item[1]]

    def _play_step(self, queue: list[list], decodes: StepShape, limit: float) -> StepShape:
        """One step of `predict_ttft`'s forward play: the prompts already started take their chunks
        first, then waiting ones start while the partial-prefill limits allow (as in `schedule`, a
        prompt whose last chunk runs in this step no longer counts). Advances `queue` in place."""
        cfg = self.config
        shape, budget = decodes.copy(), max(1, cfg.max_num_batched_tokens - decodes.tokens)
        num_partial = num_long = None
        for item in sorted(queue, key=lambda it: not it[3]):  # stable: started prompts first
            done, total, long, started = item
            if not started:
                if num_partial is None:  # the started prompts have had their chunks: count those left
                    mid = [it for it in queue if it[3] and it[0] < it[1]]
                    num_partial, num_long = len(mid), sum(it[2] for it in mid)
                if num_partial >= cfg.max_num_partial_prefills:
                    break
                if long and num_long >= cfg.max_long_partial_prefills:
                    continue
            cap = min(total - done, budget, cfg.long_prefill_token_threshold if long else budget)
            floor = 0
            if shape.tokens == decodes.tokens:  # the step's first chunk
                floor = max(cfg.min_prefill_tokens, self._share_floor(shape, done, cap, total))
            c = self._fit(shape, done, cap, total, limit, floor)
            if c <= 0:
                break
            shape.add(c, done + c, done + c >= total)
            item[0], item[3] = done + c, True
            budget -= c
            if not started and done + c < total:
                num_partial, num_long = num_partial + 1, num_long + long
        return shape
