"""Quantizer `int8`: weight-only, symmetric, one scale per output channel, for every linear layer
not kept in higher precision (`quant.keep`, globs such as lm_head or model.layers.0.*: mixed
precision, as the seed advises). A tied embedding follows its lm_head into INT8 rows."""

from __future__ import annotations

from torch import nn

from core.config import QuantConfig
from core.plugins import hookimpl
from core.quantize import quantize_tied_embedding, swap_linears
from kernels.quant import Int8Linear


class Int8Quantizer:
    def __init__(self, config: QuantConfig, **context) -> None:
        self.keep = list(config.extra.get("keep", []))
        self.fast = bool(config.extra.get("fast", True))
        self.swapped: list[str] = []

    def quantize(self, model: nn.Module) -> nn.Module:
        self.swapped = swap_linears(model, lambda name, lin: Int8Linear.from_linear(lin, self.fast), self.keep)
        quantize_tied_embedding(model, self.swapped, bits=8)
        return model


@hookimpl
def servelab_quantizers():
    return {"int8": Int8Quantizer}
