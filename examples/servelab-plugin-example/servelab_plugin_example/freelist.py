"""Cache allocator `freelist`: PagedAttention's bookkeeping at its simplest, nothing shared (no
prefix caching; no fork, so n > 1 samples each prefill). It hands out block ids; the runner does the rest."""

from dataclasses import dataclass

from core.api import CacheConfig, CacheStats, KVCacheSpec, Sequence


@dataclass
class FreeListConfig(CacheConfig):
    block_size: int = 16
    memory_gb: float | None = 0.25


class FreeListAllocator:
    config_class = FreeListConfig
    capabilities = frozenset()  # none of fork, copy_on_write, truncate, describe

    def __init__(self, config: FreeListConfig, spec: KVCacheSpec, max_num_seqs: int) -> None:
        self.spec, self.block_size = spec, config.block_size
        self.num_blocks = int(config.memory_gb * 1e9 // (spec.bytes_per_token * self.block_size))
        self.free_ids = list(range(self.num_blocks))
        self.tables: dict[int, list[int]] = {}

    def can_admit(self, seq: Sequence) -> bool:
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens, self.spec.max_model_len)
        return -(-longest // self.block_size) <= self.num_blocks

    def match_prefix(self, seq: Sequence) -> int:
        return 0

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        table = self.tables.get(seq.seq_id, [])
        end = seq.num_computed_tokens + num_new_tokens
        need = max(0, -(-end // self.block_size) - len(table))
        if end > self.spec.max_model_len or need > len(self.free_ids):
            return False  # nothing changed
        self.tables[seq.seq_id] = table + [self.free_ids.pop() for _ in range(need)]
        return True

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    def free(self, seq: Sequence) -> None:
        self.free_ids += self.tables.pop(seq.seq_id, [])

    def stats(self) -> CacheStats:
        return CacheStats(self.num_blocks, len(self.free_ids), self.block_size)
