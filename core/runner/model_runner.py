"""The model runner: block ids and token ids in, one step's model inputs out, on the model's device.

Allocators hand out block tables; the runner turns them, with the scheduled token counts, into
the packed input ids, positions, slot mapping and attention metadata in a single pass, copies
them to the device in one non-blocking transfer from pinned memory, and lets the attention backend derive what its kernels reuse in every
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

    def _upload(self, fields: list[list[int]]) -> list[torch.Tensor]:
        """Every int64 field in one host buffer (pinned on CUDA) and one non-blocking copy; views out."""
        sizes = [len(f) for f in fields]
        host = torch.tensor([v for f in fields for v in f], dtype=torch.int64)
        if self.device.type != "cpu":
            host = host.pin_memory().to(self.device, non_blocking=True)
        return list(torch.split(host, sizes))

    def prepare(self, scheduled: list[ScheduledSeq], block_tables: list[list[int]], block_size: int) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens, ctxs, starts, logits_indices, sample_rows = [], [], [0], [], []
        for i, (s, table) in enumerate(zip(scheduled, block_tables)):
            start = s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            drafts = s.num_draft_tokens
            ids.extend(s.seq.token_slice(start, end - drafts))
            if drafts:  # a speculative verify: the drafts follow the last known token
                ids.extend(s.seq.spec_token_ids[:drafts])
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            qlens.append(s.num_new_tokens)
            ctxs.append(end)
            starts.append(starts[-1] + s.num_new_tokens)
            if s.needs_sample:  # logits after the last known token, and after each draft
                logits_indices.extend(range(len(ids) - 1 - drafts, len(ids)))
                sample_rows.append(i)
        width = max((len(t) for t in block_tables), default=1) or 1
        flat_tables = [b for t in block_tables for b in t + [0] * (width - len(t))]
        ids_t, pos_t, slots_t, ctx_t, qlen_t, starts_t, logits_t, tables_t = self._upload(
            [ids, positions, slots, ctxs, qlens, starts, logits_indices, flat_tables])
        meta = AttentionMetadata(
            slot_mapping=slots_t, block_tables=tables_t.view(len(block_tables), width), context_lens=ctx_t,
            query_lens=qlen_t, query_start_loc=starts_t, block_size=block_size, max_query_len=max(qlens, default=0),
            max_context_len=max(ctxs, default=0), query_lens_cpu=qlens, context_lens_cpu=ctxs,
            query_start_loc_cpu=starts, block_tables_cpu=block_tables,
        )
        meta.plan = self.attention.plan(meta)
        return ModelInput(ids_t, pos_t, meta, logits_t, sample_rows)
