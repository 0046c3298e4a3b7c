"""Load a model and its tokenizer from a Hugging Face directory or a GGUF file.

Weights come only from safetensors or GGUF: nothing is ever unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from core.errors import ModelNotFoundError
from core.model import LlamaForCausalLM, ModelArgs
from core.tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SUPPORTED_ARCHS = ("llama", "qwen2", "mistral", "smollm")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    args: ModelArgs
    source: str  # the path the weights came from


def load_model(path: str | Path, dtype: str = "fp32", max_model_len: int | None = None) -> LoadedModel:
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist (give an HF directory or a .gguf file)")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, DTYPES[dtype], max_model_len)
    if path.is_dir():
        return _load_hf_dir(path, DTYPES[dtype], max_model_len)
    raise ModelNotFoundError(f"{path} is neither a Hugging Face model directory nor a .gguf file")


# ---- Hugging Face directories ---------------------------------------------------------------


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise ModelNotFoundError(f"{path} has only pickled weights (.bin/.pt); servelab loads safetensors only")
    raise ModelNotFoundError(f"{path} has no *.safetensors weights")


def _load_hf_dir(path: Path, dtype: torch.dtype, max_model_len: int | None) -> LoadedModel:
    from safetensors.torch import load_file

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelNotFoundError(f"{path} has no config.json")
    config = json.loads(cfg_file.read_text())
    model_type = config.get("model_type", "llama")
    if model_type not in SUPPORTED_ARCHS:
        raise ModelNotFoundError(f"model type '{model_type}' is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    args = ModelArgs.from_hf_config(config)
    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        state.update(load_file(str(f)))
    state = {k: v for k, v in state.items() if "rotary_emb.inv_freq" not in k}
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model = _build(args, state, dtype, max_model_len)
    return LoadedModel(model, Tokenizer.from_hf_dir(path, config), args, str(path))


def _build(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype, max_model_len: int | None):
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_model_len)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelNotFoundError(f"weights missing from the checkpoint: {', '.join(missing[:5])}")
    # The RoPE tables are buffers built at construction: rebuild them on the CPU.
    from core.model import RotaryEmbedding

    model.rope = RotaryEmbedding(args, max_model_len or args.max_position_embeddings)
    return model.eval().requires_grad_(False)


# ---- GGUF ------------------------------------------------------------------------------------

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


def _gguf_args(meta: dict, tensor_names: set[str]) -> ModelArgs:
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


def _load_gguf(path: Path, dtype: torch.dtype, max_model_len: int | None) -> LoadedModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    meta = read_gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    args = _gguf_args(meta, set(tensors))
    permuted = args.architecture in ("llama", "mistral", "smollm")  # llama.cpp permutes Q/K only for these
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
    model = _build(args, state, dtype, max_model_len)
    return LoadedModel(model, Tokenizer.from_gguf_metadata(meta), args, str(path))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Just the tokenizer of a model (no weights): for load generators that build prompts."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist (give an HF directory or a .gguf file)")
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        return Tokenizer.from_gguf_metadata(read_gguf_metadata(GGUFReader(str(path))))
    return Tokenizer.from_hf_dir(path, json.loads((path / "config.json").read_text()))
