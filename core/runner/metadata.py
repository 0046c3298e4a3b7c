"""What the model runner hands the model each step: the packed batch and where its KV lives.

Built once per step, in one form: tensors on the model's device for the kernels, and the host
copies they were made from, so no layer ever converts a tensor back to a list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per layer the KV cache is laid out by the attention backend; a sequence's tokens live in
    the blocks its row of `block_tables` lists, in order (token p in block p // block_size)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int64: tokens in the cache after this step
    query_lens: torch.Tensor  # [num_seqs] int64: new tokens this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64: each sequence's rows in the packed batch
    block_size: int
    max_query_len: int
    max_context_len: int
    # host copies, made in the same pass as the tensors
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    block_tables_cpu: list[list[int]]
    plan: object | None = None  # the attention backend's own per-step tensors (see AttentionBackend.plan)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] packed
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] rows of the packed batch whose logits are needed
    sample_rows: list[int]  # which scheduled entries sample, in order (1 + drafts logits rows each)
