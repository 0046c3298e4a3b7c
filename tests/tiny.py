"""Tiny random Llama-family models written to disk as Hugging Face directories, for fast tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.config import EngineConfig, ModelConfig, SchedulerConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_byte_tokenizer(path: Path) -> int:
    """A byte-level BPE with no merges: 256 byte tokens then the special tokens. Returns its size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }))
    return tok.get_vocab_size()


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random tiny model of `arch` (llama, llama3, qwen2, mistral) to `path`."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    eos = vocab - 1  # <|im_end|>
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, eos_token_id=eos,
        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif arch == "llama3":
        cfg = transformers.LlamaConfig(**{**common, "tie_word_embeddings": True}, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg)
    # Random init is near zero; widen it so logits differ clearly between tokens.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:  # norm weights
                p.normal_(1.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def tiny_config(path: Path, **kw) -> EngineConfig:
    cfg = EngineConfig(model=ModelConfig(name="tiny", path=str(path), dtype="fp32", max_model_len=kw.pop("max_model_len", 128)))
    cfg.scheduler = SchedulerConfig(name=kw.pop("scheduler", "static"), max_num_seqs=kw.pop("max_num_seqs", 8),
                                    max_num_batched_tokens=kw.pop("max_num_batched_tokens", 4096))
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


class _NoPlan:
    """An attention backend stand-in for tests that only look at the runner's metadata."""

    def plan(self, meta):
        return None


def step_inputs(allocator, scheduled):
    """The model inputs the runner builds from an allocator's block tables for `scheduled`."""
    from core.runner.model_runner import ModelRunner

    runner = ModelRunner("cpu", _NoPlan())
    return runner.prepare(scheduled, [allocator.block_table(s.seq) for s in scheduled], allocator.block_size)


def attend(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale=None, v_scale=None,
           backend=None):
    """Attention of packed queries over a filled cache through an attention backend (the torch
    reference by default), with the metadata the runner would build."""
    from core.runner.metadata import AttentionMetadata
    from plugins.attention.torch_ref import TorchAttention

    backend = backend or TorchAttention(None)
    starts, ctxs = query_start_loc.tolist(), context_lens.tolist()
    qlens = [b - a for a, b in zip(starts, starts[1:])]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), block_tables=block_tables, context_lens=context_lens,
        query_lens=torch.tensor(qlens), query_start_loc=query_start_loc, block_size=k_cache.shape[2],
        max_query_len=max(qlens), max_context_len=max(ctxs), query_lens_cpu=qlens, context_lens_cpu=ctxs,
        query_start_loc_cpu=starts, block_tables_cpu=block_tables.tolist())
    meta.plan = backend.plan(meta)
    kv = (k_cache, v_cache) + ((k_scale, v_scale) if k_scale is not None else ())
    return backend.attend(q, kv, meta, scale)


def empty_kv_cache(num_blocks: int, kv_heads: int, block_size: int, d: int, dtype: torch.dtype, device="cpu"):
    """Zeroed K and V caches in the engine's layout, and for an int8 cache their per-token scales."""
    kc = torch.zeros(num_blocks, kv_heads, block_size, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    scales = ()
    if dtype == torch.int8:
        scales = tuple(torch.zeros(num_blocks, kv_heads, block_size, dtype=torch.float16, device=device)
                       for _ in range(2))
    return kc, vc, scales


def scattered_kv_cache(ctx_lens: list[int], kv_heads: int, d: int, dtype: torch.dtype, seed: int,
                       block_size: int = 16, device="cpu", num_blocks: int = 64):
    """A cache holding each sequence's random K/V in blocks scattered over the pool (written by
    the reference `write_kv`). Returns (k_cache, v_cache, scales, block tables [seqs, max blocks]
    int64, padded with block 0)."""
    from servelab_kernels.attention import write_kv

    g = torch.Generator().manual_seed(seed)
    kc, vc, scales = empty_kv_cache(num_blocks, kv_heads, block_size, d, dtype, device)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for ctx in ctx_lens:
        nb = -(-ctx // block_size)
        table, order = order[:nb], order[nb:]
        tables.append(table)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(ctx)])
        k, v = torch.randn(ctx, kv_heads, d, generator=g), torch.randn(ctx, kv_heads, d, generator=g)
        write_kv(k.to(device), v.to(device), kc, vc, slots.to(device), *scales)
    width = max(len(t) for t in tables)
    return kc, vc, scales, torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)

