"""The contracts of the hooked components. In-repo plugins and third-party ones implement these."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from core.types import (
    AttentionMetadata,
    CacheStats,
    KVCacheSpec,
    ModelInput,
    ScheduledSeq,
    SchedulerOutput,
    Sequence,
)


@runtime_checkable
class CacheAllocator(Protocol):
    """Owns the KV pool's bookkeeping: which blocks belong to which sequence."""

    spec: KVCacheSpec
    num_blocks: int
    block_size: int

    def can_admit(self, seq: Sequence) -> bool:
        """Could this sequence ever fit if the pool were empty?"""

    def match_prefix(self, seq: Sequence) -> int:
        """Leading tokens of a fresh sequence already cached (a lookup: nothing is taken). The
        scheduler sets num_computed_tokens to it before `allocate`, and back to 0 if that fails."""

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Reserve room for tokens [num_computed, num_computed + num_new_tokens); False if there
        is none (the caller may preempt). Nothing changes when it fails."""

    def fork(self, parent: Sequence, child: Sequence) -> None: ...

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens' KV."""

    def free(self, seq: Sequence) -> None: ...

    def attention_metadata(self, scheduled: list[ScheduledSeq]) -> AttentionMetadata: ...

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies owed before the next forward (copy-on-write after fork)."""

    def stats(self) -> CacheStats: ...


@runtime_checkable
class Scheduler(Protocol):
    def add(self, seq: Sequence) -> None: ...

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch; reserves KV through the allocator."""

    def finish(self, seq: Sequence) -> None:
        """A sequence ended (stop, length or abort): drop it and free its KV."""

    def has_unfinished(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...


@runtime_checkable
class Decoder(Protocol):
    """Propose before the forward pass, accept after it."""

    def propose(self, scheduled: list[ScheduledSeq]) -> object | None: ...

    def accept(
        self, logits: torch.Tensor, scheduled: list[ScheduledSeq], proposals: object | None
    ) -> dict[int, list[int]]:
        """Map seq id -> accepted new tokens, for the sequences that sample this step."""


@runtime_checkable
class Backend(Protocol):
    def init_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer."""

    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32."""


@runtime_checkable
class Quantizer(Protocol):
    def quantize(self, model: nn.Module) -> nn.Module:
        """Transform the loaded weights once, before serving (module swaps)."""
