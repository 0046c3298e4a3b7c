"""A Llama-family decoder in plain PyTorch: Llama 2/3, Qwen2/2.5, Mistral, SmolLM2.

Module names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, ...) so a safetensors
state dict loads as is. The forward pass takes a packed batch (no padding) and reads and writes
KV only through the attention backend and the metadata it is given, so every cache allocator and
every attention backend serves it. With no cache (calibration passes) it is one causal sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from core.runner.metadata import AttentionMetadata
from servelab_kernels.activation import silu_mul
from servelab_kernels.attention import causal_attention
from servelab_kernels.linear import Linear
from servelab_kernels.norm import rms_norm
from servelab_kernels.rotary import rotary


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False  # Llama's attention_bias puts a bias on all four projections
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"

    @classmethod
    def from_hf_config(cls, c: dict) -> ModelArgs:
        arch = (c.get("architectures") or [c.get("model_type", "llama")])[0]
        model_type = c.get("model_type", "llama")
        heads = c["num_attention_heads"]
        qwen = model_type.startswith("qwen2")
        attention_bias = bool(c.get("attention_bias", False))
        eos = c.get("eos_token_id")
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=(c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta", 10000.0),
            rope_scaling=c.get("rope_scaling") or _scaling_from_rope_parameters(c.get("rope_parameters")),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=qwen or attention_bias,
            o_bias=attention_bias and not qwen,
            mlp_bias=bool(c.get("mlp_bias", False)),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
            architecture=arch,
        )


def _scaling_from_rope_parameters(p: dict | None) -> dict | None:
    """transformers >= 5 writes `rope_parameters` instead of `rope_scaling`."""
    if not p or p.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in p.items() if k != "rope_theta"}


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short kept, a smooth ramp between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling '{kind}'")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs, max_len: int) -> None:
        super().__init__()
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(args))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim]; rotate-half (Hugging Face layout)."""
        return rotary(q, k, positions, self.cos, self.sin)


@dataclass
class ForwardContext:
    """What every attention layer of one forward pass reads."""

    meta: AttentionMetadata | None
    kv_caches: list[tuple] | None
    attention: Any  # an AttentionBackend, or None for a cache-less causal pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual (norm(x + residual), x + residual): the add is fused in."""
        out, residual_out = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual_out)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h = args.hidden_size
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=args.o_bias)
        self.qkv_proj = None  # q/k/v as one matmul, once core.model.fuse has merged them
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext,
                layer: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x) if self.qkv_proj is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k = rope(q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim),
                    positions)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if ctx.attention is None:
            o = causal_attention(q, k, v, self.scale)
        else:
            o = ctx.attention.forward(q, k, v, ctx.kv_caches[layer], ctx.meta, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = Linear(h, i, bias=args.mlp_bias)
        self.up_proj = Linear(h, i, bias=args.mlp_bias)
        self.down_proj = Linear(i, h, bias=args.mlp_bias)
        self.gate_up_proj = None  # gate/up as one matmul, once core.model.fuse has merged them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x) if self.gate_up_proj is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, residual, positions, rope, ctx: ForwardContext, layer: int):
        """Pre-norm with the residual carried beside the stream (vLLM's way), so each norm fuses the
        add before it: returns (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, ctx, layer)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: ModelArgs, max_model_len: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(args, max_model_len or args.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | None = None,
                kv_caches: list[tuple] | None = None, attention=None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a packed batch; the attention backend writes KV to
        `kv_caches` where `meta` says. Without a backend: one sequence, causal, no cache."""
        ctx = ForwardContext(meta, kv_caches, attention)
        x, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, positions, self.rope, ctx, i)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # In the model's dtype: an fp32 copy of bf16 logits holds the same values, and a 64-row
        # decode step's copy (12.6 MB written) cost about 0.8 ms on a 2-core Xeon, with the argmax then
        # reading twice the bytes; decoders upcast the rows they compute probabilities on
        return self.lm_head(hidden)
