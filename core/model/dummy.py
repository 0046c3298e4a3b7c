"""Random weights at a real model's shape, like vLLM's `--load-format dummy`.

`model.load_format=dummy` with a `model.shape` (Hugging Face config keys; presets in conf/model/)
builds the model straight on its device with small uniform weights and the embedded tokenizer,
so a benchmark at Llama-3.1-8B's size needs no download. The arithmetic (bytes read, FLOPs,
KV per token) is the real model's; the text is noise, so runs use forced output lengths.
"""

from __future__ import annotations

import torch

from core.errors import ConfigError
from core.model.llama import LlamaForCausalLM, ModelArgs, RotaryEmbedding
from core.model.loader import LoadedModel

INIT_RANGE = 1e-3  # vLLM's dummy weights: uniform in [-1e-3, 1e-3]


def dummy_args(shape: dict | None, name: str) -> ModelArgs:
    if not shape:
        raise ConfigError(f"model.load_format=dummy needs model.shape (Hugging Face config keys); model '{name}' "
                          "has none: use a preset such as model=llama-3.2-1b")
    try:
        return ModelArgs.from_hf_config(dict(shape))
    except KeyError as e:
        raise ConfigError(f"model.shape lacks {e.args[0]}") from None


@torch.inference_mode()
def dummy_model(shape: dict | None, name: str, dtype: torch.dtype, max_model_len: int | None,
                device: torch.device, seed: int = 0, tokenizer: str | None = None) -> LoadedModel:
    from core.model.default_model import default_model_path
    from core.model.loader import load_tokenizer

    args = dummy_args(shape, name)
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_model_len)
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for pname, p in list(module.named_parameters(recurse=False)):
            data = torch.empty(p.shape, dtype=dtype, device=device)
            if pname == "weight" and p.dim() == 1:  # norms
                data.fill_(1.0)
            else:
                data.uniform_(-INIT_RANGE, INIT_RANGE, generator=gen)
            setattr(module, pname, torch.nn.Parameter(data, requires_grad=False))
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rope = RotaryEmbedding(args, max_model_len or args.max_position_embeddings).to(device)
    tok = load_tokenizer(tokenizer or default_model_path())
    if tok.vocab_size > args.vocab_size:
        raise ConfigError(f"model.shape.vocab_size={args.vocab_size} is smaller than the tokenizer's "
                          f"{tok.vocab_size} tokens")
    return LoadedModel(model.eval(), tok, args, f"dummy:{name}")
