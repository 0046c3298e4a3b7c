"""Property-based tests of the paged allocator: random allocate/append/fork/free/truncate sequences.

A fake KV pool records which token each slot holds, so the strongest invariant can be checked:
every live sequence reads back exactly its own tokens through its block table (prefix sharing and
copy-on-write included).
"""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from core.engine.types import KVCacheSpec, SamplingParams, ScheduledSeq, Sequence
from plugins.cache.paged import PagedAllocator, PagedCacheConfig
from tests.tiny import step_inputs

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, max_model_len=64)
BLOCK = 4


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_blocks, caching):
        cfg = PagedCacheConfig(name="paged", block_size=BLOCK, memory_gb=num_blocks * SPEC.bytes_per_token * BLOCK / 1e9,
                               enable_prefix_caching=caching)
        self.alloc = PagedAllocator(cfg, SPEC, max_num_seqs=64)
        self.content: dict[int, dict[int, int]] = {}  # block -> offset -> token
        self.live: list[Sequence] = []

    def _compute(self, seq: Sequence, n: int) -> None:
        """What the engine does after a successful allocate: copies, then the forward writes KV."""
        for src, dst in self.alloc.take_block_copies():
            self.content[dst] = dict(self.content.get(src, {}))
        meta = step_inputs(self.alloc, [ScheduledSeq(seq, n)]).attn
        for pos, slot in zip(range(seq.num_computed_tokens, seq.num_computed_tokens + n), meta.slot_mapping.tolist()):
            self.content.setdefault(slot // BLOCK, {})[slot % BLOCK] = seq.token_ids[pos]
        seq.num_computed_tokens += n

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20), chunk=st.integers(1, 20))
    def new_sequence(self, tokens, chunk):
        seq = Sequence("r", tokens, SamplingParams(max_tokens=8))
        seq.num_computed_tokens = self.alloc.match_prefix(seq)
        assert seq.num_computed_tokens < len(tokens) or seq.num_computed_tokens == 0
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if self.alloc.allocate(seq, n):
            self._compute(seq, n)
            self.live.append(seq)
        else:
            assert seq.seq_id not in self.alloc.tables

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        appended = seq.num_computed_tokens >= seq.num_tokens
        if appended:
            seq.output_token_ids.append(token)
            n = 1
        else:  # finish the prompt first (a chunk)
            n = seq.num_tokens - seq.num_computed_tokens
        if seq.num_computed_tokens + n > SPEC.max_model_len:
            if appended:
                seq.output_token_ids.pop()
            return
        free_before = self.alloc.stats().num_free_blocks
        if self.alloc.allocate(seq, n):
            self._compute(seq, n)
        else:
            assert self.alloc.stats().num_free_blocks == free_before
            if appended:
                seq.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence("r", parent.prompt_token_ids, SamplingParams(max_tokens=8))
        child.output_token_ids = list(parent.output_token_ids)
        self.alloc.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens  # what the scheduler's fork does
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.alloc.free(seq)
        self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep=st.integers(0, 30))
    def truncate(self, data, keep):
        seq = data.draw(st.sampled_from(self.live))
        keep = min(keep, seq.num_computed_tokens)
        if keep < seq.num_prompt_tokens:
            return  # speculative decoding only ever drops output tokens
        self.alloc.truncate(seq, keep)
        seq.num_computed_tokens = keep  # the caller's half of a truncation
        del seq.output_token_ids[keep - seq.num_prompt_tokens:]

    @invariant()
    def reference_counts_match_tables(self):
        if not hasattr(self, "alloc"):
            return
        counts = {}
        for table in self.alloc.tables.values():
            for b in table:
                counts[b] = counts.get(b, 0) + 1
        for blk in self.alloc.blocks:
            assert blk.ref_count == counts.get(blk.block_id, 0)
        free = set(self.alloc._free) | set(self.alloc._evictable)
        assert len(free) == len(self.alloc._free) + len(self.alloc._evictable)  # disjoint
        assert free == {b.block_id for b in self.alloc.blocks if b.ref_count == 0}
        assert self.alloc.stats().num_free_blocks + len(counts) == self.alloc.num_blocks

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        if not hasattr(self, "alloc"):
            return
        for seq in self.live:
            table = self.alloc.tables[seq.seq_id]
            assert len(table) * BLOCK >= seq.num_computed_tokens
            got = [self.content.get(table[p // BLOCK], {}).get(p % BLOCK) for p in range(seq.num_computed_tokens)]
            assert got == seq.token_ids[: seq.num_computed_tokens]

    @invariant()
    def cached_hashes_point_at_full_blocks(self):
        if not hasattr(self, "alloc"):
            return
        for h, b in self.alloc._cached.items():
            blk = self.alloc.blocks[b]
            assert blk.hash == h and len(blk.token_ids) == BLOCK
            assert [self.content.get(b, {}).get(i) for i in range(BLOCK)] == list(blk.token_ids)

    def teardown(self):
        if hasattr(self, "alloc"):
            for seq in list(self.live):
                self.alloc.free(seq)
            assert self.alloc.stats().num_free_blocks == self.alloc.num_blocks


TestAllocatorProperties = AllocatorMachine.TestCase
TestAllocatorProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
