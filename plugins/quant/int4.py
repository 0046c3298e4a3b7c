"""Quantizer `int4`: weight-only, asymmetric, group-wise (32/64/128), with optional
activation-aware scaling (AWQ-style).

AWQ-style: the weights that meet large activations matter most. For each linear layer, per
input channel scales s = mean|x|^alpha (x from a small calibration set of real prompts) are
searched over alpha in [0, 1]; the layer stores W * s quantized and divides its input by s.
alpha = 0 is plain round-to-nearest, so the search can only match or beat it on the
calibration data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from core.api import (
    ConfigError,
    QuantConfig,
    calibration_prompts,
    capture_linear_inputs,
    hookimpl,
    quantize_tied_embedding,
    swap_linears,
)
from servelab_kernels.quant import Int4Linear, dequantize_int4, quantize_int4

GROUP_SIZES = (32, 64, 128)


@dataclass
class Int4QuantConfig(QuantConfig):
    group_size: int = 64  # 32 | 64 | 128
    awq: bool = False  # activation-aware per-input-channel scales from calibration prompts
    calibration_prompts: int = 16
    calibration_len: int = 256
    keep: list = field(default_factory=list)
    fast: bool = True


def awq_scale(w: torch.Tensor, x: torch.Tensor, group_size: int, grid: int = 11) -> tuple[torch.Tensor, float, float]:
    """Best per-input-channel scale for quantizing w [N, K] given inputs x [rows, K].
    Returns (scale [K], error with it, error of plain round-to-nearest)."""
    w, x = w.float(), x.float()
    k = w.shape[1]
    kp = Int4Linear.padded_features(k, group_size)
    ref = x @ w.T
    act = x.abs().mean(dim=0).clamp(min=1e-6)
    best, best_err, rtn_err = torch.ones(k), float("inf"), float("inf")
    for i in range(grid):
        alpha = i / (grid - 1)
        s = act.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # keep the scales centred around 1
        ws = torch.nn.functional.pad(w * s[None, :], (0, kp - k))
        q, sc, z = quantize_int4(ws, group_size)
        wq = dequantize_int4(q, sc, z, group_size)[:, :k] / s[None, :]
        err = (x @ wq.T - ref).pow(2).mean().item()
        if i == 0:
            rtn_err = err
        if err < best_err:
            best, best_err = s, err
    return best, best_err, rtn_err


class Int4Quantizer:
    config_class = Int4QuantConfig

    def __init__(self, config: Int4QuantConfig, tokenizer=None, **context) -> None:
        if config.group_size not in GROUP_SIZES:
            raise ConfigError(f"quant.group_size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                              f"got {config.group_size}")
        self.config, self.group_size, self.awq = config, config.group_size, config.awq
        self.keep, self.fast = list(config.keep), config.fast
        self.tokenizer = tokenizer
        self.report: dict[str, dict] = {}  # per layer: AWQ error vs round-to-nearest

    def _calibration(self) -> list[list[int]]:
        if self.tokenizer is None:
            raise ConfigError("quant=int4 with awq needs the model's tokenizer for calibration prompts")
        return calibration_prompts(self.tokenizer, self.config.calibration_prompts, self.config.calibration_len)

    def quantize(self, model: nn.Module) -> nn.Module:
        acts = capture_linear_inputs(model, self._calibration()) if self.awq else {}

        def make(name: str, lin: nn.Linear) -> nn.Module:
            scale = None
            if self.awq:
                scale, err, rtn = awq_scale(lin.weight.data, acts[name], self.group_size)
                self.report[name] = {"awq_mse": err, "rtn_mse": rtn}
            bias = None if lin.bias is None else lin.bias.data
            return Int4Linear.from_weight(lin.weight.data, bias, self.group_size, scale, self.fast)

        swapped = swap_linears(model, make, self.keep)
        quantize_tied_embedding(model, swapped, bits=4, group_size=self.group_size)
        return model


@hookimpl
def servelab_quantizers():
    return {"int4": Int4Quantizer}
