"""Decode-only steps of a `LlamaForCausalLM` as one C++ call: the model's layers handed to
servelab_kernels.cpu_decode's `DecodePlan` (the analogue, on the CPU, of replaying a CUDA graph).

The plan runs exactly what `LlamaForCausalLM.forward` runs for a step whose every row is one new
token (the norms, the fused projections, rotary, the attention backend's write-and-decode op,
silu-and-multiply), on the same kernels, so its hidden states are the eager forward's bit for bit;
the embedding lookup before it and the head after it stay in Python (one call each). It serves a
model only where every piece is one it reproduces; `why_not` names the first piece that is not,
so `backend.native_decode=true` can refuse with it and `auto` can say why it stayed eager.
"""

from __future__ import annotations

import torch

from core.model.fuse import FusedLinear
from core.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from servelab_kernels import cpu_decode
from servelab_kernels.dispatch import Switch

_on = Switch()


def native_decoding(on: bool):
    """`with native_decoding(False):` decode steps run the eager forward (benchmarks.native_decode A/Bs)."""
    return _on.set(on)


class NativeDecode:
    """Builds the plan on first use and again whenever the kernels' switches change."""

    def __init__(self, model, attention, kv_caches: list[tuple]) -> None:
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.plan, self.key = None, None

    def serves(self, batch) -> bool:
        """Whether the plan runs this step: decode-only (each row a sequence's one new token), and the
        plan still reproduces the eager forward under the kernels' switches as they are now."""
        if not _on.on or batch.attn.max_query_len != 1 or batch.input_ids.shape[0] != batch.attn.num_seqs:
            return False
        key = cpu_decode.settings()
        if key != self.key:
            self.key = key
            fits = why_not(self.model, self.attention, self.kv_caches) is None
            self.plan = build_plan(self.model, self.attention, self.kv_caches) if fits else None
        return self.plan is not None

    def forward(self, batch) -> torch.Tensor:
        """The final norm's hidden states [rows, hidden] of a step `serves` (its KV written)."""
        meta = batch.attn
        x = self.model.model.embed_tokens(batch.input_ids)
        return self.plan.forward(x, batch.positions.long(), meta.slot_mapping, meta.block_tables, meta.context_lens)


def model_dtype(model) -> torch.dtype:
    return model.model.norm.weight.dtype


def why_not(model, attention, kv_caches: list[tuple]) -> str | None:
    """Why a decode plan cannot reproduce this model's decode step here, or None when it can."""
    if type(model) is not LlamaForCausalLM:
        return f"the model is a {type(model).__name__}, not servelab's LlamaForCausalLM"
    dtype = model_dtype(model)
    if dtype not in (torch.bfloat16, torch.float32) or model.model.norm.weight.device.type != "cpu":
        return f"the model is {dtype} on {model.model.norm.weight.device}, not bf16 or fp32 on the CPU"
    if cpu_decode.load() is None:
        return "the C++ decode plan did not build"
    if reason := cpu_decode.unusable(dtype):
        return reason
    if model.rope.cos.dtype != torch.float32 or model.rope.sin.dtype != torch.float32:
        return "the rotary tables are not fp32"
    decode_op = getattr(attention, "decode_op", None)
    if decode_op is None or not kv_caches or decode_op(kv_caches[0]) is None:
        return f"attention backend {type(attention).__name__} has no write-and-decode op for this cache"
    args = model.args
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    for i, layer in enumerate(model.model.layers):
        if reason := _layer_why_not(layer, dtype, [q, kv, kv], [args.intermediate_size] * 2):
            return f"layer {i}: {reason}"
    eps = {n.eps for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
    if eps != {model.model.norm.eps}:
        return f"its RMSNorms differ in eps ({sorted(eps | {model.model.norm.eps})}); the plan takes one"
    return None


def _layer_why_not(layer, dtype: torch.dtype, qkv_sizes: list[int], gate_up_sizes: list[int]) -> str | None:
    if (type(layer), type(layer.self_attn), type(layer.mlp)) != (DecoderLayer, Attention, MLP):
        return "not the Llama decoder layer"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight.dtype != dtype for n in norms):
        return f"its norms are not RMSNorm in {dtype}"
    attn, mlp = layer.self_attn, layer.mlp
    fused = ((attn.qkv_proj, qkv_sizes, "q/k/v"), (mlp.gate_up_proj, gate_up_sizes, "gate/up"))
    for proj, sizes, name in fused:
        if type(proj) is not FusedLinear or proj.sizes != sizes:
            return f"its {name} projections are not fused"
    for name, mod in (("q/k/v", attn.qkv_proj.inner), ("o", attn.o_proj), ("gate/up", mlp.gate_up_proj.inner),
                      ("down", mlp.down_proj)):
        if cpu_decode.linear_spec(mod, dtype) is None:
            return f"its {name} projection is a {type(mod).__name__} the plan does not run"
    return None


def build_plan(model, attention, kv_caches: list[tuple]):
    """The DecodePlan of this model, attention op and KV caches (check `why_not` first)."""
    args, dtype = model.args, model_dtype(model)
    plan = cpu_decode.new_plan(model.rope.cos, model.rope.sin, model.model.norm.weight, args.num_heads,
                               args.num_kv_heads, args.head_dim, args.intermediate_size, model.model.norm.eps,
                               model.model.layers[0].self_attn.scale, attention.decode_op(kv_caches[0]))
    for layer, cache in zip(model.model.layers, kv_caches):
        k_cache, v_cache, *scales = cache  # an INT8 cache carries its k and v scales
        plan.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, k_cache, v_cache,
                       *(scales or (None, None)))
        attn, mlp = layer.self_attn, layer.mlp
        for mod in (attn.qkv_proj.inner, attn.o_proj, mlp.gate_up_proj.inner, mlp.down_proj):
            kind, gemv, weight, second, packed, bias = cpu_decode.linear_spec(mod, dtype)
            plan.add_linear(kind, gemv, weight, second, packed, bias)
    return plan
