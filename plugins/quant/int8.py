"""Quantizer `int8`: symmetric, one scale per output channel, for every linear layer not kept in
higher precision (`quant.keep`, globs such as lm_head or model.layers.0.*: mixed precision, as the
seed advises). A tied embedding follows its lm_head into INT8 rows.

Weight-only by default (W8A16: the CPU kernels carry the activations as 14-bit integers, about
bf16's precision). `quant.w8a8=true` quantizes the activations too, to INT8 with one scale a token
computed at run time (dynamic per-token W8A8, as vLLM's INT8 W8A8): one INT8 GEMM per call where
the exact path runs two, faster for steps of many rows, at a measured cost in accuracy
(reports/quant-eval-w8a8). `quant.smooth=true` (with w8a8) first moves activation outliers into
the weights, SmoothQuant's way, folded into the norms and the value / up projections so that the
served model runs no extra op (core/model/smooth.py; alpha searched per group on calibration
prompts). Its fast path is the CPU kernels' (AVX512-VNNI for the GEMM); on CUDA the
torch twin computes it.

On the CPU each layer also keeps its weight laid out once for the build's integer GEMM (AVX512-VNNI's
vpdpbusd, or AVX2's vpmaddwd on CPUs without AVX-512, where models run fp32): `quant.pack=false` runs
without that copy (half the INT8 weights' memory; the GEMV and the build's other GEMMs), for A/B runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch

from torch import nn

from core.api import (
    ConfigError,
    QuantConfig,
    calibration_prompts,
    hookimpl,
    quantize_tied_embedding,
    smooth_model,
    swap_linears,
)
from servelab_kernels import int8_pack
from servelab_kernels.quant import Int8Linear


@dataclass
class Int8QuantConfig(QuantConfig):
    keep: list = field(default_factory=list)  # globs of layers kept in the model dtype (mixed precision)
    fast: bool = True  # false: the dequantize-and-matmul reference path
    pack: bool = True  # false: no packed weight copy for the CPU's integer GEMM (VNNI / AVX2 vpmaddwd): A/B runs
    w8a8: bool = False  # INT8 activations too, one scale a token (dynamic): faster at many rows, less exact
    smooth: bool = False  # with w8a8: SmoothQuant-style scales, alpha searched per group on calibration prompts
    calibration_prompts: int = 16
    calibration_len: int = 256


class Int8Quantizer:
    config_class = Int8QuantConfig

    def __init__(self, config: Int8QuantConfig, tokenizer=None, **context) -> None:
        if config.smooth and not config.w8a8:
            raise ConfigError("quant.smooth=true smooths INT8 activations: it needs quant.w8a8=true")
        if config.smooth and tokenizer is None:
            raise ConfigError("quant.smooth=true needs the model's tokenizer for calibration prompts")
        self.config, self.tokenizer = config, tokenizer
        self.keep, self.fast, self.a8 = list(config.keep), config.fast, config.w8a8
        self.swapped: list[str] = []
        self.report: dict[str, dict] = {}  # per smoothing group: alpha and calibration errors

    def quantize(self, model: nn.Module) -> nn.Module:
        if self.config.smooth:
            kept = {n for n, m in model.named_modules()
                    if isinstance(m, nn.Linear) and any(fnmatch(n, p) for p in self.keep)}
            prompts = calibration_prompts(self.tokenizer, self.config.calibration_prompts, self.config.calibration_len)
            self.report = smooth_model(model, prompts, skip=kept)
        with int8_pack.packing(self.config.pack and int8_pack.packing_on()):  # (an A/B run's packing(False) holds)
            self.swapped = swap_linears(model, lambda name, lin: Int8Linear.from_linear(lin, self.fast, self.a8),
                                        self.keep)
        quantize_tied_embedding(model, self.swapped, bits=8)
        return model


@hookimpl
def servelab_quantizers():
    return {"int8": Int8Quantizer}
