"""Quantizer `gguf`: serve a GGUF file's own 4-bit blocks, without a float round trip.

Q4_0 and Q4_1 blocks (32 weights, a scale d and for Q4_1 a minimum m) are exactly the INT4
group-wise format of the packed CPU kernel with group size 32:
    Q4_1: w = d * q + m   = (q - 8) * d + (m + 8 d)   -> scale d, zero m + 8 d
    Q4_0: w = d * (q - 8)                              -> scale d, zero 0
so their nibbles go straight into `Int4Linear`. Linear weights in other GGUF types are
quantized to INT8 per channel from their dequantized values (and reported as such).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from core.api import (
    PERMUTED_ARCHS,
    ConfigError,
    QuantConfig,
    gguf_to_hf_name,
    hookimpl,
    quantize_tied_embedding,
    swap_linears,
    unpermute_qk,
)
from servelab_kernels.quant import Int4Linear, Int8Linear

BLOCK = 32


@dataclass
class GGUFQuantConfig(QuantConfig):
    keep: list = field(default_factory=list)
    fast: bool = True


def q4_blocks(raw: np.ndarray, n: int, k: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0/Q4_1 rows [n, bytes] -> (q int32 [n, k] in 0..15, scales [k/32, n], zeros [k/32, n])."""
    per = 20 if kind == "Q4_1" else 18
    b = np.ascontiguousarray(raw).reshape(n, k // BLOCK, per)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:]
        zero = m + 8.0 * d
    else:
        qs = b[..., 2:]
        zero = np.zeros_like(d)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int32)  # low nibbles: 0..15, high: 16..31
    q = torch.from_numpy(q.reshape(n, k))
    return q, torch.from_numpy(d.T.copy()), torch.from_numpy(zero.T.copy())


class GGUFQuantizer:
    config_class = GGUFQuantConfig

    def __init__(self, config: GGUFQuantConfig, source: str | None = None, **context) -> None:
        if not source or not str(source).endswith(".gguf"):
            raise ConfigError("quant=gguf needs a GGUF model (the default model or model.path=FILE.gguf)")
        self.source = source
        self.keep, self.fast = list(config.keep), config.fast
        self.kinds: dict[str, str] = {}  # layer -> how it is served

    def quantize(self, model: nn.Module) -> nn.Module:
        from gguf import GGUFReader

        reader = GGUFReader(self.source)
        tensors = {gguf_to_hf_name(t.name): t for t in reader.tensors}
        args = model.args
        permuted = args.architecture in PERMUTED_ARCHS

        def make(name: str, lin: nn.Linear) -> nn.Module:
            t = tensors.get(f"{name}.weight")
            kind = t.tensor_type.name if t is not None else None
            bias = None if lin.bias is None else lin.bias.data
            if kind in ("Q4_0", "Q4_1") and lin.in_features % BLOCK == 0:
                n, k = lin.out_features, lin.in_features
                q, s, z = q4_blocks(t.data, n, k, kind)
                heads = args.num_heads if name.endswith("q_proj") else args.num_kv_heads
                if permuted and name.endswith(("q_proj", "k_proj")):  # rows in llama.cpp's order
                    rows = torch.from_numpy(unpermute_qk(np.arange(n)[:, None], heads)[:, 0].copy())
                    q, s, z = q[rows], s[:, rows], z[:, rows]
                self.kinds[name] = f"{kind} blocks as int4 (group 32)"
                return Int4Linear(q, s, z, BLOCK, k, bias, None, self.fast, device=lin.weight.device)
            self.kinds[name] = f"{kind or 'float'} requantized to int8 per channel"
            return Int8Linear.from_linear(lin, self.fast)

        swapped = swap_linears(model, make, self.keep)
        # a tied embedding (Q8_0 in the SmolLM2 file) serves its lookup from INT8 rows
        quantize_tied_embedding(model, swapped, bits=8)
        return model


@hookimpl
def servelab_quantizers():
    return {"gguf": GGUFQuantizer}
