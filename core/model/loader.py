"""Load a model and its tokenizer from a Hugging Face directory or a GGUF file.

Weights come only from safetensors or GGUF: nothing is ever unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ModelNotFoundError
from core.model.gguf import SUPPORTED_ARCHS, gguf_args, load_gguf, read_gguf_metadata
from core.model.llama import LlamaForCausalLM, ModelArgs, RotaryEmbedding
from core.model.tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    args: ModelArgs
    source: str  # the path the weights came from


def load_model(path: str | Path, dtype: str = "fp32", max_model_len: int | None = None,
               device: str | torch.device = "cpu") -> LoadedModel:
    """Weights go straight to `device` in `dtype`; the model is in eval mode without gradients."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist (give an HF directory or a .gguf file)")
    if path.is_file() and path.suffix == ".gguf":
        args, state, tokenizer = load_gguf(path)
    elif path.is_dir():
        args, state, tokenizer = _read_hf_dir(path)
    else:
        raise ModelNotFoundError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    model = build_model(args, state, DTYPES[dtype], max_model_len, torch.device(device))
    return LoadedModel(model, tokenizer, args, str(path))


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


def _read_hf_dir(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]:
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
    return args, state, Tokenizer.from_hf_dir(path, config)


def build_model(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype, max_model_len: int | None,
                device: torch.device) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_model_len)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelNotFoundError(f"weights missing from the checkpoint: {', '.join(missing[:5])}")
    # The RoPE tables are buffers built at construction: rebuild them for real, on the device.
    model.rope = RotaryEmbedding(args, max_model_len or args.max_position_embeddings).to(device)
    return model.eval().requires_grad_(False)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Just the tokenizer of a model (no weights): for load generators that build prompts."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist (give an HF directory or a .gguf file)")
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        return Tokenizer.from_gguf_metadata(read_gguf_metadata(GGUFReader(str(path))))
    return Tokenizer.from_hf_dir(path, json.loads((path / "config.json").read_text()))


def read_model_args(path: str | Path) -> ModelArgs:
    """The model's geometry from its config or GGUF metadata, without reading the weights."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist (give an HF directory or a .gguf file)")
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        return gguf_args(read_gguf_metadata(reader), {t.name for t in reader.tensors})
    return ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()))
