"""The paged allocator and the continuous scheduler on constructed cases and against the baseline."""

import pytest
import torch

from core.engine.engine import Engine
from core.engine.types import DecoderOutput, KVCacheSpec, SamplingParams, ScheduledSeq, Sequence
from core.errors import RequestError
from plugins.cache.paged import PagedAllocator, PagedCacheConfig
from plugins.schedulers.continuous import ContinuousScheduler, ContinuousSchedulerConfig
from tests.tiny import step_inputs, tiny_config

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, max_model_len=256)
BYTES_PER_BLOCK = SPEC.bytes_per_token * 4  # block_size 4 below


def paged(num_blocks, block_size=4, **kw):
    cfg = PagedCacheConfig(name="paged", block_size=block_size,
                           memory_gb=num_blocks * SPEC.bytes_per_token * block_size / 1e9, **kw)
    return PagedAllocator(cfg, SPEC, max_num_seqs=1)


def seq(tokens, max_tokens=8, **kw):
    return Sequence("r", list(tokens), SamplingParams(max_tokens=max_tokens), **kw)


def engine_for(path, **kw):
    cache = kw.pop("cache", None)
    cfg = tiny_config(path, scheduler=kw.pop("scheduler", "continuous"), **kw)
    if cache is not None:
        cfg.cache = cache
    return Engine(cfg)


# ---- the allocator on constructed cases ------------------------------------------------------


def test_pool_arithmetic_and_block_tables():
    a = paged(10)
    assert a.num_blocks == 10 and a.stats().num_free_blocks == 10
    assert "10 blocks x 4 tokens = 40 tokens" in a.describe()
    s = seq(range(10))
    assert a.allocate(s, 10)
    table = a.tables[s.seq_id]
    assert len(table) == 3 and a.stats().num_free_blocks == 7
    meta = step_inputs(a, [ScheduledSeq(s, 10)]).attn
    expect = [table[p // 4] * 4 + p % 4 for p in range(10)]
    assert meta.slot_mapping.tolist() == expect and meta.context_lens.tolist() == [10]
    s.num_computed_tokens = 10
    s.output_token_ids.append(99)
    assert a.allocate(s, 1) and len(a.tables[s.seq_id]) == 3  # token 11 still fits block 3
    a.free(s)
    assert a.stats().num_free_blocks == 10


def test_allocation_fails_cleanly_when_the_pool_is_full():
    a = paged(3)
    s1, s2 = seq(range(8)), seq(range(100, 108))
    assert a.allocate(s1, 8)
    assert not a.allocate(s2, 8)  # needs 2, 1 left: nothing changes
    assert s2.seq_id not in a.tables and a.stats().num_free_blocks == 1


def test_prefix_cache_reuses_full_blocks_and_counts_hits():
    a = paged(16)
    system = list(range(12))  # three full blocks
    first = seq(system + [50, 51])
    assert a.match_prefix(first) == 0 and a.allocate(first, 14)
    second = seq(system + [60, 61, 62])
    hit = a.match_prefix(second)
    assert hit == 12
    second.num_computed_tokens = hit
    assert a.allocate(second, 3)
    assert a.tables[second.seq_id][:3] == a.tables[first.seq_id][:3]
    assert a.tables[second.seq_id][3] != a.tables[first.seq_id][3]
    st = a.stats()
    assert (st.prefix_queries, st.prefix_hits) == (14 + 15, 12)
    assert all(a.blocks[b].ref_count == 2 for b in a.tables[first.seq_id][:3])
    a.free(first), a.free(second)
    assert a.stats().num_free_blocks == 16


def test_a_fully_cached_prompt_still_computes_its_last_token():
    a = paged(16)
    p = seq(range(8))
    a.allocate(p, 8)
    again = seq(range(8))
    assert a.match_prefix(again) == 4  # not 8: the last block holds the token to sample from


def test_freed_prefixes_stay_cached_and_are_evicted_lru_only_when_needed():
    a = paged(6)
    old = seq(range(8))  # 2 full blocks
    a.allocate(old, 8)
    a.free(old)
    assert a.stats().num_free_blocks == 6  # counted free, still findable
    assert a.match_prefix(seq(list(range(8)) + [1])) == 8
    hog = seq(range(1000, 1016))  # 4 blocks: fits in the 4 plain free blocks, no eviction
    assert a.allocate(hog, 16)
    assert a.match_prefix(seq(list(range(8)) + [1])) == 8
    more = seq(range(2000, 2004))
    assert a.allocate(more, 4)  # now a cached block must go: the least recently used one, which is the
    # prefix's tail (free releases tail blocks first), so its first block is still found
    assert a.match_prefix(seq(list(range(8)) + [1])) == 4
    a.free(hog), a.free(more)
    assert a.stats().num_free_blocks == 6


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    a = paged(10)
    parent = seq(range(6))  # blocks: [0..3] full, [4, 5] partial
    a.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = seq(range(6))
    a.fork(parent, child)
    child.num_computed_tokens = 6  # the scheduler's half of a fork
    assert a.tables[child.seq_id] == a.tables[parent.seq_id]
    assert all(a.blocks[b].ref_count == 2 for b in a.tables[parent.seq_id])
    child.output_token_ids.append(7)
    assert a.allocate(child, 1)  # writes position 6 into the shared partial block
    (src, dst), = a.take_block_copies()
    assert a.tables[parent.seq_id][1] == src and a.tables[child.seq_id][1] == dst
    assert a.tables[child.seq_id][0] == a.tables[parent.seq_id][0]  # the full block stays shared
    parent.output_token_ids.append(8)
    assert a.allocate(parent, 1) and a.take_block_copies() == []  # the parent now owns src alone
    a.free(parent), a.free(child)
    assert a.stats().num_free_blocks == 10


def test_truncate_releases_tail_blocks():
    a = paged(10)
    s = seq(range(14))
    a.allocate(s, 14)
    s.num_computed_tokens = 14
    a.truncate(s, 5)
    assert len(a.tables[s.seq_id]) == 2 and s.num_computed_tokens == 14  # the allocator writes no sequence
    assert a.stats().num_free_blocks == 8
    a.free(s)
    assert a.stats().num_free_blocks == 10


def test_admission_of_a_request_larger_than_the_pool():
    a = paged(4)
    assert a.can_admit(seq(range(10), max_tokens=6))
    assert not a.can_admit(seq(range(10), max_tokens=7))  # 17 tokens need 5 blocks


# ---- the scheduler on constructed cases ------------------------------------------------------


def sched(num_blocks=64, **kw):
    cfg = ContinuousSchedulerConfig(name="continuous", **{"max_num_seqs": 8, "max_num_batched_tokens": 64, **kw})
    return ContinuousScheduler(cfg, paged(num_blocks))


def run_step(s):
    """Pretend the forward pass ran and sampled token 1 where due; the scheduler updates its sequences."""
    out = s.schedule()
    s.update_from_output(out, DecoderOutput({x.seq.seq_id: [1] for x in out.scheduled if x.needs_sample}), now=0.0)
    return out


def test_decode_first_then_chunked_prefill_within_the_budget():
    s = sched(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    short = seq(range(4), max_tokens=5, arrival_time=0.0)
    s.add(short)
    run_step(s)  # prefill of the short prompt
    long = seq(range(100, 140), max_tokens=2, arrival_time=1.0)
    s.add(long)
    out = run_step(s)
    assert [(x.seq is short, x.num_new_tokens) for x in out.scheduled] == [(True, 1), (False, 8)]
    chunks = [8]
    while long.in_prefill:
        out = run_step(s)
        chunks += [x.num_new_tokens for x in out.scheduled if x.seq is long]
    assert chunks == [8, 8, 8, 8, 8] and sum(chunks) == 40


def test_a_long_prompt_does_not_starve_short_ones():
    s = sched(max_num_batched_tokens=64, long_prefill_token_threshold=16, max_long_partial_prefills=1)
    longs = [seq(range(i * 1000, i * 1000 + 200), max_tokens=1, arrival_time=i) for i in range(2)]
    short = seq(range(5000, 5008), max_tokens=1, arrival_time=5)
    for x in longs + [short]:
        s.add(x)
    out = run_step(s)
    got = {id(x.seq): x.num_new_tokens for x in out.scheduled}
    assert got[id(longs[0])] == 16  # a long prompt: one capped chunk
    assert id(longs[1]) not in got  # only one long prefill at a time
    assert got[id(short)] == 8  # the short prompt goes ahead of the second long one


def test_finished_requests_leave_and_waiting_ones_join_at_once():
    s = sched(max_num_seqs=2)
    a, b, c = (seq(range(i * 10, i * 10 + 4), max_tokens=m, arrival_time=i) for i, m in enumerate((1, 6, 2)))
    for x in (a, b, c):
        s.add(x)
    out = run_step(s)
    assert {id(x.seq) for x in out.scheduled} == {id(a), id(b)}  # a finishes at its prefill
    out = run_step(s)
    assert {id(x.seq) for x in out.scheduled} == {id(b), id(c)}  # c joins while b still decodes


def test_preemption_by_recompute_picks_the_latest_arrival():
    s = sched(num_blocks=4, max_num_batched_tokens=64)
    early, late = seq(range(7), max_tokens=20, arrival_time=0.0), seq(range(50, 57), max_tokens=20, arrival_time=1.0)
    s.add(early), s.add(late)
    run_step(s)  # both prefilled: 2 blocks each, pool full
    preempted = []
    for _ in range(3):
        preempted += run_step(s).preempted
    assert preempted and preempted[0] is late
    assert late.num_computed_tokens == 0 and late in s.waiting
    assert early.num_output_tokens >= 3


def test_priority_with_aging_bounds_the_wait():
    s = sched(max_num_seqs=1, policy="priority", aging_steps=3)
    low = seq(range(4), max_tokens=1, arrival_time=0.0, priority=10)
    s.add(low)
    served_at = None
    for step in range(1, 60):
        s.add(seq(range(100 + step, 104 + step), max_tokens=1, arrival_time=float(step), priority=0))  # a stream of urgent work
        out = run_step(s)
        if any(x.seq is low for x in out.scheduled):
            served_at = step
            break
    # without aging `low` would wait forever; with one level per 3 steps it needs ~10 levels
    assert served_at is not None and served_at <= 3 * 10 + 3


def test_priority_policy_serves_lower_values_first():
    s = sched(max_num_seqs=1, policy="priority", aging_steps=0)
    later_urgent = seq(range(4), max_tokens=1, arrival_time=5.0, priority=-1)
    early_normal = seq(range(10, 14), max_tokens=1, arrival_time=0.0, priority=0)
    s.add(early_normal), s.add(later_urgent)
    assert run_step(s).scheduled[0].seq is later_urgent


# ---- end to end on the tiny model -------------------------------------------------------------

MIXED = [[5, 17, 99, 3, 42, 8, 61] * 3, [120, 7], list(range(30, 90)), [9] * 33, [1, 2, 3, 4, 5], list(range(200, 240))]


def _greedy(engine, prompts=MIXED, max_tokens=12, **kw):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))
    return [[o.token_ids for o in r.outputs] for r in outs]


def _no_leaks(engine):
    st = engine.allocator.stats()
    assert st.num_free_blocks == st.num_blocks
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def baseline(tiny_dirs):
    return _greedy(engine_for(tiny_dirs["llama"], scheduler="static", max_model_len=128))


def test_continuous_paged_equals_static_contiguous(tiny_dirs, baseline):
    e = engine_for(tiny_dirs["llama"], max_model_len=128, max_num_batched_tokens=32,
                   cache=PagedCacheConfig(name="paged", block_size=8, memory_gb=0.01))
    assert _greedy(e) == baseline
    _no_leaks(e)


def test_a_pool_too_small_still_finishes_everything_identically(tiny_dirs, baseline):
    e = engine_for(tiny_dirs["llama"], max_model_len=128, max_num_batched_tokens=64,
                   cache=PagedCacheConfig(name="paged", block_size=4, memory_gb=24 * 4 * e_bytes(tiny_dirs) / 1e9))
    assert e.allocator.num_blocks == 24
    log = []
    orig = e.scheduler.schedule

    def counting():
        out = orig()
        log.extend(out.preempted)
        return out

    e.scheduler.schedule = counting
    assert _greedy(e) == baseline
    assert log  # it had to preempt
    _no_leaks(e)


def e_bytes(tiny_dirs):
    # bytes per token of the tiny model in fp32: 2 x 2 layers x 2 kv heads x 16 head_dim x 4
    return 2 * 2 * 2 * 16 * 4


def test_start_up_prints_the_pool_arithmetic(tiny_dirs, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="servelab"):
        engine_for(tiny_dirs["llama"], max_model_len=128,
                   cache=PagedCacheConfig(name="paged", block_size=4, memory_gb=100 * 4 * e_bytes(tiny_dirs) / 1e9))
    text = caplog.text
    assert "512 B/token" in text and "100 blocks x 4 tokens = 400 tokens" in text
    assert "3 requests of max_model_len=128 fit" in text


def test_request_larger_than_the_pool_is_rejected(tiny_dirs):
    e = engine_for(tiny_dirs["llama"], max_model_len=128,
                   cache=PagedCacheConfig(name="paged", block_size=4, memory_gb=8 * 4 * e_bytes(tiny_dirs) / 1e9))
    with pytest.raises(RequestError, match="can never fit the KV cache"):
        e.add_request(list(range(20)), SamplingParams(max_tokens=20))
    assert not e.has_unfinished()
    _no_leaks(e)


def test_prefix_caching_skips_cached_blocks_with_the_same_output(tiny_dirs):
    system = list(range(40, 104))  # 64 tokens = 8 blocks of 8
    q1, q2 = system + [3, 4, 5], system + [7, 8]
    results = {}
    for enabled in (True, False):
        e = engine_for(tiny_dirs["llama"], max_model_len=128, cache=PagedCacheConfig(
            name="paged", block_size=8, memory_gb=0.01, enable_prefix_caching=enabled))
        first = _greedy(e, [q1])
        rid = e.add_request(q2, SamplingParams(max_tokens=12, ignore_eos=True))
        seq = e.requests[rid].seqs[0]
        while e.has_unfinished():
            e.step()
        results[enabled] = (first, seq.output_token_ids, seq.num_cached_tokens, e.allocator.stats())
        _no_leaks(e)
    on, off = results[True], results[False]
    assert on[0] == off[0] and on[1] == off[1]
    assert on[2] == 64 and off[2] == 0
    assert on[3].prefix_hits == 64 and off[3].prefix_hits == 0


def test_n_samples_share_the_prompt_prefill(tiny_dirs):
    e = engine_for(tiny_dirs["llama"], max_model_len=128, cache=PagedCacheConfig(
        name="paged", block_size=8, memory_gb=0.01, enable_prefix_caching=False))
    prompt = list(range(50, 70))
    single = _greedy(e, [prompt])[0][0]
    prefill_tokens = []
    e.registry.pm.register(rec := _StepRecorder(prefill_tokens))
    try:
        greedy_n = _greedy(e, [prompt], n=3)[0]
    finally:
        e.registry.pm.unregister(rec)
    assert greedy_n == [single] * 3
    assert sum(prefill_tokens) == len(prompt)  # one prefill for three samples
    sampled = e.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=5, ignore_eos=True))[0]
    again = e.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=5, ignore_eos=True))[0]
    assert [o.token_ids for o in sampled.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    _no_leaks(e)


class _StepRecorder:
    def __init__(self, sink):
        self.sink = sink

    from core.engine.registry import hookimpl

    @hookimpl
    def servelab_step_finished(self, step_stats):
        self.sink.append(step_stats.num_prefill_tokens)


def test_abort_mid_prefill_returns_blocks(tiny_dirs):
    e = engine_for(tiny_dirs["llama"], max_model_len=128, max_num_batched_tokens=8,
                   cache=PagedCacheConfig(name="paged", block_size=4, memory_gb=0.01))
    rid = e.add_request(list(range(60)), SamplingParams(max_tokens=4))
    e.step()
    assert e.allocator.stats().num_free_blocks < e.allocator.num_blocks
    e.abort(rid)
    _no_leaks(e)
