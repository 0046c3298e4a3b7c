"""`python -m core disagg`: prefill/decode disaggregation on simulated devices. Constructed cases
check every time against the step-time model by hand: the prefill step, the KV transfer over the
link (and its queue), the decode instance loading the prompt instead of computing it, the routing;
then the break-even arithmetic, the errors a user can cause and one small end-to-end report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from core.bench.disagg import simulate
from core.bench.disagg_report import crossing, tpot_break_even
from core.cli import main
from core.config.compose import compose
from core.engine.components import engine_config, shape_only
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.errors import RequestError
from scenarios.workloads import RequestSpec

BASE = ["backend=simulator", "hardware=h100-80gb", "model=llama-3.1-8b", "scheduler=continuous", "cache=paged"]
SLO = (10.0, 1.0)  # loose: these tests read times, not attainment


class Bar:
    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int) -> None:
        self.n += n


@pytest.fixture(scope="module")
def setup():
    ec = engine_config(compose(BASE))
    return ec, shape_only(ec)


def requests(*specs):
    """(arrival, prompt_len, output_len) -> requests with prompts that share no prefix."""
    return SimpleNamespace(requests=[
        RequestSpec(i, a, p, o, prompt_token_ids=[1000 * (i + 1) + k % 997 for k in range(p)])
        for i, (a, p, o) in enumerate(specs)])


def step(engine_or_model, tokens: int, kv: int, pairs: float) -> float:
    return float(engine_or_model.backend.time_model.step(tokens, 1, kv, pairs, 1).total)


def test_a_remote_prefill_is_loaded_not_computed(setup):
    """A decode instance given a 400-token prompt whose first 399 tokens' KV arrived computes only
    the last one: its first step costs exactly a one-token step over 400 keys."""
    ec, loaded = setup
    engine = Engine(ec, loaded)
    engine.add_request(prompt_token_ids=list(range(1, 401)), request_id="r", arrival_time=0.0,
                       params=SamplingParams(max_tokens=1, ignore_eos=True, remote_prefill_tokens=399))
    engine.step(outputs=False)
    assert engine.core.context.clock() == pytest.approx(step(engine, 1, 400, 400), rel=1e-12)
    full = Engine(ec, loaded)
    full.add_request(prompt_token_ids=list(range(1, 401)), request_id="r", arrival_time=0.0,
                     params=SamplingParams(max_tokens=1, ignore_eos=True))
    full.step(outputs=False)
    assert full.core.context.clock() == pytest.approx(step(full, 400, 400, 400 * (400 - 399 / 2)), rel=1e-12)
    assert full.core.context.clock() > 1.4 * engine.core.context.clock()  # 400 tokens of compute against 1


def test_one_request_prefill_transfer_decode_adds_up(setup):
    """1P:1D, one 400-token request with 3 output tokens: TTFT = the prefill step + the transfer
    (latency + 400 x KV bytes / bandwidth) + the decode instance's one-token step; then one step
    per token at a growing context."""
    ec, loaded = setup
    probe = Engine(ec, loaded)
    kv = probe.kv_spec.bytes_per_token
    prefill = step(probe, 400, 400, 400 * (400 - 399 / 2))
    transfer = 0.002 + 400 * kv / 10e9
    decode = [step(probe, 1, c, c) for c in (400, 401, 402)]
    s = simulate(ec, loaded, requests((0.5, 400, 3)), 1, 2, 10.0, 0.002, SLO, Bar())
    assert s["num_requests"] == 1
    assert s["ttft_s"]["p50"] == pytest.approx(prefill + transfer + decode[0], rel=1e-9)
    assert s["e2e_s"]["p50"] == pytest.approx(prefill + transfer + sum(decode), rel=1e-9)
    assert s["transfer_s"]["p50"] == pytest.approx(transfer, rel=1e-9)
    assert s["transfer_s"]["wait_p99"] == 0.0


def test_transfers_from_one_prefill_instance_queue_on_its_link(setup):
    """Two prompts prefilled in the same step leave one after the other: the second waits for the
    first's whole transfer."""
    ec, loaded = setup
    kv = Engine(ec, loaded).kv_spec.bytes_per_token
    s = simulate(ec, loaded, requests((0.0, 300, 2), (0.0, 200, 2)), 1, 2, 1.0, 0.0, SLO, Bar())
    first = 300 * kv / 1e9
    assert s["num_requests"] == 2
    assert s["transfer_s"]["wait_p99"] == pytest.approx(0.99 * first, rel=1e-6)  # p99 of (0, first): numpy's linear


def test_colocated_replicas_split_simultaneous_requests(setup):
    """Two requests at once on two colocated instances: each gets its own, so both first tokens
    come after one lone prefill step (on one instance they would share a longer step)."""
    ec, loaded = setup
    probe = Engine(ec, loaded)
    lone = step(probe, 300, 300, 300 * (300 - 299 / 2))
    bar = Bar()
    s = simulate(ec, loaded, requests((0.0, 300, 1), (0.0, 300, 1)), None, 2, 1.0, 0.0, SLO, bar)
    assert s["ttft_s"]["max"] == pytest.approx(lone, rel=1e-9)
    assert bar.n == 2 and s["transfer_s"] is None
    one = simulate(ec, loaded, requests((0.0, 300, 1), (0.0, 300, 1)), None, 1, 1.0, 0.0, SLO, Bar())
    assert one["ttft_s"]["max"] > 1.5 * lone


def test_the_break_even_is_where_the_lead_starts_and_stays():
    assert crossing([1, 2, 3, 4], [0.0, 0.01, 0.05, 0.06], 0.02) == pytest.approx(2 + 0.01 / 0.04)
    assert crossing([1, 2, 3], [0.05, 0.03, 0.04], 0.02) == 1  # leads from the first point
    assert crossing([1, 2, 3, 4], [0.0, 0.05, 0.0, -0.1], 0.02) is None  # a lead that goes again is noise
    assert crossing([1, 2], [0.02, 0.02], 0.02) is None  # within the margin is a tie


def test_the_tpot_break_even_compares_slo_capacities():
    """Constructed attainment curves: at a loose TPOT target colocated sustains 2.2 req/s against
    the split's 1.5; at a tight one colocated sustains nothing and the split 2.11. The break-even
    lies between, where the capacity lead changes hands."""
    curves = {"colocated": {0.005: [0.1, 0.0, 0.0], 0.01: [0.5, 0.2, 0.1], 0.05: [1.0, 1.0, 0.5]},
              "1P:1D": {0.005: [0.2, 0.1, 0.0], 0.01: [1.0, 0.95, 0.5], 0.05: [1.0, 0.8, 0.5]}}
    points = [{"config": c, "kind": "colocated" if c == "colocated" else "disaggregated", "rate": rate,
               "attained_by_tpot": {t: curve[t][i] for t in curve}}
              for c, curve in curves.items() for i, rate in enumerate((1.0, 2.0, 3.0))]
    tp = tpot_break_even(points, [0.05, 0.01, 0.005], 0.9, 0.05)  # at 5 ms neither serves: no verdict there
    split = [2 + 0.05 / 0.45, 1 + 0.1 / 0.2]
    assert tp["capacities"]["colocated"] == pytest.approx([0.0, 0.0, 2.2])
    assert tp["capacities"]["1P:1D"] == pytest.approx([0.0, *split])
    lead_loose, lead_tight = split[1] - 2.2 * 1.05, split[0]
    assert tp["tpot_s"]["colocated"] == pytest.approx(0.05 - 0.04 * (0 - lead_loose) / (lead_tight - lead_loose))


def test_remote_prefill_tokens_must_be_non_negative():
    with pytest.raises(RequestError, match="remote_prefill_tokens must be a non-negative integer"):
        SamplingParams(remote_prefill_tokens=-1)


H100 = "hardware=h100-80gb"


@pytest.mark.parametrize("overrides, message", [
    (["backend=torch"], "disagg simulates its instances: add backend=simulator"),
    ([H100, "disagg.instances=1"], "disagg.instances must be at least 2"),
    ([H100, "disagg.prefill_instances=[4]"], "disagg.prefill_instances must each be in [1, 3]"),
    ([H100, "disagg.rates=[0]"], "disagg.rates must be positive"),
    ([H100, "disagg.colocated=[sometimes]"], "disagg.colocated must name baselines among chunked, whole"),
    ([H100, "disagg.bandwidths=[-1]"], "must be positive GB/s"),
    ([H100, "hardware.interconnect_gbs=0"], "has no interconnect: set disagg.transfer_gbs"),
    ([H100, "disagg.bandwidths=[10]", "disagg.bandwidth_rate=7"], "disagg.bandwidth_rate=7 must be one of disagg.rates"),
])
def test_user_errors_are_one_line(tmp_path, capsys, overrides, message):
    rc = main(["disagg", "model=llama-3.1-8b", f"disagg.report_dir={tmp_path}", "disagg.num_requests=2",
               "disagg.rates=[1]", "run.progress=false", *overrides])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_report_states_capacities_and_break_even(tmp_path):
    rc = main(["disagg", "hardware=h100-80gb", "model=llama-3.1-8b", "workload=long_context",
               "model.max_model_len=16384", f"disagg.report_dir={tmp_path}", "disagg.name=d", "disagg.num_requests=12",
               "disagg.rates=[1,4]", "disagg.prefill_instances=[1,2]", "disagg.bandwidths=[5,50]",
               "run.progress=false"])
    assert rc == 0
    r = json.loads((tmp_path / "d" / "report.json").read_text())
    main_points = [p for p in r["points"] if "bandwidth_gbs" not in p]
    assert {(p["config"], p["rate"]) for p in main_points} == {
        (c, rate) for c in ("colocated", "colocated, whole prompts", "1P:3D", "2P:2D") for rate in (1, 4)}
    assert all(p["num_requests"] + p["rejected"] == 12 for p in r["points"])
    assert [p["bandwidth_gbs"] for p in r["points"] if "bandwidth_gbs" in p] == [5, 50]
    slow, fast = (p for p in r["points"] if "bandwidth_gbs" in p)
    assert slow["transfer_p50_s"] > 5 * fast["transfer_p50_s"]  # 10x less bandwidth, plus the fixed latency
    assert set(r["capacities"]) == {"colocated", "colocated, whole prompts", "1P:3D", "2P:2D"}
    assert set(r["tpot"]["tpot_s"]) == {"colocated", "colocated, whole prompts"}
    assert 0.05 in r["tpot"]["targets"] and len(r["tpot"]["capacities"]["2P:2D"]) == len(r["tpot"]["targets"])
    md = (tmp_path / "d" / "report.md").read_text()
    assert "**simulated**" in md and "## Break-even" in md and "attainment.png" in md
    assert (tmp_path / "d" / "attainment.png").stat().st_size > 0
