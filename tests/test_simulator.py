"""backend=simulator: the roofline step-time model on constructed steps, the virtual clock through
the real engine, and the errors a user can cause."""

from __future__ import annotations

import json

import pytest

from core.cli import main
from core.engine.hardware import HardwareProfile, StepTimeModel
from core.model.llama import ModelArgs

LLAMA2_7B = ModelArgs(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128)
A100 = HardwareProfile(name="a100", bf16_tflops=312, memory_bandwidth_gbs=2000, memory_gb=80, interconnect_gbs=300,
                       matmul_efficiency=0.5, attention_efficiency=0.25, bandwidth_efficiency=0.8,
                       step_overhead_s=0.002, sequence_overhead_s=1e-5, allreduce_latency_s=1e-5)
KV_PER_TOKEN = 2 * 32 * 32 * 128 * 2
LINEAR = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
HEAD = 32000 * 4096


def test_a_batch_1_decode_step_reads_the_weights_and_the_kv():
    m = StepTimeModel(LLAMA2_7B, A100, 2, KV_PER_TOKEN)
    t = m.step(num_tokens=1, num_sampled=1, kv_tokens_read=1000, attn_pairs=1000, num_seqs=1)
    bw = 2000e9 * 0.8
    assert t.linear == pytest.approx(2 * LINEAR / bw, rel=1e-12)  # memory-bound: 13 GB at 1.6 TB/s
    assert t.lm_head == pytest.approx(2 * HEAD / bw, rel=1e-12)
    assert t.attention == pytest.approx(KV_PER_TOKEN * 1001 / bw, rel=1e-12)
    assert t.overhead == pytest.approx(0.002 + 1e-5)
    assert t.allreduce == 0
    assert t.total == pytest.approx(t.linear + t.lm_head + t.attention + t.overhead)


def test_a_prefill_chunk_is_compute_bound_and_tensor_parallel_splits_it():
    m = StepTimeModel(LLAMA2_7B, A100, 2, KV_PER_TOKEN)
    pairs = 2048 * (2048 + 1) / 2
    t = m.step(num_tokens=2048, num_sampled=1, kv_tokens_read=2048, attn_pairs=pairs, num_seqs=1)
    assert t.linear == pytest.approx(2 * LINEAR * 2048 / (312e12 * 0.5), rel=1e-12)
    assert t.attention == pytest.approx(4 * 32 * 32 * 128 * pairs / (312e12 * 0.25), rel=1e-12)
    tp2 = StepTimeModel(LLAMA2_7B, A100, 2, KV_PER_TOKEN, tensor_parallel_size=2).step(2048, 1, 2048, pairs, 1)
    assert tp2.linear == pytest.approx(t.linear / 2, rel=1e-12)
    assert tp2.attention == pytest.approx(t.attention / 2, rel=1e-12)
    # two ring all-reduces a layer of 2048 x 4096 bf16 activations: 2 (n - 1) / n of it crosses the link
    per = 1e-5 + 2 * (1 / 2) * 2048 * 4096 * 2 / 300e9
    assert tp2.allreduce == pytest.approx(2 * 32 * per, rel=1e-12)


def test_kv_heads_fewer_than_ranks_are_replicated():
    gqa = ModelArgs(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                    num_kv_heads=4, head_dim=128)
    kv = 2 * 32 * 4 * 128 * 2
    at = {tp: StepTimeModel(gqa, A100, 2, kv, tensor_parallel_size=tp).step(1, 1, 10000, 10000, 1).attention
          for tp in (1, 4, 8)}
    assert at[4] == pytest.approx(at[1] / 4, rel=1e-12)
    assert at[8] == pytest.approx(at[4], rel=1e-12)  # 4 KV heads over 8 ranks: each rank reads one head's worth


def _run(tmp_path, *overrides):
    rc = main(["run", "backend=simulator", "hardware=a100-80gb", "model=llama-2-7b", f"run.report_dir={tmp_path}",
               "run.name=sim", "run.warmup_requests=0", "run.plots=false", "run.progress=false", *overrides])
    assert rc == 0
    return json.loads((tmp_path / "sim" / "report.json").read_text())


def test_one_request_takes_exactly_its_modelled_steps(tmp_path):
    """One 512-token prompt and 4 output tokens on virtual time: TTFT is the prefill step, each
    later token one decode step; the report says it was simulated."""
    r = _run(tmp_path, "workload=fixed", "workload.num_requests=1", "workload.prompt_len=512",
             "workload.output_len=4")
    req = r["requests"][0]
    steps = r["steps"]
    assert len(steps) == 4 and steps[0]["num_prefill_tokens"] == 512
    assert req["ttft_s"] == pytest.approx(steps[0]["duration_s"], rel=1e-9)
    assert req["e2e_s"] == pytest.approx(sum(s["duration_s"] for s in steps), rel=1e-9)
    sim = r["summary"]["simulated"]
    assert sim["hardware"]["name"] == "a100-80gb" and sim["tensor_parallel_size"] == 1
    assert sum(sim["time_by_part_s"].values()) == pytest.approx(req["e2e_s"], rel=1e-9)
    assert "**simulated**" in (tmp_path / "sim" / "report.md").read_text()
    assert r["machine"]["device_type"] == "simulated"


def test_the_kv_pool_is_the_simulated_devices_memory_less_the_weights(tmp_path):
    r = _run(tmp_path, "workload=fixed", "workload.num_requests=2", "workload.output_len=2")
    blocks = int(r["kv_cache"].split(" blocks")[0].split()[-1])
    weights = 2 * (LINEAR + 2 * HEAD)
    budget_blocks = (0.9 * 80e9 - weights) / (16 * KV_PER_TOKEN)
    assert budget_blocks * 0.95 < blocks <= budget_blocks  # less the activation reserve


def test_continuous_batching_beats_static_on_a_long_tail_and_runs_repeat(tmp_path):
    """The real schedulers on simulated time: deterministic, and static batching waits on each
    batch's longest request (the seed: 1/3 to 1/2 of continuous's throughput)."""
    common = ["workload=chat_longtail", "workload.num_requests=64", "scheduler.max_num_seqs=16", "model.max_model_len=4096"]
    cont = _run(tmp_path, *common, "scheduler=continuous")["summary"]
    again = _run(tmp_path, *common, "scheduler=continuous")["summary"]
    static = _run(tmp_path, *common, "scheduler=static", "cache=contiguous")["summary"]
    assert again["output_tok_s"] == cont["output_tok_s"]
    assert static["output_tok_s"] < 0.8 * cont["output_tok_s"]


@pytest.mark.parametrize("overrides, message", [
    (["backend=simulator"], "backend=simulator needs hardware=NAME"),
    (["hardware=a100-80gb"], "is what backend=simulator simulates"),
    (["backend=simulator", "hardware=cpu", "hardware.path=/nonexistent.json"], "run `python -m core calibrate` first"),
    (["backend=simulator", "hardware=a100-80gb", "hardware.bf16_tflops=0"], "bf16_tflops must be positive"),
    (["backend=simulator", "hardware=a100-80gb", "model=llama-3-70b"], "leave no KV memory on a100-80gb"),
    (["backend=simulator", "hardware=a100-80gb", "backend.tensor_parallel_size=0"], "at least 1"),
])
def test_user_errors_are_one_line(tmp_path, capsys, overrides, message):
    rc = main(["run", "model=llama-2-7b", "workload=fixed", "workload.num_requests=1", f"run.report_dir={tmp_path}",
               *overrides])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_closed_loop_keeps_exactly_its_users_in_flight(tmp_path):
    """workload.arrival=concurrent: each of the 3 users sends its next request the moment its last
    one ends, so at most 3 are in flight and every later arrival is some request's finish."""
    r = _run(tmp_path, "workload=chat_longtail", "workload.num_requests=12", "workload.arrival=concurrent",
             "workload.concurrency=3")
    reqs = r["requests"]
    assert len(reqs) == 12
    finishes = sorted(q["finish_s"] for q in reqs)
    for q in reqs:
        in_flight = sum(1 for o in reqs if o["arrival_s"] <= q["arrival_s"] < o["finish_s"])
        assert in_flight <= 3
    later = sorted(q["arrival_s"] for q in reqs)[3:]
    assert all(min(abs(a - f) for f in finishes) < 1e-9 for a in later)
    assert "3 users" in r["workload"]["arrival"]
