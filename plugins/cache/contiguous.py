"""Cache allocator `contiguous`: every sequence reserves max_model_len tokens up front.

The pre-PagedAttention baseline: a slot per sequence, wasted memory for every token a request
never reaches. Seen through the block-table lens it is one block of max_model_len tokens.
"""

from __future__ import annotations

from core.api import CacheConfig, CacheStats, ConfigError, KVCacheSpec, Sequence, hookimpl


class ContiguousAllocator:
    capabilities = frozenset({"truncate", "describe"})

    def __init__(self, config: CacheConfig, spec: KVCacheSpec, max_num_seqs: int) -> None:
        self.spec = spec
        self.block_size = spec.max_model_len
        bytes_per_slot = spec.bytes_per_token * spec.max_model_len
        if config.memory_gb is not None:
            self.num_blocks = int(config.memory_gb * 1e9 // bytes_per_slot)
            if self.num_blocks < 1:
                raise ConfigError(
                    f"cache.memory_gb={config.memory_gb} holds no sequence of max_model_len={spec.max_model_len} "
                    f"({bytes_per_slot / 1e9:.3f} GB each)"
                )
        else:  # one slot for every sequence the scheduler may run at once
            self.num_blocks = max_num_seqs
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._slot: dict[int, int] = {}

    def can_admit(self, seq: Sequence) -> bool:
        return seq.num_prompt_tokens < self.spec.max_model_len

    def match_prefix(self, seq: Sequence) -> int:
        return 0  # no prefix caching: every sequence owns its slot

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if seq.num_computed_tokens + num_new_tokens > self.block_size:
            return False
        if seq.seq_id not in self._slot:
            if not self._free:
                return False
            self._slot[seq.seq_id] = self._free.pop()
        return True

    def block_table(self, seq: Sequence) -> list[int]:
        return [self._slot[seq.seq_id]]

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        pass  # the slot keeps its full length; tokens past num_tokens are simply overwritten later

    def free(self, seq: Sequence) -> None:
        slot = self._slot.pop(seq.seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def stats(self) -> CacheStats:
        return CacheStats(num_blocks=self.num_blocks, num_free_blocks=len(self._free), block_size=self.block_size)

    def describe(self) -> str:
        per_seq = self.spec.bytes_per_token * self.block_size
        return (
            f"contiguous KV: {self.spec.bytes_per_token} B/token x {self.block_size} tokens reserved per sequence "
            f"= {per_seq / 1e6:.1f} MB; {self.num_blocks} sequences, {self.num_blocks * per_seq / 1e9:.2f} GB"
        )


@hookimpl
def servelab_cache_allocators():
    return {"contiguous": ContiguousAllocator}
