"""Cache allocator `paged`: PagedAttention's block manager with prefix caching.

The KV pool is `num_blocks` blocks of `block_size` tokens. A sequence holds a block table, the
blocks its tokens live in, in order, allocated on demand. Blocks carry reference counts, so the
n samples of one prompt share its blocks (`fork`); the partly filled last block is copied on
write when a sample first writes into it. A full block is keyed by a hash chained over the
previous block's hash and its own token ids; a new request whose prompt starts with the same
blocks reuses them (prefix caching). Freed blocks that still hold a cached prefix stay findable
and are evicted least-recently-used only when no plain free block is left.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

from core.api import BLOCK_SIZE, CacheConfig, CacheStats, ConfigError, KVCacheSpec, Sequence, hookimpl, kv_memory_budget

log = logging.getLogger("servelab")


@dataclass
class PagedCacheConfig(CacheConfig):
    block_size: int | None = None  # None: the device's (BLOCK_SIZE: 64 on the CPU, 16 on a GPU)
    memory_utilization: float | None = None  # vLLM's gpu_memory_utilization; None: 0.2 (CPU), 0.9 (GPU)
    enable_prefix_caching: bool = True


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its tokens are known
    token_ids: tuple[int, ...] = ()  # the full block's tokens, to verify a hash match


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class PagedAllocator:
    config_class = PagedCacheConfig
    capabilities = frozenset({"fork", "copy_on_write", "truncate", "describe"})

    def __init__(self, config: PagedCacheConfig, spec: KVCacheSpec, max_num_seqs: int, device="cpu",
                 reserved_bytes: int = 0) -> None:
        self.spec = spec
        # (an engine's config has it filled in; an allocator built in code takes the device's here)
        self.block_size = config.block_size
        if self.block_size is None:
            self.block_size = BLOCK_SIZE["cuda" if str(device).startswith("cuda") else "cpu"]
        if self.block_size <= 0:
            raise ConfigError(f"cache.block_size must be positive, got {self.block_size}")
        self.enable_prefix_caching = config.enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        bytes_per_block = spec.bytes_per_token * self.block_size
        if config.memory_gb is not None:
            budget, source = config.memory_gb * 1e9, f"cache.memory_gb={config.memory_gb}"
        else:
            frac = config.memory_utilization
            if frac is None:
                frac = 0.9 if str(device).startswith("cuda") else 0.2
            if not 0 < frac <= 0.95:
                raise ConfigError(f"cache.memory_utilization must be in (0, 0.95], got {frac}")
            budget, source = kv_memory_budget(frac, device, reserved_bytes)
        self.num_blocks = int(budget // bytes_per_block)
        if self.num_blocks < 1:
            raise ConfigError(f"{source} holds no KV block of {self.block_size} tokens ({bytes_per_block} bytes)")
        if self.num_blocks < max_num_seqs:  # every running sequence holds at least one block
            log.warning("the KV pool (%d blocks) cannot hold scheduler.max_num_seqs=%d sequences at once; expect "
                        "preemptions", self.num_blocks, max_num_seqs)
        self.budget_source = source
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free: deque[int] = deque(range(self.num_blocks))  # hold nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but hold a cached prefix, LRU first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.tables: dict[int, list[int]] = {}  # seq id -> block ids
        self._hashes: dict[int, list[int]] = {}  # seq id -> hashes of its full blocks, in order
        self._copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write work for the next forward
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_admit(self, seq: Sequence) -> bool:
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens, self.spec.max_model_len)
        return self._blocks_for(longest) <= self.num_blocks

    def describe(self) -> str:
        sp = self.spec
        item = sp.dtype.itemsize
        per_head = f"({sp.head_dim} x 1 B + 2 B scale)" if item == 1 else f"{sp.head_dim} x {item} B"
        tokens = self.num_blocks * self.block_size
        return (f"paged KV: {sp.bytes_per_token} B/token (2 x {sp.num_layers} layers x {sp.num_kv_heads} kv heads x "
                f"{per_head}); {self.num_blocks} blocks x {self.block_size} tokens = {tokens} tokens, "
                f"{tokens * sp.bytes_per_token / 1e9:.2f} GB ({self.budget_source}); "
                f"{tokens // sp.max_model_len} requests of max_model_len={sp.max_model_len} fit at once")

    # ---- block pool -----------------------------------------------------------------------

    def _take_block(self) -> int:
        if self._free:
            bid = self._free.popleft()
        else:  # evict the least recently used cached prefix block
            bid, _ = self._evictable.popitem(last=False)
            blk = self.blocks[bid]
            if self._cached.get(blk.hash) == bid:
                del self._cached[blk.hash]
            blk.hash, blk.token_ids = None, ()
        self.blocks[bid].ref_count = 1
        return bid

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} freed twice"
        if blk.ref_count == 0:
            if blk.hash is not None and self._cached.get(blk.hash) == bid:
                self._evictable[bid] = None  # most recently used at the end
            else:
                blk.hash, blk.token_ids = None, ()
                self._free.append(bid)

    def _acquire_cached(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            self._evictable.pop(bid, None)
        blk.ref_count += 1

    # ---- prefix caching -------------------------------------------------------------------

    def _prompt_block_hashes(self, seq: Sequence, max_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        out, parent = [], None
        ids = seq.token_ids
        for i in range(max_blocks):
            toks = tuple(ids[i * self.block_size : (i + 1) * self.block_size])
            parent = chain_hash(parent, toks)
            out.append((parent, toks))
        return out

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks that start this sequence. At least one token is always left to compute,
        so the last step has logits to sample from."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h, toks in self._prompt_block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            bid = self._cached.get(h)
            if bid is None or self.blocks[bid].token_ids != toks:
                break
            hits.append(bid)
        return hits

    def match_prefix(self, seq: Sequence) -> int:
        """How many leading tokens of a fresh sequence are already in the cache (no side effects)."""
        if seq.seq_id in self.tables:
            return seq.num_computed_tokens
        return len(self._lookup(seq)) * self.block_size

    def _register_full_blocks(self, seq: Sequence, upto_tokens: int) -> None:
        """Give every block that is full once `upto_tokens` are computed its chained hash."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.tables[seq.seq_id], self._hashes.setdefault(seq.seq_id, [])
        while len(hashes) < upto_tokens // self.block_size:  # (most steps fill no block: nothing to slice)
            i = len(hashes)
            toks = tuple(seq.token_slice(i * self.block_size, (i + 1) * self.block_size))
            h = chain_hash(hashes[-1] if hashes else None, toks)
            hashes.append(h)
            blk = self.blocks[table[i]]
            if blk.hash is None and h not in self._cached:
                blk.hash, blk.token_ids = h, toks
                self._cached[h] = blk.block_id

    # ---- the contract ---------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for tokens [num_computed, num_computed + num_new_tokens). A fresh sequence whose
        num_computed_tokens was set from `match_prefix` takes those cached blocks first."""
        table = self.tables.get(seq.seq_id)
        fresh = table is None
        hits: list[int] = []
        if fresh:
            if seq.num_computed_tokens:
                hits = self._lookup(seq)[: seq.num_computed_tokens // self.block_size]
                if len(hits) * self.block_size != seq.num_computed_tokens:
                    return False  # the cache changed since match_prefix: let the scheduler retry
            table = []
        end = seq.num_computed_tokens + num_new_tokens
        if end > self.spec.max_model_len:
            return False
        need = self._blocks_for(end) - (len(table) + len(hits))
        write_block = seq.num_computed_tokens // self.block_size
        cow = (not fresh and write_block < len(table) and self.blocks[table[write_block]].ref_count > 1
               and num_new_tokens > 0)
        # cached blocks with ref 0 are counted free, but taking them must not also evict them
        reusable_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if max(need, 0) + cow > self.num_free_blocks - reusable_free:
            return False
        if fresh:
            for b in hits:
                self._acquire_cached(b)
            table = list(hits)
            self.tables[seq.seq_id] = table
            self._hashes[seq.seq_id] = [self.blocks[b].hash for b in hits]
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_computed_tokens
        if cow:  # a shared, partly filled block: this sequence gets its own copy
            src = table[write_block]
            dst = self._take_block()
            self._copies.append((src, dst))
            self._release(src)
            table[write_block] = dst
        for _ in range(max(need, 0)):
            table.append(self._take_block())
        self._register_full_blocks(seq, min(end, seq.num_tokens))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (n > 1 samples of one prompt)."""
        table = list(self.tables[parent.seq_id])
        for b in table:
            self.blocks[b].ref_count += 1
        self.tables[child.seq_id] = table
        self._hashes[child.seq_id] = list(self._hashes.get(parent.seq_id, []))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` tokens only (rejected speculative tokens)."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return
        keep = self._blocks_for(num_tokens)
        for b in table[keep:]:
            self._release(b)
        del table[keep:]
        hashes = self._hashes.get(seq.seq_id, [])
        del hashes[num_tokens // self.block_size :]
        if num_tokens % self.block_size and keep:
            last = self.blocks[table[keep - 1]]
            if last.ref_count == 1 and last.hash is not None:  # about to be overwritten: no longer a cached prefix
                if self._cached.get(last.hash) == last.block_id:
                    del self._cached[last.hash]
                last.hash, last.token_ids = None, ()

    def free(self, seq: Sequence) -> None:
        table = self.tables.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        if table:
            # tail blocks first, so that an eviction takes a prefix's end before its shared start
            for b in reversed(table):
                self._release(b)

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def stats(self) -> CacheStats:
        return CacheStats(self.num_blocks, self.num_free_blocks, self.block_size, self.prefix_queries, self.prefix_hits)


@hookimpl
def servelab_cache_allocators():
    return {"paged": PagedAllocator}
