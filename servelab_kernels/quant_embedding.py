"""Token embeddings stored quantized (the rows of a tied, quantized lm_head's matrix), dequantized
row by row on lookup."""

from __future__ import annotations

import torch
from torch import nn

from servelab_kernels.quant import Int8Linear, quantize_int4, quantize_int8


class QuantEmbedding(nn.Module):
    """Token embedding with quantized rows, for models whose embedding is tied to a quantized
    lm_head: INT8 rows (one scale per row) or INT4 rows (two nibbles a byte, group-wise scale and
    zero). Only the looked-up rows are dequantized."""

    def __init__(self, weight: torch.Tensor | None, bits: int, group_size: int = 64, out_dtype=torch.bfloat16,
                 shared: Int8Linear | None = None):
        super().__init__()
        self.bits, self.out_dtype = bits, out_dtype
        if shared is not None:  # the tied lm_head's own INT8 rows: one copy of the matrix serves both
            self.num_embeddings, self.embedding_dim = shared.out_features, shared.in_features
            self.q, self.scales = shared.weight_q, shared.scales
            return
        self.num_embeddings, self.embedding_dim = weight.shape
        if bits == 8:
            q, s = quantize_int8(weight)
            self.register_buffer("q", q)
            self.register_buffer("scales", s.to(torch.float16))
        elif bits == 4:
            self.group_size = group_size if self.embedding_dim % group_size == 0 else self.embedding_dim
            q, s, z = quantize_int4(weight, self.group_size)
            q = q.to(torch.uint8)
            self.register_buffer("q", q[:, 0::2] | (q[:, 1::2] << 4))  # two weights a byte
            self.register_buffer("scales", s.T.contiguous().to(torch.float16))  # [V, groups]
            self.register_buffer("zeros", z.T.contiguous().to(torch.float16))
        else:
            raise ValueError(f"bits must be 8 or 4, got {bits}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            rows = self.q[ids].float() * self.scales[ids].float()[..., None]
        else:
            packed = self.q[ids]
            q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).float()
            s = self.scales[ids].float().repeat_interleave(self.group_size, dim=-1)
            z = self.zeros[ids].float().repeat_interleave(self.group_size, dim=-1)
            rows = (q - 8.0) * s + z
        return rows.to(self.out_dtype)
