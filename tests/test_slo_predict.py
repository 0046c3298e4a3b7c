"""Scheduler `slo`'s TTFT forecast (`predict_ttft`, behind load shedding) against the steps the
scheduler then really plans: the forward play obeys the same partial-prefill limits."""

import pytest

from tests.test_slo_scheduler import predicted, run_step, seq, slo


def planned_ttft(s, probe) -> float:
    """The sum of the predicted costs of the steps `schedule` plans until `probe` samples its first token."""
    s.add(probe)
    total = 0.0
    for _ in range(50):
        out = run_step(s)
        total += predicted(s, out)
        if any(x.seq is probe and x.needs_sample for x in out.scheduled):
            return total
    raise AssertionError("the probe never got its first token")


def cost(*tokens):  # fixed_costs(): 10 ms a step + 1 ms a token
    return sum(0.010 + 0.001 * t for t in tokens)


@pytest.mark.parametrize("max_partial, expected", [
    (1, cost(32, 32, 32, 4 + 20)),  # the long prompt alone, 32 at a time; the probe starts in its last step
    (4, cost(32 + 20)),  # the probe starts beside the capped long prompt
])
def test_the_forecast_respects_the_partial_prefill_limit(max_partial, expected):
    s = slo(max_num_batched_tokens=64, long_prefill_token_threshold=32, max_num_partial_prefills=max_partial)
    s.add(seq(100, max_tokens=2, start=1000))
    probe = seq(20, max_tokens=2, start=5000, ttft=20.0)  # a later deadline: it queues behind
    forecast = s.predict_ttft(probe)
    assert forecast == pytest.approx(expected, abs=1e-9)
    assert planned_ttft(s, probe) == pytest.approx(forecast, abs=1e-9)


def test_the_forecast_lets_a_short_prompt_past_a_long_one_waiting_for_the_long_slot():
    s = slo(max_num_batched_tokens=64, long_prefill_token_threshold=32, max_num_partial_prefills=4,
            max_long_partial_prefills=1)
    s.add(seq(100, max_tokens=2, start=1000))
    s.add(seq(100, max_tokens=2, start=2000))  # waits: the one long slot is taken
    probe = seq(20, max_tokens=2, start=5000, ttft=20.0)
    forecast = s.predict_ttft(probe)
    assert forecast == pytest.approx(cost(32 + 20), abs=1e-9)
    assert planned_ttft(s, probe) == pytest.approx(forecast, abs=1e-9)


def test_the_forecast_counts_running_decodes_and_prompts_mid_prefill():
    s = slo(max_num_batched_tokens=64, long_prefill_token_threshold=32, max_num_partial_prefills=1)
    s.add(seq(8, max_tokens=20, start=100))
    s.add(seq(100, max_tokens=2, start=1000))
    run_step(s)  # the short prompt whole (and done), the long one starts in the room left: 32
    run_step(s)  # a decode and the long one's second chunk
    probe = seq(20, max_tokens=2, start=5000, ttft=20.0)
    forecast = s.predict_ttft(probe)  # 1 decode + the long one's 32 and 4, then the probe's 20
    assert forecast == pytest.approx(cost(1 + 32, 1 + 4 + 20), abs=1e-9)
    assert planned_ttft(s, probe) == pytest.approx(forecast, abs=1e-9)
