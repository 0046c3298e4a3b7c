"""Micro-benchmarks of the hot pieces (pytest-benchmark; not part of the test run):

    python -m pytest benchmarks --benchmark-only [--benchmark-json reports/micro.json]

Each is parametrized over the in-repo implementations so new allocators and schedulers land
in the same table.
"""

import pytest
import torch

from core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from core.engine.engine import Engine
from core.engine.registry import get_registry
from core.engine.types import KVCacheSpec, SamplingParams, ScheduledSeq, Sequence
from servelab_kernels.attention import decode_attention
from tests.tiny import step_inputs

SPEC = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, max_model_len=2048)
ALLOCATORS = get_registry().names("cache")
SCHEDULERS = [n for n in get_registry().names("scheduler")]


@pytest.mark.parametrize("name", ALLOCATORS)
def test_allocator_allocate_append_free(benchmark, name):
    alloc = get_registry().create("cache", CacheConfig(name=name, memory_gb=2.0), spec=SPEC, max_num_seqs=256)
    seqs = [Sequence("r", list(range(200)), SamplingParams(max_tokens=64)) for _ in range(32)]

    def cycle():
        for s in seqs:
            s.num_computed_tokens = 0
            alloc.allocate(s, 200)
            s.num_computed_tokens = 200
        for _ in range(16):  # 16 decode appends each
            for s in seqs:
                alloc.allocate(s, 1)
                s.num_computed_tokens += 1
        step_inputs(alloc, [ScheduledSeq(s, 1) for s in seqs])  # the runner's block tables -> inputs
        for s in seqs:
            alloc.free(s)

    benchmark(cycle)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_scheduler_step_256_requests(benchmark, name):
    reg = get_registry()

    def setup():
        alloc = reg.create("cache", CacheConfig(), spec=SPEC, max_num_seqs=256)
        sched = reg.create("scheduler", SchedulerConfig(name=name, max_num_seqs=256, max_num_batched_tokens=1 << 20),
                           allocator=alloc)
        for i in range(256):
            sched.add(Sequence(str(i), [1] * (16 + i % 64), SamplingParams(max_tokens=32)))
        return (sched,), {}

    benchmark.pedantic(lambda sched: sched.schedule(), setup=setup, rounds=20)


@pytest.mark.parametrize("batch,ctx", [(1, 1024), (16, 512), (64, 256)])
def test_attention_decode(benchmark, batch, ctx):
    block_size = 16
    blocks = -(-ctx // block_size)
    kc = torch.randn(batch * blocks, 3, block_size, 64, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(batch * blocks).view(batch, blocks).int()
    q = torch.randn(batch, 9, 64, dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx)
    benchmark(decode_attention, q, kc, vc, perm, lens, 0.125)


def test_engine_decode_step_tiny(benchmark, tiny_llama):
    cfg = EngineConfig(model=ModelConfig(name="tiny", path=str(tiny_llama), max_model_len=256),
                       scheduler=SchedulerConfig(max_num_seqs=16))
    engine = Engine(cfg)
    for _ in range(16):
        engine.add_request([5] * 64, SamplingParams(max_tokens=10_000 // 64, ignore_eos=True))
    engine.step()  # prefill
    benchmark.pedantic(engine.step, rounds=50)
