"""Quantizer `int4`: weight-only, asymmetric, group-wise (32/64/128), with optional
activation-aware scaling (AWQ-style).

AWQ-style: the weights that meet large activations matter most. For each linear layer, per
input channel scales s = mean|x|^alpha (x from a small calibration set of real prompts) are
searched over alpha in [0, 1]; the layer stores W * s quantized and divides its input by s.
alpha = 0 is plain round-to-nearest, so the search can only match or beat it on the
calibration data.
"""

from __future__ import annotations

import torch
from torch import nn

from core.config import QuantConfig
from core.errors import ConfigError
from core.plugins import hookimpl
from core.quantize import capture_linear_inputs, quantize_tied_embedding, swap_linears
from kernels.quant import Int4Linear, dequantize_int4, quantize_int4

GROUP_SIZES = (32, 64, 128)


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
    def __init__(self, config: QuantConfig, tokenizer=None, **context) -> None:
        x = config.extra
        self.group_size = int(x.get("group_size", 64))
        if self.group_size not in GROUP_SIZES:
            raise ConfigError(f"quant.group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")
        self.awq = bool(x.get("awq", False))
        self.calibration_prompts = int(x.get("calibration_prompts", 16))
        self.calibration_len = int(x.get("calibration_len", 256))
        self.keep = list(x.get("keep", []))
        self.fast = bool(x.get("fast", True))
        self.tokenizer = tokenizer
        self.report: dict[str, dict] = {}  # per layer: AWQ error vs round-to-nearest

    def _calibration(self) -> list[list[int]]:
        from scenarios.text import PromptSource

        if self.tokenizer is None:
            raise ConfigError("quant=int4 with awq needs the model's tokenizer for calibration prompts")
        n = self.calibration_prompts
        prose = PromptSource(self.tokenizer, "prose", seed=1234)
        code = PromptSource(self.tokenizer, "code", seed=1234)
        return [prose.prompt(self.calibration_len) for _ in range(n - n // 4)] + \
               [code.prompt(self.calibration_len) for _ in range(n // 4)]

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
