"""SmoothQuant-style smoothing for W8A8: move activation outliers into the weights, exactly.

With INT8 activations and one scale a token, a few input channels much larger than the rest set
every token's step, and the other channels lose their precision. Dividing input channel j by s_j
and multiplying the weights' column j by s_j leaves x W^T unchanged in exact arithmetic and moves
the range from the activations (quantized per token, coarse) to the weights (quantized per output
channel). SmoothQuant's scale is s_j = max|x_j|^alpha / max|W_j|^(1 - alpha).

The division never runs: it is folded into whatever produced the input, so the served model has
no extra op and the kernels are unchanged. For a Llama-family layer:
- q/k/v read input_layernorm's output: its weight is divided by s (one s for the three);
- o_proj reads the attention output, whose channel (head h, d) is value channel (h // group, d):
  v_proj's output rows are divided by s, so s is shared by the query heads of a KV head;
- gate/up read post_attention_layernorm's output: its weight again;
- down_proj reads silu(gate) * up, linear in up: up_proj's output rows are divided by s.
The rows of v_proj and up_proj are quantized with one scale each, so scaling them is free.
The tied head (its columns are the embedding's) is left alone.

alpha is searched per group on calibration activations (with the W8A8 kernels' rounding, as
`int4`'s AWQ search does), and no smoothing is one of the candidates, so on the calibration data a
group can only match or beat plain W8A8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from core.model.quantize import observe_linear_inputs
from servelab_kernels.cpu_quant import A8
from servelab_kernels.cpu_quant_ref import round_rows_ref
from servelab_kernels.quant import quantize_int8

ALPHAS = tuple(i / 10 for i in range(11))


@dataclass
class SmoothGroup:
    """Linears that read the same input, and where that input's division by s is folded."""

    name: str
    consumers: list[str]  # qualified names of the linears reading the input
    fold: str  # "norm" (a norm's weight) or "rows" (a linear's output rows)
    producer: str  # qualified name of the norm or linear that takes 1/s
    group: int = 1  # input channels sharing one s, consecutive by head (o_proj under GQA)
    head_dim: int = 1


def llama_groups(model: nn.Module) -> list[SmoothGroup]:
    """The four smoothing groups of each layer of servelab's Llama-family model, before fusion."""
    args = model.args
    rep = args.num_heads // args.num_kv_heads
    groups = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
            raise ValueError("smoothing runs before q/k/v and gate/up are fused")
        p = f"model.layers.{i}"
        groups += [
            SmoothGroup(f"{p}.qkv", [f"{p}.self_attn.{n}_proj" for n in "qkv"], "norm", f"{p}.input_layernorm"),
            SmoothGroup(f"{p}.o", [f"{p}.self_attn.o_proj"], "rows", f"{p}.self_attn.v_proj", rep, args.head_dim),
            SmoothGroup(f"{p}.gate_up", [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], "norm",
                        f"{p}.post_attention_layernorm"),
            SmoothGroup(f"{p}.down", [f"{p}.mlp.down_proj"], "rows", f"{p}.mlp.up_proj"),
        ]
    return groups


def _shared(v: torch.Tensor, group: int, head_dim: int) -> torch.Tensor:
    """[heads * d] -> [kv_heads * d]: the largest over each KV head's `group` query heads."""
    if group == 1:
        return v
    return v.reshape(-1, group, head_dim).amax(dim=1).reshape(-1)


def _expand(s: torch.Tensor, group: int, head_dim: int) -> torch.Tensor:
    """[kv_heads * d] -> [heads * d]: each KV head's scales for its query heads."""
    if group == 1:
        return s
    return s.reshape(-1, 1, head_dim).expand(-1, group, head_dim).reshape(-1)


def w8a8_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor | None,
               refs: list[torch.Tensor] | None = None) -> float:
    """Mean squared error of W8A8 (per-token INT8 activations, per-channel INT8 weights, rounded
    as the kernels round) against x W^T in fp32, with the input divided by s and the weights'
    columns multiplied by it. The integer sums run in fp32 (the kernels' twin sums in fp64, exactly:
    a search needs the error, not the last bit). `refs`: the x W^T already computed."""
    err, n = 0.0, 0
    xq, amax = round_rows_ref(x if s is None else x / s, A8)
    for i, w in enumerate(weights):
        w = w.float()
        q, scales = quantize_int8(w if s is None else w * s)
        ref = refs[i] if refs is not None else x @ w.T
        err += ((xq @ q.float().T) * (amax / A8) * scales[None] - ref).pow(2).sum().item()
        n += x.shape[0] * w.shape[0]
    return err / n


def smooth_scale(x: torch.Tensor, absmax: torch.Tensor, weights: list[torch.Tensor], group: int = 1,
                 head_dim: int = 1) -> tuple[torch.Tensor | None, float, float, float | None]:
    """The best of SmoothQuant's scales over ALPHAS, and none, for inputs x [rows, K] (absmax [K]
    over all calibration rows) read by `weights` ([N, K] each). Returns (s [K] or None, its error,
    the error without smoothing, its alpha or None)."""
    x = x.float()
    wmax = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
    a = _shared(absmax.float(), group, head_dim).clamp(min=1e-5)
    wm = _shared(wmax, group, head_dim).clamp(min=1e-5)
    refs = [x @ w.float().T for w in weights]
    plain = w8a8_error(x, weights, None, refs)
    best, best_err, best_alpha = None, plain, None
    for alpha in ALPHAS:
        s = _expand((a.pow(alpha) / wm.pow(1 - alpha)).clamp(min=1e-5), group, head_dim)
        err = w8a8_error(x, weights, s, refs)
        if err < best_err:
            best, best_err, best_alpha = s, err, alpha
    return best, best_err, plain, best_alpha


@torch.no_grad()
def apply_smoothing(model: nn.Module, g: SmoothGroup, s: torch.Tensor, skip: set[str] = frozenset()) -> None:
    """Fold 1/s into the group's producer and s into its consumers' columns, in fp32. Linears to be
    quantized (not in `skip`) keep the fp32 product until their quantizer rounds it to INT8 (a bf16
    rounding first would add its error to every weight); norms and kept linears go back to their dtype."""
    mods = dict(model.named_modules())

    def store(name: str, attr: str, value: torch.Tensor) -> None:
        p = getattr(mods[name], attr)
        p.data = value if name not in skip and isinstance(mods[name], nn.Linear) else value.to(p.dtype)

    for name in g.consumers:
        w = mods[name].weight
        store(name, "weight", w.float() * s.to(w.device))
    prod = mods[g.producer]
    inv = 1.0 / _shared(s, g.group, g.head_dim)  # the producer's channels: KV heads for o_proj
    if g.fold == "norm":
        store(g.producer, "weight", prod.weight.float() * inv.to(prod.weight.device))
        return
    store(g.producer, "weight", prod.weight.float() * inv.to(prod.weight.device)[:, None])
    if getattr(prod, "bias", None) is not None:
        prod.bias.data = (prod.bias.float() * inv.to(prod.bias.device)).to(prod.bias.dtype)  # added, never quantized


def capture_inputs_and_absmax(model: nn.Module, prompts: list[list[int]], names: set[str],
                              max_rows: int = 512) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per named Linear: about `max_rows` of its calibration input rows (fp32; an equal random share
    of each prompt's, so memory stays at that many rows whatever the prompts' length), and each
    input channel's largest magnitude over all rows."""
    share = -(-max_rows // max(1, len(prompts)))
    gen = torch.Generator().manual_seed(0)
    seen: dict[str, list[torch.Tensor]] = {}
    absmax: dict[str, torch.Tensor] = {}

    def observe(name: str, x: torch.Tensor) -> None:
        m = x.abs().amax(dim=0)
        absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)
        seen.setdefault(name, []).append(x if x.shape[0] <= share else
                                         x[torch.randperm(x.shape[0], generator=gen)[:share]])

    observe_linear_inputs(model, prompts, names, observe)
    return {name: torch.cat(xs)[:max_rows] for name, xs in seen.items()}, absmax


def smooth_model(model: nn.Module, prompts: list[list[int]], skip: set[str] = frozenset()) -> dict[str, dict]:
    """Smooth every group of the model whose linears are all to be quantized (none in `skip`);
    returns per group the chosen alpha (None: left alone) and its calibration errors."""
    groups = [g for g in llama_groups(model) if not set(g.consumers) & skip]
    rows, absmax = capture_inputs_and_absmax(model, prompts, {g.consumers[0] for g in groups})
    mods = dict(model.named_modules())
    report = {}
    for g in groups:
        weights = [mods[n].weight.data for n in g.consumers]
        x = rows[g.consumers[0]]
        s, err, plain, alpha = smooth_scale(x, absmax[g.consumers[0]], weights, g.group, g.head_dim)
        if s is not None:
            apply_smoothing(model, g, s, skip)
        report[g.name] = {"alpha": alpha, "smooth_mse": err, "plain_mse": plain}
    return report
