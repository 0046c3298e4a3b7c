"""KV-cache geometry helpers shared by every allocator: block tables to attention metadata."""

from __future__ import annotations

import torch

from core.types import AttentionMetadata, ScheduledSeq


def build_attention_metadata(
    scheduled: list[ScheduledSeq], block_tables: list[list[int]], block_size: int
) -> AttentionMetadata:
    """Slot mapping, padded block tables and lengths for a packed batch.

    `block_tables[i]` lists the blocks of `scheduled[i].seq` in order; the new tokens are
    positions num_computed_tokens .. num_computed_tokens + num_new_tokens - 1.
    """
    slots: list[int] = []
    query_lens, context_lens = [], []
    for s, table in zip(scheduled, block_tables):
        start = s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        for pos in range(start, end):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_lens.append(s.num_new_tokens)
        context_lens.append(end)
    width = max((len(t) for t in block_tables), default=1) or 1
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    qlens = torch.tensor(query_lens, dtype=torch.int64)
    starts = torch.zeros(len(scheduled) + 1, dtype=torch.int64)
    torch.cumsum(qlens, 0, out=starts[1:])
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int64),
        query_lens=qlens,
        query_start_loc=starts,
        block_size=block_size,
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
    )
