"""What a step costs, learned online from the engine's own step timings; and what a scheduler may
know of its engine (`SchedulerContext`).

A step's time is modelled as linear in five features of its batch (the shape the engine core
also writes into each step's stats):

    time = overhead + a * tokens + b * sampled rows + c * KV tokens read + d * attention pairs

`tokens` pays for the linear layers (every new token, prefill or decode); `sampled` for the head
over the vocabulary; `kv_read` for decode attention's reads; `attn_pairs` for prefill attention's
quadratic part. The fit is ridge-regularised least squares with exponential forgetting (old
steps fade, so the model follows the machine as it warms up or gets noisier) and non-negative
coefficients. Its sums take every step; the solve (an active set over five unknowns, about 0.4 ms
of numpy calls) runs once `refit_every` steps have come in since the last, and whenever the
coefficients are read out: at batch 1 a step on 2 cores takes 6 ms, so solving after each cost
7 % of it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

FEATURES = ("overhead", "tokens", "sampled", "kv_read", "attn_pairs")
# features are divided by these before the fit, so every coefficient is a few ms per unit and one
# ridge weight suits them all
SCALE = np.array([1.0, 1e3, 1e2, 1e5, 1e6])


@dataclass
class StepShape:
    """The cost-relevant shape of a (planned or finished) step."""

    tokens: int = 0
    sampled: int = 0
    kv_read: int = 0
    attn_pairs: float = 0.0

    def add(self, num_new_tokens: int, context_len: int, sampled: bool = True) -> StepShape:
        """One row: `num_new_tokens` queries over `context_len` keys (the cached ones included)."""
        q = num_new_tokens
        self.tokens += q
        self.sampled += int(sampled)
        self.kv_read += context_len
        self.attn_pairs += q * (context_len - (q - 1) / 2)
        return self

    def copy(self) -> StepShape:
        return StepShape(self.tokens, self.sampled, self.kv_read, self.attn_pairs)

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.tokens, self.sampled, self.kv_read, self.attn_pairs]) / SCALE


@dataclass
class StepCostModel:
    """Online fit of step time against StepShape. `ready` once it has seen `min_steps` steps."""

    forgetting: float = 0.998  # per observed step: about the last 500 steps count
    ridge: float = 1e-3  # pulls coefficients towards the prior while data is scarce
    min_steps: int = 8
    prior: tuple = (0.01, 0.0, 0.0, 0.0, 0.0)  # seconds per scaled unit: a 10 ms step until data says otherwise
    outlier_factor: float = 4.0  # once ready, a step this many times its prediction is not learned from
    refit_every: int = 8  # predictions use coefficients at most this many steps old
    _a: np.ndarray = field(init=False, repr=False)
    _b: np.ndarray = field(init=False, repr=False)
    coef: np.ndarray = field(init=False)
    num_steps: int = field(init=False, default=0)
    num_outliers: int = field(init=False, default=0)
    errors: deque = field(init=False, repr=False)
    _pending: int = field(init=False, repr=False, default=0)  # steps learned since the last solve

    def __post_init__(self) -> None:
        self._a = np.zeros((len(FEATURES), len(FEATURES)))
        self._b = np.zeros(len(FEATURES))
        self.coef = np.array(self.prior, dtype=float)
        self.errors = deque(maxlen=512)  # |predicted - measured| / measured of recent steps

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps

    def predict(self, shape: StepShape) -> float:
        if self._pending >= self.refit_every:
            self._refit()
        return max(0.0, float(self.coef @ shape.vector()))

    def _refit(self) -> None:
        self.coef, self._pending = self._solve(), 0

    def observe(self, shape: StepShape, duration_s: float) -> None:
        """Learn from one finished step (its prediction error is kept before the update)."""
        if duration_s <= 0:
            return
        predicted = self.predict(shape)
        if self.ready:
            self.errors.append(abs(predicted - duration_s) / duration_s)
            if duration_s > self.outlier_factor * predicted + 0.005:  # a hiccup (GC, a first-call compile)
                self.num_outliers += 1
                return
        x = shape.vector()
        self._a = self.forgetting * self._a + np.outer(x, x)
        self._b = self.forgetting * self._b + x * duration_s
        self.num_steps += 1
        self._pending += 1

    def _solve(self) -> np.ndarray:
        """Ridge least squares towards the prior, with coefficients kept >= 0 (active set: the most
        negative one is pinned to 0 and the rest re-solved)."""
        prior = np.array(self.prior, dtype=float)
        free = list(range(len(FEATURES)))
        coef = np.zeros(len(FEATURES))
        while free:
            a = self._a[np.ix_(free, free)] + self.ridge * np.eye(len(free))
            b = self._b[free] + self.ridge * prior[free]
            sol = np.linalg.solve(a, b)
            if (sol >= 0).all():
                coef[free] = sol
                break
            free.pop(int(np.argmin(sol)))
        return coef

    def coefficients(self) -> dict[str, float]:
        """Seconds per unit of each feature (per token, per sampled row, per KV token, per pair)."""
        if self._pending:
            self._refit()
        return {name: float(c / s) for name, c, s in zip(FEATURES, self.coef, SCALE)}

    def to_dict(self) -> dict:
        err = np.asarray(self.errors) if self.errors else None
        return {
            "features": list(FEATURES), "coefficients_s": self.coefficients(), "num_steps": self.num_steps,
            "num_outliers": self.num_outliers,
            "relative_error": None if err is None else {
                "p50": float(np.percentile(err, 50)), "p90": float(np.percentile(err, 90)), "n": int(err.size)},
        }


@dataclass
class SchedulerContext:
    """What a scheduler plugin may know about its engine beyond the allocator: the engine's own
    step-cost model (updated after every step by the engine core) and its clock, the one every
    timestamp of the engine comes from (virtual time under backend=simulator)."""

    cost_model: StepCostModel = field(default_factory=StepCostModel)
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep  # waits on that clock (a simulator's only moves it)
