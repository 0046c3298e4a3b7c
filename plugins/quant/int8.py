"""Quantizer `int8`: weight-only, symmetric, one scale per output channel, for every linear layer
not kept in higher precision (`quant.keep`, globs such as lm_head or model.layers.0.*: mixed
precision, as the seed advises). A tied embedding follows its lm_head into INT8 rows."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from core.api import QuantConfig, hookimpl, quantize_tied_embedding, swap_linears
from servelab_kernels.quant import Int8Linear


@dataclass
class Int8QuantConfig(QuantConfig):
    keep: list = field(default_factory=list)  # globs of layers kept in the model dtype (mixed precision)
    fast: bool = True  # false: the dequantize-and-matmul reference path


class Int8Quantizer:
    config_class = Int8QuantConfig

    def __init__(self, config: Int8QuantConfig, **context) -> None:
        self.keep, self.fast = list(config.keep), config.fast
        self.swapped: list[str] = []

    def quantize(self, model: nn.Module) -> nn.Module:
        self.swapped = swap_linears(model, lambda name, lin: Int8Linear.from_linear(lin, self.fast), self.keep)
        quantize_tied_embedding(model, self.swapped, bits=8)
        return model


@hookimpl
def servelab_quantizers():
    return {"int8": Int8Quantizer}
