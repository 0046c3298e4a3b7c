"""Quantizer `none`: weights stay in the model dtype (fp32 or bf16)."""

from __future__ import annotations

from torch import nn

from core.api import QuantConfig, hookimpl


class NoQuantizer:
    def __init__(self, config: QuantConfig, **context) -> None:
        self.config = config

    def quantize(self, model: nn.Module) -> nn.Module:
        return model


@hookimpl
def servelab_quantizers():
    return {"none": NoQuantizer}
