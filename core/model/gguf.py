"""GGUF files: names, llama.cpp's Q/K permutation, metadata to model arguments, and the weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from core.errors import ModelNotFoundError
from core.model.llama import ModelArgs
from core.model.tokenizer import Tokenizer

SUPPORTED_ARCHS = ("llama", "qwen2", "mistral", "smollm")
PERMUTED_ARCHS = ("llama", "mistral", "smollm")  # llama.cpp permutes Q/K rows only for these

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    parts = name.split(".")  # blk.N.attn_q.weight
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows.

    llama.cpp stores each head's rotary pairs interleaved (x0, x_{d/2}, x1, ...); Hugging Face
    keeps the two halves apart (rotate-half). Rows per head go from (d/2, 2) back to (2, d/2).
    """
    shape = w.shape
    return w.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_gguf_metadata(reader) -> dict:
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = f.contents()
        except Exception:  # a field type this gguf version cannot decode: not one we use
            continue
    return meta


def gguf_args(meta: dict, tensor_names: set[str]) -> ModelArgs:
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(f"GGUF architecture '{arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")

    def g(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = g("attention.head_count")
    hidden = g("embedding_length")
    scaling = None
    if g("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelArgs(
        vocab_size=g("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_layers=g("block_count"),
        num_heads=heads,
        num_kv_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length") or hidden // heads,
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=g("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=g("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[eos] if eos is not None else [],
        architecture=arch,
    )


def load_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]:
    """Model arguments, fp32 state dict (Q/K rows un-permuted) and tokenizer of a GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = read_gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    args = gguf_args(meta, set(tensors))
    permuted = args.architecture in PERMUTED_ARCHS
    state = {}
    for name, t in tensors.items():
        hf = gguf_to_hf_name(name)
        if hf is None:
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims fastest-first
        if permuted and ".attn_q." in name:
            w = unpermute_qk(w, args.num_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_qk(w, args.num_kv_heads)
        state[hf] = torch.from_numpy(np.array(w, copy=True))
    return args, state, Tokenizer.from_gguf_metadata(meta)
