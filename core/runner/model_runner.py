"""The model runner: block ids and token ids in, one step's model inputs out, on the model's device.

Allocators hand out block tables; the runner turns them, with the scheduled token counts, into
the packed input ids, positions, slot mapping and attention metadata in a single pass, copies
them to the device once, and lets the attention backend derive what its kernels reuse in every
layer (`AttentionBackend.plan`). A new attention backend therefore touches no allocator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from core.runner.metadata import AttentionMetadata, ModelInput

if TYPE_CHECKING:
    from core.engine.interfaces import AttentionBackend
    from core.engine.types import ScheduledSeq


class ModelRunner:
    def __init__(self, device: torch.device, attention: AttentionBackend) -> None:
        self.device = torch.device(device)
        self.attention = attention
        self._pin = self.device.type == "cuda"

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cpu":
            return t
        return (t.pin_memory() if self._pin else t).to(self.device, non_blocking=True)

    def prepare(self, scheduled: list[ScheduledSeq], block_tables: list[list[int]], block_size: int) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens, ctxs, starts, logits_indices, sample_rows = [], [], [0], [], []
        for i, (s, table) in enumerate(zip(scheduled, block_tables)):
            start = s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(s.seq.token_slice(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            qlens.append(s.num_new_tokens)
            ctxs.append(end)
            starts.append(starts[-1] + s.num_new_tokens)
            if s.needs_sample:
                logits_indices.append(len(ids) - 1)
                sample_rows.append(i)
        width = max((len(t) for t in block_tables), default=1) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64), block_tables=self._tensor(padded, torch.int32),
            context_lens=self._tensor(ctxs, torch.int64), query_lens=self._tensor(qlens, torch.int64),
            query_start_loc=self._tensor(starts, torch.int64), block_size=block_size,
            max_query_len=max(qlens, default=0), max_context_len=max(ctxs, default=0),
            query_lens_cpu=qlens, context_lens_cpu=ctxs, query_start_loc_cpu=starts, block_tables_cpu=block_tables,
        )
        meta.plan = self.attention.plan(meta)
        return ModelInput(self._tensor(ids, torch.int64), self._tensor(positions, torch.int64), meta,
                          self._tensor(logits_indices, torch.int64), sample_rows)
