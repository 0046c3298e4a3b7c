"""Scheduler `slo` on constructed step costs: chunk budgets under the TPOT target, admission by cost,
earliest deadline first, aging, preemption by slack, and load shedding that refuses exactly what
cannot make its deadline."""

import numpy as np
import pytest
import torch

from core.engine.engine import Engine
from core.engine.step_cost import SCALE, SchedulerContext, StepCostModel, StepShape
from core.engine.types import DecoderOutput, KVCacheSpec, SamplingParams, Sequence
from core.errors import ConfigError, DeadlineError
from plugins.cache.paged import PagedAllocator, PagedCacheConfig
from plugins.schedulers.slo import SloScheduler, SloSchedulerConfig
from tests.tiny import tiny_config


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, max_model_len=4096)


def paged(num_blocks, block_size=4):
    cfg = PagedCacheConfig(name="paged", block_size=block_size,
                           memory_gb=num_blocks * SPEC.bytes_per_token * block_size / 1e9)
    return PagedAllocator(cfg, SPEC, max_num_seqs=1)


def fixed_costs(overhead=0.010, per_token=0.001, per_sampled=0.0) -> StepCostModel:
    """A cost model that has 'learned' exactly these costs (and learns nothing more)."""
    model = StepCostModel()
    model.coef = np.array([overhead, per_token, per_sampled, 0.0, 0.0]) * SCALE
    model.num_steps = model.min_steps
    model.observe = lambda shape, duration: None
    return model


def slo(costs=None, clock=None, num_blocks=1024, **kw):
    defaults = dict(max_num_seqs=8, max_num_batched_tokens=1024, ttft_target_s=10.0, tpot_target_s=0.1,
                    step_margin=1.0, spend_slack=False, deadline_chunks=False, min_prefill_tokens=16)
    cfg = SloSchedulerConfig(name="slo", **{**defaults, **kw})
    ctx = SchedulerContext(costs or fixed_costs(), clock or Clock())
    return SloScheduler(cfg, paged(num_blocks), ctx)


def seq(n, max_tokens=8, arrival=0.0, ttft=None, tpot=None, start=0, **kw):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, slo_ttft_s=ttft, slo_tpot_s=tpot)
    return Sequence("r", list(range(start, start + n)), params, arrival_time=arrival, **kw)


def run_step(s, now=None):
    if now is not None:
        s.context.clock.t = now
    out = s.schedule()
    t = s.context.clock.t
    s.update_from_output(out, DecoderOutput({x.seq.seq_id: [1] for x in out.scheduled if x.needs_sample}), now=t)
    return out


def predicted(s, out) -> float:
    shape = StepShape()
    for x in out.scheduled:
        start = x.seq.num_computed_tokens - x.num_new_tokens  # after update_from_output
        shape.add(x.num_new_tokens, start + x.num_new_tokens, x.needs_sample)
    return s.context.cost_model.predict(shape)


def test_prefill_chunks_keep_every_step_under_the_tpot_target():
    s = slo()
    decoders = [seq(4, max_tokens=60, start=100 * i) for i in range(4)]
    for d in decoders:
        s.add(d)
    run_step(s)  # their prefills: no decode runs yet, so no ceiling
    long = seq(300, max_tokens=2, start=5000)
    s.add(long)
    chunks = []
    while long.in_prefill:
        out = run_step(s)
        chunks += [x.num_new_tokens for x in out.scheduled if x.seq is long]
        assert sum(x.seq is not long for x in out.scheduled) == 4  # every decode runs every step
        assert predicted(s, out) <= 0.1 + 1e-9
    # 10 ms + 1 ms x (4 decodes + chunk) <= 100 ms: chunks of 86 until the prompt is done
    assert chunks == [86, 86, 86, 42]


def test_without_decodes_a_prefill_takes_the_whole_budget():
    s = slo(long_prefill_token_threshold=2048)
    long = seq(700)
    s.add(long)
    assert [x.num_new_tokens for x in run_step(s).scheduled] == [700]


def test_one_prompt_at_a_time_is_prefilled_in_deadline_order():
    # 3 decodes run; the 0.1 s target leaves room for 87 prefill tokens a step (10 ms + 1 ms a token)
    s = slo(long_prefill_token_threshold=2048)
    for i in range(3):
        s.add(seq(4, max_tokens=60, start=100 * i))
    run_step(s)
    late, early = seq(120, max_tokens=2, arrival=0.0, ttft=5.0, start=5000), seq(120, max_tokens=2, arrival=0.1,
                                                                               ttft=1.0, start=6000)
    s.add(late)
    s.add(early)
    steps = []
    for _ in range(3):
        out = run_step(s)
        steps.append([(x.seq is early, x.num_new_tokens) for x in out.scheduled if x.seq in (early, late)])
    # the earliest deadline alone until its last chunk; the next starts in that same step, in the room left
    assert steps == [[(True, 87)], [(True, 33), (False, 54)], [(True, 1), (False, 66)]]
    assert SloSchedulerConfig(name="slo").max_num_partial_prefills == 1  # the default, as conf/scheduler/slo.yaml


@pytest.mark.parametrize("partial, started", [(1, [512]), (4, [512, 512])])
def test_a_second_prompt_waits_while_the_first_is_mid_prefill(partial, started):
    s = slo(max_num_partial_prefills=partial)  # no decode runs: no ceiling, prompts capped at 512 a step
    for i in range(2):
        s.add(seq(600, max_tokens=2, arrival=0.1 * i, start=1000 * i))
    assert [x.num_new_tokens for x in run_step(s).scheduled] == started


def test_a_tight_target_still_lets_the_minimum_prefill_through():
    s = slo(tpot_target_s=0.012)  # the decode alone (11 ms) nearly fills the step
    d = seq(4, max_tokens=50)
    s.add(d)
    run_step(s)
    long = seq(100, start=500)
    s.add(long)
    out = run_step(s)
    assert {x.seq is long: x.num_new_tokens for x in out.scheduled}[True] == 16


def test_spent_slack_lets_a_fast_decode_absorb_a_longer_step():
    s = slo(spend_slack=True)
    d = seq(4, max_tokens=50)
    s.add(d)
    run_step(s, now=0.0)
    for i in range(1, 10):  # nine more tokens, 20 ms apart: 10 tokens in 0.18 s at a 0.1 s target
        run_step(s, now=0.02 * i)
    long = seq(2000, start=500)
    s.add(long)
    s.context.clock.t = 0.2
    out = s.schedule()
    # allowance = 0.1 x 10 - (0.2 - 0.0) = 0.8 s: 10 ms + (1 + chunk) ms <= 800 ms, capped by the long-prompt chunk
    assert {x.seq is long: x.num_new_tokens for x in out.scheduled}[True] == min(789, 512)


def test_a_prefill_that_would_miss_its_deadline_gets_a_larger_chunk():
    s = slo(deadline_chunks=True, long_prefill_token_threshold=2048)
    d = seq(4, max_tokens=50)
    s.add(d)
    run_step(s)
    # 600 tokens in chunks of 89 (the TPOT-sized step: 10 + 1 + 89 = 100 ms): 600 / 89 x 0.1 = 0.67 s
    urgent = seq(600, start=500, ttft=0.656)  # ... too slow for 0.656 s
    s.add(urgent)
    out = s.schedule()
    c = {x.seq is urgent: x.num_new_tokens for x in out.scheduled}[True]
    # the smallest c with 600 / c x (11 + c) ms <= 656 ms: 6.6 / c + 0.6 <= 0.656, c >= 117.9
    assert c == 118 == min(x for x in range(89, 601) if 600 / x * (0.011 + 0.001 * x) <= 0.656)
    hopeless = slo(deadline_chunks=True)
    hopeless.add(seq(4, max_tokens=50))
    run_step(hopeless)
    lost = seq(600, start=500, ttft=0.6)  # 0.6 s of prefill alone at best: no chunk makes it, the decodes keep their step
    hopeless.add(lost)
    assert {x.seq is lost: x.num_new_tokens for x in hopeless.schedule().scheduled}[True] == 89


def test_admission_stops_when_the_decode_step_would_break_the_target():
    s = slo(costs=fixed_costs(overhead=0.010, per_token=0.020))  # 4 decodes: 90 ms; 5: 110 ms > 100 ms
    seqs = [seq(2, max_tokens=3, start=10 * i, arrival=i * 1e-3) for i in range(6)]
    for x in seqs:
        s.add(x)
    out = run_step(s)
    assert [x.seq for x in out.scheduled] == seqs[:4]
    while not seqs[0].is_finished:
        out = run_step(s)
        assert seqs[4] not in [x.seq for x in out.scheduled] or seqs[0].is_finished
    out = run_step(s)
    assert seqs[4] in [x.seq for x in out.scheduled]  # a seat freed: the next one starts


def test_earliest_deadline_first():
    s = slo(max_num_seqs=1)
    a = seq(4, max_tokens=1, arrival=0.0, ttft=10.0, start=0)  # deadline 10
    b = seq(4, max_tokens=1, arrival=1.0, ttft=2.0, start=100)  # deadline 3
    c = seq(4, max_tokens=1, arrival=2.0, ttft=5.0, start=200)  # deadline 7
    for x in (a, b, c):
        s.add(x)
    order = [run_step(s).scheduled[0].seq for _ in range(3)]
    assert order == [b, c, a]


def test_priority_breaks_a_deadline_tie():
    s = slo(max_num_seqs=1, policy="priority")
    low = seq(4, max_tokens=1, arrival=0.0, priority=5)
    high = seq(4, max_tokens=1, arrival=0.0, priority=0, start=100)
    s.add(low), s.add(high)
    assert run_step(s).scheduled[0].seq is high


def test_a_hopeless_request_is_deferred_but_not_starved():
    s = slo(max_num_seqs=1, aging_steps=5)
    late = seq(4, max_tokens=1, arrival=0.0, ttft=1.0)  # deadline long gone at t = 3
    s.add(late)
    served = None
    for step in range(1, 40):  # a stream of requests that can still make it
        s.add(seq(4, max_tokens=1, arrival=3.0, ttft=10.0, start=100 * step))
        if any(x.seq is late for x in run_step(s, now=3.0).scheduled):
            served = step
            break
    assert served is not None and 5 <= served <= 7  # deferred while others can still be on time, then aged back


def test_preemption_takes_the_request_that_already_missed_then_the_latest_deadline():
    s = slo(num_blocks=4, costs=fixed_costs(overhead=0.001, per_token=1e-5))
    on_time = seq(7, max_tokens=20, arrival=0.0, ttft=5.0)
    later = seq(7, max_tokens=20, arrival=0.0, ttft=9.0, start=100)
    s.add(on_time), s.add(later)
    run_step(s, now=0.1)  # both prefilled: 2 blocks each, the pool is full
    preempted = []
    for i in range(3):
        preempted += run_step(s, now=0.2 + 0.01 * i).preempted
    assert preempted and preempted[0] is later  # both on time: the later deadline yields

    s = slo(num_blocks=4, costs=fixed_costs(overhead=0.001, per_token=1e-5))
    missed = seq(7, max_tokens=20, arrival=0.0, ttft=0.05)  # first token at 0.1: TTFT missed
    fine = seq(7, max_tokens=20, arrival=0.0, ttft=9.0, start=100)
    s.add(missed), s.add(fine)
    run_step(s, now=0.1)
    preempted = []
    for i in range(3):
        preempted += run_step(s, now=0.2 + 0.01 * i).preempted
    assert preempted and preempted[0] is missed


def test_targets_must_be_positive():
    with pytest.raises(ConfigError, match="scheduler.tpot_target_s must be positive"):
        slo(tpot_target_s=0)
    from core.errors import RequestError

    with pytest.raises(RequestError, match="slo_ttft_s must be a positive number"):
        SamplingParams(slo_ttft_s=-1.0)


# ---- load shedding through the engine --------------------------------------------------------------


@pytest.fixture()
def shed_engine(tiny_llama):
    engine = Engine(tiny_config(tiny_llama, scheduler="slo", max_num_batched_tokens=64, max_model_len=256))
    engine.core.context.cost_model = costs = fixed_costs(overhead=0.010, per_token=0.001)
    engine.scheduler.context = engine.core.context
    engine.scheduler.context.clock = Clock(100.0)
    return engine, costs


def test_shedding_refuses_exactly_the_requests_that_cannot_make_it(shed_engine):
    engine, costs = shed_engine
    costs.coef = np.array([0.010, 0.010, 0.0, 0.0, 0.0]) * SCALE  # 10 ms + 10 ms per token
    for _ in range(3):  # queued, each with a deadline 1 s from now: 120 prompt tokens
        engine.add_request(prompt_token_ids=[7] * 40, params=SamplingParams(max_tokens=4, slo_ttft_s=1.0),
                           arrival_time=100.0)

    def steps(*tokens):  # 10 ms + 10 ms per token, a step at most 64 tokens (the budget)
        return sum(0.010 + 0.010 * t for t in tokens)

    def outcome(target):
        try:
            engine.add_request(prompt_token_ids=[9] * 20, params=SamplingParams(max_tokens=4, slo_ttft_s=target),
                               arrival_time=100.0, shed=True)
            return "accepted"
        except DeadlineError as e:
            assert e.predicted_ttft_s > e.target_s == target and e.retry_after_s >= 1
            return "refused"

    probe = Sequence("x", [1] * 20, SamplingParams(slo_ttft_s=5.0), arrival_time=100.0)
    assert engine.scheduler.predict_ttft(probe) == pytest.approx(steps(64, 64, 12))  # 120 queued + its own 20
    # a tighter deadline than the queue's goes first: only its own 20 tokens, one 210 ms step
    assert outcome(0.2) == "refused" and outcome(0.5) == "accepted"
    # a later deadline waits for the 20 + 120 queued: 160 tokens with its own, 1.63 s
    assert steps(64, 64, 32) == pytest.approx(1.63)
    assert [outcome(t) for t in (1.5, 1.6, 1.7)] == ["refused", "refused", "accepted"]
    # now 180 tokens are ahead of any later deadline: 1.83 s with its own
    assert [outcome(t) for t in (1.8, 2.5)] == ["refused", "accepted"]
    assert steps(64, 64, 64, 8) > 1.8 and steps(64, 64, 52) < 2.5
    assert len(engine.requests) == 3 + 3  # the queued, and the three accepted


def test_shedding_needs_a_scheduler_that_predicts(tiny_llama):
    engine = Engine(tiny_config(tiny_llama, scheduler="continuous"))
    with pytest.raises(ConfigError, match="load shedding needs a scheduler that predicts TTFT"):
        engine.add_request(prompt_token_ids=[1, 2, 3], shed=True)
