"""Scheduler `slo`'s throughput floor (`min_prefill_share`): under a TPOT target that leaves room
for few prompt tokens beside many decodes, a step's prefill chunk still takes at least that share
of the step, so the prefill rate does not collapse; where the target leaves room, nothing changes."""

import pytest

from core.errors import ConfigError
from tests.test_slo_predict import planned_ttft
from tests.test_slo_scheduler import predicted, run_step, seq, slo


def _with_decodes(n, **kw):
    s = slo(max_num_seqs=64, long_prefill_token_threshold=2048, **kw)
    for i in range(n):
        s.add(seq(4, max_tokens=60, start=100 * i))
    run_step(s)  # their prefills: no decode runs yet, so no ceiling
    return s


def _chunk(s, long):
    out = run_step(s)
    return {x.seq is long: x.num_new_tokens for x in out.scheduled}[True], predicted(s, out)


@pytest.mark.parametrize("share, chunk", [
    (0.0, 16),  # the target leaves 10 tokens (10 ms + 40 decodes x 1 ms + c <= 60 ms): the 16-token minimum
    (0.5, 50),  # c >= half of 50 ms + c: 50 tokens, a 100 ms step
    (0.25, 17),  # c >= (50 + c) / 4: 16.7, so 17
])
def test_the_chunk_takes_its_share_of_a_step_full_of_decodes(share, chunk):
    s = _with_decodes(40, tpot_target_s=0.06, min_prefill_share=share)
    long = seq(300, max_tokens=2, start=9000)
    s.add(long)
    got, step = _chunk(s, long)
    assert got == chunk
    assert step == pytest.approx(0.010 + 0.001 * (40 + chunk), abs=1e-9)
    if share:
        assert chunk * 0.001 >= share * step - 1e-12 > (chunk - 1) * 0.001 - share * 0.001


def test_where_the_target_leaves_room_the_share_changes_nothing():
    s = _with_decodes(4, min_prefill_share=0.5)  # 10 ms + 4 ms of decodes: 86 tokens fit in 100 ms
    long = seq(300, max_tokens=2, start=9000)
    s.add(long)
    assert _chunk(s, long) == (86, pytest.approx(0.100, abs=1e-9))


def test_the_forecast_plays_the_same_floor():
    s = _with_decodes(40, tpot_target_s=0.06, min_prefill_share=0.5)
    s.add(seq(120, max_tokens=1, start=9000))  # done with its prefill (the forecast adds no new decodes)
    probe = seq(30, max_tokens=2, start=20000, ttft=50.0)
    # chunks of 50, 50 and the last 20 (a 70 ms step: no room left for the probe under the 60 ms
    # target), then the probe's 30 in a step of its own
    forecast = s.predict_ttft(probe)
    assert forecast == pytest.approx(sum(0.010 + 0.001 * (40 + c) for c in (50, 50, 20, 30)), abs=1e-9)
    assert planned_ttft(s, probe) == pytest.approx(forecast, abs=1e-9)


def test_the_share_must_be_below_one():
    with pytest.raises(ConfigError, match=r"scheduler.min_prefill_share must be in \[0, 1\), got 1.0"):
        slo(min_prefill_share=1.0)


@pytest.mark.parametrize("horizon, max_tokens, chunk", [
    (0, 60, 89),  # a decode that has just started: the bare 0.1 s target, 10 ms + 1 decode + 89 tokens
    (10, 60, 979),  # 10 more tokens at an 11 ms decode step: 0.1 + 10 x 0.089 = 0.99 s allowed
    (10, 5, 356),  # only 3 more to come (max_tokens 5): 0.1 + 3 x 0.089 = 0.367 s
])
def test_the_slack_horizon_counts_the_tokens_still_to_come(horizon, max_tokens, chunk):
    s = slo(spend_slack=True, slack_horizon=horizon, long_prefill_token_threshold=2048)
    s.add(seq(4, max_tokens=max_tokens))
    run_step(s, now=0.0)  # its first token, at t = 0
    long = seq(2000, start=500)
    s.add(long)
    assert _chunk(s, long)[0] == chunk


def test_the_slack_horizon_must_not_be_negative():
    with pytest.raises(ConfigError, match="scheduler.slack_horizon must be at least 0, got -1"):
        slo(slack_horizon=-1)
