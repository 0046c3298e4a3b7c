"""The first engine: static batches over the contiguous allocator, observers, aborts."""

import pytest

from core.config import CacheConfig
from core.engine.engine import Engine
from core.engine.registry import hookimpl
from core.engine.types import KVCacheSpec, SamplingParams, ScheduledSeq, Sequence
from core.errors import ConfigError
from plugins.cache.contiguous import ContiguousAllocator
from tests.tiny import step_inputs, tiny_config


def _spec(max_len=64):
    import torch

    return KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, max_model_len=max_len)


def test_contiguous_allocator_reserves_one_slot_per_sequence():
    alloc = ContiguousAllocator(CacheConfig(), _spec(), max_num_seqs=2)
    a, b, c = (Sequence("r", [1, 2, 3], SamplingParams()) for _ in range(3))
    assert alloc.allocate(a, 3) and alloc.allocate(b, 3)
    assert not alloc.allocate(c, 3)  # both slots taken
    assert alloc.stats().num_free_blocks == 0 and alloc.stats().usage == 1.0
    a.num_computed_tokens = 3
    assert not alloc.allocate(a, 62)  # past max_model_len
    meta = step_inputs(alloc, [ScheduledSeq(a, 2)]).attn
    slot = meta.block_tables[0, 0].item()
    assert meta.slot_mapping.tolist() == [slot * 64 + 3, slot * 64 + 4]
    assert meta.context_lens.tolist() == [5]
    alloc.free(a)
    assert alloc.allocate(c, 3)
    alloc.free(b), alloc.free(c)
    assert alloc.stats().num_free_blocks == alloc.num_blocks


def test_contiguous_allocator_sizes_from_memory_budget():
    spec = _spec(64)  # 2*2*2*16*4 = 512 B/token, 32 KB per sequence
    assert ContiguousAllocator(CacheConfig(memory_gb=32768 * 5 / 1e9), spec, 99).num_blocks == 5
    with pytest.raises(ConfigError, match="holds no sequence"):
        ContiguousAllocator(CacheConfig(memory_gb=1e-9), spec, 99)


class StepLog:
    def __init__(self):
        self.steps, self.finished = [], []

    @hookimpl
    def servelab_step_finished(self, step_stats):
        self.steps.append(step_stats)

    @hookimpl
    def servelab_request_finished(self, request_id, sequences, records):
        self.finished.append((request_id, records))


def test_static_batch_runs_to_completion_before_the_next(tiny_llama):
    engine = Engine(tiny_config(tiny_llama, max_num_seqs=2))
    log = StepLog()
    engine.registry.pm.register(log)
    try:
        short = SamplingParams(max_tokens=2, ignore_eos=True)
        long = SamplingParams(max_tokens=6, ignore_eos=True)
        ids = [engine.add_request("a", short), engine.add_request("bb", long), engine.add_request("ccc", short)]
        order = []
        while engine.has_unfinished():
            engine.step()
            order.append((engine.scheduler.num_running, engine.scheduler.num_waiting))
    finally:
        engine.registry.pm.unregister(log)
    # the third request waits although the first finished after 2 tokens: 6 steps for batch 1, 2 for batch 2
    assert len(log.steps) == 8
    assert [s.num_waiting for s in log.steps[:6]] == [1] * 6
    assert [rid for rid, _ in log.finished] == [ids[0], ids[1], ids[2]]
    m = dict(log.finished)[ids[2]][0]
    assert m.num_output_tokens == 2 and m.queue_s > 0 and m.ttft_s >= m.queue_s
    assert log.steps[0].num_prefill_tokens == 3 and log.steps[1].num_decode_tokens == 2
    assert engine.allocator.stats().num_free_blocks == engine.allocator.num_blocks


def test_static_respects_batched_token_budget(tiny_llama):
    engine = Engine(tiny_config(tiny_llama, max_num_seqs=8, max_num_batched_tokens=10))
    for _ in range(3):
        engine.add_request([7] * 6, SamplingParams(max_tokens=1))
    out = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [6]  # 12 > 10: the second waits


def test_abort_frees_the_slot(tiny_llama):
    engine = Engine(tiny_config(tiny_llama, max_num_seqs=2))
    rid = engine.add_request("abc", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.allocator.stats().num_free_blocks == 1
    engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.allocator.stats().num_free_blocks == 2


def test_output_capped_at_max_model_len(tiny_llama):
    engine = Engine(tiny_config(tiny_llama, max_model_len=16))
    out = engine.generate([[1] * 10], SamplingParams(max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
