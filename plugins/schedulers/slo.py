"""Scheduler `slo`: plan every step against the requests' TTFT and TPOT targets (goodput first).

It is the continuous scheduler (same queues, chunked prefill, preemption by recompute) with
five changes, four of them driven by the engine's online step-cost model (`context.cost_model`):

- **Stall-free chunks** (Sarathi-Serve): running decodes are scheduled first; then each prefill
  chunk is cut to the largest size whose predicted step time stays within the tightest TPOT
  target among the running decodes (times `step_margin`), so a long prompt never stalls them.
  With no decode running, prefills take the whole token budget. TPOT is a mean over the
  request, so a decode whose tokens came faster than its target so far may absorb one longer step
  (`spend_slack`); with `slack_horizon` N it also counts up to N tokens still to come at the
  decode step's predicted cost. At least `min_prefill_tokens`
  prefill tokens run per step, so prefills never stop entirely.
  A prefill that would then miss its own TTFT deadline gets the smallest larger chunk that makes
  it (`deadline_chunks`); one that cannot make it even so does not slow the decodes down.
  With `min_prefill_share` > 0 a step's first chunk is at least that share of the step's
  predicted time, whatever the target: beside many decodes a TPOT-sized step buys few prompt
  tokens, and prompts that arrive faster than they are prefilled all miss their TTFT.
- **One prompt mid-prefill at a time** (`max_num_partial_prefills`, 1 here against 4 in
  `continuous`): a TPOT-sized step has room for a short chunk only, and shared between several
  prompts it delays them all (processor sharing); given to the earliest deadline alone, that one
  finishes as early as it can and the next starts after it (in the simulator on this machine's
  fitted profile, 40 `chat_longtail` requests at 1.6 req/s: 88 % on target against 65 % with 4).
- **Admission by cost:** a waiting request starts only while the decode step it will join is
  still predicted under that target (`admit_by_cost`).
- **Earliest deadline first:** waiting requests are ordered by deadline (arrival + TTFT target),
  priority and arrival breaking ties. A request that can no longer make its deadline is
  deferred behind those that can; after `aging_steps` steps of waiting it is back in deadline
  order, so nothing starves.
- **Preemption by slack:** when the KV pool runs out, the victim is a request that has already
  missed a target, else the one with the latest deadline.

Targets are per request (`SamplingParams.slo_ttft_s` / `slo_tpot_s`, the API's extra fields),
defaulting to `ttft_target_s` / `tpot_target_s`. `predict_ttft` lets the engine refuse at once a
request that cannot make its deadline (`server.shed=true`). Until the cost model has seen a few
steps it behaves as `continuous` with deadline order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.api import ConfigError, SchedulerOutput, Sequence, StepShape, hookimpl
from plugins.schedulers.continuous import ContinuousScheduler, ContinuousSchedulerConfig
from plugins.schedulers.slo_forecast import ForecastMixin

INF = math.inf


def smallest(lo: int, hi: int, holds) -> int:
    """The smallest c in [lo, hi] for which `holds(c)`, a predicate monotone in c that holds at hi."""
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class SloSchedulerConfig(ContinuousSchedulerConfig):
    max_num_partial_prefills: int = 1  # earliest deadline's prompt alone (see the module's doc)
    ttft_target_s: float = 2.0  # defaults for requests without their own targets
    tpot_target_s: float = 0.15
    step_margin: float = 0.9  # plan steps to this fraction of the tightest TPOT target (the model's error)
    min_prefill_tokens: int = 16  # prefill tokens every step may carry even past the target
    min_prefill_share: float = 0.0  # a chunk is at least this share of its step's predicted time (0: off)
    admit_by_cost: bool = True  # start a request only while the decode step it joins fits the target
    spend_slack: bool = True  # a decode ahead of its mean-TPOT budget may wait longer for one step
    slack_horizon: int = 0  # spend_slack also counts this many coming tokens at the decode step's cost (0: off)
    deadline_chunks: bool = True  # a prefill that would miss its TTFT at that chunk size gets a larger one

    def __post_init__(self) -> None:  # checked when the config is read, before any model loads
        for key in ("ttft_target_s", "tpot_target_s", "step_margin"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"scheduler.{key} must be positive, got {getattr(self, key)}")
        if not 0 <= self.min_prefill_share < 1:
            raise ConfigError(f"scheduler.min_prefill_share must be in [0, 1), got {self.min_prefill_share}")
        if self.slack_horizon < 0:
            raise ConfigError(f"scheduler.slack_horizon must be at least 0, got {self.slack_horizon}")
        if self.min_prefill_tokens < 1:
            raise ConfigError(f"scheduler.min_prefill_tokens must be at least 1, got {self.min_prefill_tokens}")


class SloScheduler(ForecastMixin, ContinuousScheduler):
    config_class = SloSchedulerConfig
    capabilities = frozenset({"deadlines"})

    def __init__(self, config: SloSchedulerConfig, allocator, context=None) -> None:
        super().__init__(config, allocator, context)
        self._now = 0.0
        self._limit = INF  # this step's predicted-time ceiling
        self._planned = StepShape()  # what this step carries so far
        self._future = StepShape()  # the decode step once every running (and admitted) sequence decodes
        self._prefill_tokens = 0

    # ---- targets ------------------------------------------------------------------------------

    def ttft_target(self, seq: Sequence) -> float:
        return seq.params.slo_ttft_s or self.config.ttft_target_s

    def tpot_target(self, seq: Sequence) -> float:
        return seq.params.slo_tpot_s or self.config.tpot_target_s

    def deadline(self, seq: Sequence) -> float:
        return seq.arrival_time + self.ttft_target(seq)

    def _is_late(self, seq: Sequence) -> bool:
        """Waiting and unable to make its deadline even if it ran alone now (until it has aged)."""
        waited = self.step - self._enqueued_at.get(seq.seq_id, self.step)
        if self.config.aging_steps > 0 and waited >= self.config.aging_steps:
            return False
        alone = self._cost(StepShape().add(seq.num_tokens, seq.num_tokens)) if self._ready else 0.0
        return self._now + alone > self.deadline(seq)

    def _missed(self, seq: Sequence) -> bool:
        """A running sequence whose TTFT or TPOT so far is already past its target."""
        t = seq.timings
        if t.first_token is None:
            return self._now > self.deadline(seq)
        if t.first_token - seq.arrival_time > self.ttft_target(seq):
            return True
        n = len(t.token_times)
        return n > 1 and (t.token_times[-1] - t.first_token) / (n - 1) > self.tpot_target(seq)

    # ---- the cost model -------------------------------------------------------------------------

    @property
    def _ready(self) -> bool:
        return self.context.cost_model.ready

    def _cost(self, shape: StepShape) -> float:
        return self.context.cost_model.predict(shape)

    def _allowance(self, seq: Sequence, decode_step: float) -> float:
        """How long the next token of a generating sequence may take with its mean TPOT still on
        target: the target, or more when earlier tokens came faster (TPOT is a mean over the request:
        n tokens out over E seconds since the first may wait up to target * n - E). `decode_step`
        is the predicted decode-only step, the cost of the tokens `slack_horizon` counts ahead."""
        target = self.tpot_target(seq)
        t = seq.timings
        if not self.config.spend_slack or t.first_token is None:
            return target
        banked = target * len(t.token_times) - (self._now - t.first_token)
        # With R more tokens to come at the decode step's cost d (`slack_horizon`, bounded by
        # max_tokens), the mean stays on target if this step takes up to banked + R (target - d):
        # a decode that has just started need not hold every step to the bare target.
        ahead = min(self.config.slack_horizon, seq.params.max_tokens - seq.num_output_tokens - 1)
        if ahead > 0:
            banked += ahead * max(0.0, target - decode_step)
        return max(target, banked)

    def _step_limit(self, extra: Sequence | None = None) -> float:
        """The tightest allowance among sequences already generating (and `extra`'s TPOT target),
        times the margin."""
        # one prediction for every sequence (only the horizon needs it)
        decode_step = self._cost(self._future) if self.config.slack_horizon > 0 and self._ready else INF
        targets = [self._allowance(s, decode_step) for s in self.running if s.num_output_tokens > 0]
        if extra is not None:
            targets.append(self.tpot_target(extra))
        if not targets or not self._ready:
            return INF
        return min(targets) * self.config.step_margin

    def _fit(self, planned: StepShape, start: int, n: int, total: int, limit: float, floor: int) -> int:
        """The largest chunk c <= n of a prompt computed up to `start` (of `total` tokens) whose step
        stays under `limit`; at least `floor` (bounded by n)."""
        if limit == INF:
            return n

        def fits(c: int) -> bool:
            return self._cost(planned.copy().add(c, start + c, start + c >= total)) <= limit

        lo, hi = 0, n  # fits(lo) is assumed; binary search for the last c that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return max(lo, min(n, floor))

    def _share_floor(self, planned: StepShape, start: int, n: int, total: int) -> int:
        """The smallest chunk c <= n whose prompt tokens take `min_prefill_share` of the step's
        predicted time (n if none does). Under a TPOT target that leaves room for few prompt tokens
        beside many decodes, each step's fixed part (the decodes, the per-step overhead) buys almost
        no prefill: prompts then arrive faster than they are prefilled and every queued request
        misses its TTFT. A step of at most 1 / (1 - share) times its decodes' keeps the prefill rate."""
        share = self.config.min_prefill_share
        if share <= 0 or not self._ready or planned.tokens == 0:
            return 0
        base = self._cost(planned)

        def enough(c: int) -> bool:
            step = self._cost(planned.copy().add(c, start + c, start + c >= total))
            return step - base >= share * step * (1 - 1e-9)  # (equality in exact arithmetic counts)

        return smallest(1, n, enough) if enough(n) else n

    # ---- the step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._now = self.context.clock()
        self._planned, self._prefill_tokens = StepShape(), 0
        self._future = StepShape()
        for s in self.running:
            self._future.add(1, s.num_tokens + 1)
        self._limit = self._step_limit()
        return super().schedule()

    def _order_running(self) -> None:
        self.running.sort(key=lambda s: (s.in_prefill, self.deadline(s), s.seq_id))  # decodes, then by deadline

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        n = super()._chunk(seq, remaining, budget)
        if n <= 0:
            return n
        start = seq.num_tokens + len(seq.spec_token_ids) - remaining
        if start < seq.num_tokens - 1:  # a prefill chunk (a decode computes all but its last token first)
            floor = max(0, self.config.min_prefill_tokens - self._prefill_tokens)
            if self._prefill_tokens == 0:  # the step's first chunk
                floor = max(floor, self._share_floor(self._planned, start, n, seq.num_tokens))
            fitted = self._fit(self._planned, start, n, seq.num_tokens, self._limit, floor)
            if self.config.deadline_chunks and fitted < n:
                fitted = self._deadline_chunk(seq, start, fitted, n)
            n = fitted
            self._prefill_tokens += n
        if n > 0:
            self._planned.add(n, start + n, start + n >= seq.num_tokens)
        return n

    def _deadline_chunk(self, seq: Sequence, start: int, fitted: int, n: int) -> int:
        """The smallest chunk in [fitted, n] at which the rest of the prompt is predicted to finish
        by its TTFT deadline, in steps like this one; `fitted` when that already makes it, or when
        even `n` cannot (a lost cause does not get to slow the decodes down)."""
        if seq.timings.first_token is not None:  # recomputing after a preemption: its TTFT is history
            return fitted
        left, rest = self.deadline(seq) - self._now, seq.num_tokens - start

        def on_time(c: int) -> bool:
            step = self._cost(self._planned.copy().add(c, start + c, start + c >= seq.num_tokens))
            return rest / c * step <= left

        if fitted > 0 and on_time(fitted) or not on_time(n):
            return fitted
        return smallest(max(fitted, 1), n, on_time)

    def _can_admit(self, seq: Sequence) -> bool:
        if not self.config.admit_by_cost:
            return True
        limit = min(self._limit, self._step_limit(seq)) if self.running else INF
        if limit < INF and self._cost(self._future.copy().add(1, seq.num_tokens + 1)) > limit:
            return False
        self._future.add(1, seq.num_tokens + 1)
        return True

    def _order_key(self, seq: Sequence):
        return (self._is_late(seq), self.deadline(seq), self.effective_priority(seq), seq.arrival_time, seq.seq_id)

    def _preempt_victim(self) -> Sequence:
        return max(self.running, key=lambda s: (self._missed(s), self.deadline(s), s.seq_id))

@hookimpl
def servelab_schedulers():
    return {"slo": SloScheduler}
