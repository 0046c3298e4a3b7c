"""Metrics on constructed timelines."""

import math

import pytest
import torch

from core.bench.roofline import CostModel
from core.bench.summary import meets_slo, percentiles, summarize
from core.engine.records import make_record, sequence_record
from core.engine.types import SamplingParams, Sequence, SequenceStatus
from core.model.llama import ModelArgs


def request_metrics(seq):
    return sequence_record(seq).to_dict()


def _seq(arrival, scheduled, token_times, prompt=10):
    s = Sequence("r", [1] * prompt, SamplingParams(max_tokens=len(token_times)), arrival_time=arrival)
    s.timings.first_scheduled = scheduled
    s.timings.prefill_done = token_times[0] - 0.01
    s.timings.first_token = token_times[0]
    s.timings.token_times = list(token_times)
    s.timings.finished = token_times[-1]
    s.output_token_ids = [5] * len(token_times)
    s.status = SequenceStatus.FINISHED_LENGTH
    return s


def test_request_metrics_on_a_constructed_timeline():
    m = request_metrics(_seq(arrival=1.0, scheduled=1.5, token_times=[2.0, 2.1, 2.3, 2.6]))
    assert m["queue_s"] == pytest.approx(0.5)
    assert m["ttft_s"] == pytest.approx(1.0)
    assert m["e2e_s"] == pytest.approx(1.6)
    assert m["tpot_s"] == pytest.approx(0.6 / 3)  # (e2e - ttft) / (n - 1)
    assert m["itl_s"] == pytest.approx([0.1, 0.2, 0.3])
    assert m["prefill_s"] == pytest.approx(0.49)
    assert m["finish_reason"] == "length"


def test_tpot_undefined_with_one_output_token():
    m = request_metrics(_seq(arrival=0.0, scheduled=0.0, token_times=[0.4]))
    assert m["ttft_s"] == pytest.approx(0.4) and m["e2e_s"] == pytest.approx(0.4)
    assert m["tpot_s"] is None and m["itl_s"] == []


def test_percentiles_interpolate_linearly():
    p = percentiles(list(range(1, 101)) + [None])  # None (undefined TPOT) is skipped
    assert p["n"] == 100 and p["mean"] == pytest.approx(50.5)
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert percentiles([None]) == {"n": 0}


def test_goodput_counts_requests_meeting_both_slos():
    records = [
        {"ttft_s": 0.5, "tpot_s": 0.04, "num_output_tokens": 10, "num_prompt_tokens": 5, "itl_s": []},  # good
        {"ttft_s": 1.5, "tpot_s": 0.01, "num_output_tokens": 10, "num_prompt_tokens": 5, "itl_s": []},  # TTFT too slow
        {"ttft_s": 0.2, "tpot_s": 0.06, "num_output_tokens": 10, "num_prompt_tokens": 5, "itl_s": []},  # TPOT too slow
        {"ttft_s": 0.9, "tpot_s": None, "num_output_tokens": 1, "num_prompt_tokens": 5, "itl_s": []},  # 1 token: TTFT only
    ]
    assert [meets_slo(r, 1.0, 0.05) for r in records] == [True, False, False, True]
    s = summarize(records, duration_s=4.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert s["goodput_req_s"] == pytest.approx(0.5) and s["slo"]["attained"] == pytest.approx(0.5)
    assert s["output_tok_s"] == pytest.approx(31 / 4) and s["total_tok_s"] == pytest.approx(51 / 4)
    assert s["req_s"] == pytest.approx(1.0)


def test_summary_kv_usage_and_prefix_hits_from_steps():
    rec = [{"ttft_s": 0.1, "tpot_s": None, "num_output_tokens": 1, "num_prompt_tokens": 5, "itl_s": []}]
    steps = [{"kv_usage": 0.2, "prefix_queries": 10, "prefix_hits": 0}, {"kv_usage": 0.6, "prefix_queries": 40,
                                                                         "prefix_hits": 30}]
    s = summarize(rec, 1.0, steps)
    assert s["kv_usage"] == {"peak": 0.6, "mean": pytest.approx(0.4)}
    assert s["prefix_cache"]["hit_rate"] == pytest.approx(0.75)


def test_cost_model_bounds():
    args = ModelArgs(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    cm = CostModel(args, weight_bytes=1_000_000, kv_bytes_per_token=256, peak_gflops=1.0, bandwidth_gbs=1.0)
    # per layer: q 64x64 + k,v 2x64x32 + o 64x64 + mlp 3x64x128
    assert cm.linear_params == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128)
    t, bound = cm.step_time(num_tokens=1, num_sampled=1, attn_pairs=10, kv_tokens_read=10)
    assert bound == "memory" and t == pytest.approx((1_000_000 + 256 * 11) / 1e9)
    t, bound = cm.step_time(num_tokens=4096, num_sampled=1, attn_pairs=0, kv_tokens_read=0)
    assert bound == "compute" and t == pytest.approx((2 * cm.linear_params * 4096 + 2 * 64000) / 1e9)
    floor = cm.workload_floor([10, 20], [1, 5])
    assert floor["time_s"] == max(floor["compute_s"], floor["memory_s"])
    assert floor["memory_s"] >= 5 * 1_000_000 / 1e9  # the longest request needs 5 weight reads
    assert math.isfinite(floor["flops"])



def test_machine_rates_keep_the_highest_peak_seen(tmp_path, monkeypatch):
    """Rates cached while the machine was busy are measured again when a quick probe reads faster,
    each keeping its highest; a probe that does not is answered from the cache."""
    from core.bench import roofline

    monkeypatch.setattr(roofline, "CACHE_DIR", tmp_path)
    probe = {"gbs": 20.0}
    monkeypatch.setattr(roofline, "measure_bandwidth_gbs", lambda *a, **k: probe["gbs"])
    gflops = {torch.float32: 100.0, torch.bfloat16: 10.0}
    monkeypatch.setattr(roofline, "measure_matmul_gflops", lambda dtype, *a, **k: gflops[dtype])
    first = roofline.machine_rates()
    assert (first["mem_bandwidth_gbs"], first["matmul_gflops"]) == (20.0, {"fp32": 100.0, "bf16": 10.0})
    probe["gbs"], gflops[torch.float32], gflops[torch.bfloat16] = 21.5, 300.0, 5.0  # within 10 %: the cache
    assert roofline.machine_rates() == first
    probe["gbs"] = 30.0  # the busy figure was low: all measured again, the highest of each kept
    again = roofline.machine_rates()
    assert (again["mem_bandwidth_gbs"], again["matmul_gflops"]) == (30.0, {"fp32": 300.0, "bf16": 10.0})
    probe["gbs"] = 12.0
    assert roofline.machine_rates(remeasure=True)["mem_bandwidth_gbs"] == 12.0  # afresh, as asked

def test_one_record_schema_for_engine_peers_and_streams():
    # a stream may carry several tokens in one chunk: the true count comes from the usage block
    r = make_record("x", arrival=10.0, token_times=[10.5, 10.7], num_output_tokens=5, finished=11.0,
                    num_prompt_tokens=3, origin=9.0, error=None, model="m")
    assert (r.arrival_s, r.finish_s) == (pytest.approx(1.0), pytest.approx(2.0))
    assert r.token_times_s == pytest.approx([1.5, 1.7]) and r.itl_s == pytest.approx([0.2])
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.0)
    assert r.tpot_s == pytest.approx(0.5 / 4) and r.queue_s is None and r.prefill_s is None
    # the engine's record of a sequence is the same schema, field for field
    seq_rec = request_metrics(_seq(arrival=1.0, scheduled=1.5, token_times=[2.0, 2.1]))
    assert set(seq_rec) == set(r.to_dict())


@pytest.mark.parametrize("gflops, size", [(1.0, 512), (20.0, 1024), (1000.0, 2048)])
def test_the_matmul_peak_is_measured_at_a_size_its_rate_affords(monkeypatch, gflops, size):
    """An emulated dtype (bf16 at 1 GFLOP/s on an AVX2 CPU) stops growing the product early instead
    of spending a minute on 2048^3; a fast one reaches the full size. Constructed timings."""
    from core.bench import roofline

    sizes = []

    def fake_best_of(fn, reps, device):
        fn()
        n = sizes[-1]
        return 2 * n**3 / (gflops * 1e9)

    real_randn = torch.randn
    monkeypatch.setattr(roofline.torch, "randn", lambda n, m, **kw: (sizes.append(n), real_randn(2, 2, **kw))[1])
    monkeypatch.setattr(roofline, "_best_of", fake_best_of)
    assert roofline.measure_matmul_gflops(torch.float32, 2048, budget_s=0.5) == pytest.approx(gflops, rel=1e-9)
    assert sizes[-1] == size
