"""The embedded SmolLM2-135M GGUF against transformers loading the same file."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from core.config import EngineConfig, ModelConfig, SchedulerConfig
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.model.gguf import unpermute_qk

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "To make a cup of tea, first",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def engine(default_gguf):
    cfg = EngineConfig(model=ModelConfig(dtype="fp32", max_model_len=256), scheduler=SchedulerConfig(max_num_seqs=8))
    return Engine(cfg)


@pytest.fixture(scope="module")
def hf_model(default_gguf):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32
    ).eval()


def test_greedy_continuations_equal_transformers(engine, hf_model):
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    do_sample=False, pad_token_id=2)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist(), prompt


def test_prefill_logits_close_to_transformers(engine, hf_model):
    ids = engine.tokenizer.encode(PROMPTS[0])
    seen = []
    accept = engine.decoder.accept
    engine.decoder.accept = lambda logits, sch, prop: seen.append(logits.clone()) or accept(logits, sch, prop)
    try:
        engine.generate([ids], SamplingParams(max_tokens=1))
    finally:
        engine.decoder.accept = accept
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1]
    assert (seen[0][0] - ref).abs().max().item() < 1e-3


def test_tokenizer_matches_smollm2_rules(engine):
    tok = engine.tokenizer
    ids = tok.encode("In 2024, 12345 apples.")
    digits = [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()]
    assert digits == list("2024") + list("12345")  # SmolLM splits numbers digit by digit
    assert tok.decode(ids) == "In 2024, 12345 apples."
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in chat
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == tok.backend.token_to_id("<|im_start|>")


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)
    n_head = 3
    # llama.cpp's convert script: each head's rows go from (2, d/2) halves to interleaved pairs
    permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, 5).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_cli_generate_says_paris():
    r = subprocess.run([sys.executable, "-m", "core", "generate", "--prompt", "The capital of France is",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_continuous_paged_equals_static_contiguous_on_the_real_model(engine):
    from plugins.cache.paged import PagedCacheConfig

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    static = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params)]
    cfg = EngineConfig(model=ModelConfig(dtype="fp32", max_model_len=256),
                       scheduler=SchedulerConfig(name="continuous", max_num_seqs=8, max_num_batched_tokens=24),
                       cache=PagedCacheConfig(name="paged", block_size=4, memory_gb=0.05))
    paged = Engine(cfg, loaded=engine.loaded)
    assert [o.outputs[0].token_ids for o in paged.generate(PROMPTS, params)] == static
    assert paged.allocator.stats().num_free_blocks == paged.allocator.num_blocks


def test_quantized_weight_bytes_and_gguf_blocks(engine):
    from core.bench.roofline import weight_bytes
    from core.config import CacheConfig
    from core.engine.registry import get_registry
    from servelab_kernels.quant import Int4Linear

    def build(quant, **keys):
        cfg = EngineConfig(model=ModelConfig(dtype="bf16", max_model_len=256),
                           quant=get_registry().config("quant", {"name": quant, **keys}),
                           cache=CacheConfig(name="paged", memory_gb=0.05))
        return Engine(cfg)

    bf16 = weight_bytes(build("none").model)
    assert weight_bytes(build("int8").model) <= 0.55 * bf16
    # INT4 linears take 0.625 bytes a weight (a float16 scale and offset per 32); with the tied
    # embedding's own INT4 copy the model is about 0.38x bf16
    assert weight_bytes(build("int4").model) <= 0.40 * bf16
    gguf = build("gguf", fast=False)
    layer = gguf.model.model.layers[3].self_attn.q_proj  # Q4_1 rows, un-permuted
    assert isinstance(layer, Int4Linear) and layer.group_size == 32
    attn = engine.loaded.model.model.layers[3].self_attn  # the loader's dequantized fp32, q/k/v fused
    float_weight = attn.qkv_proj.inner.weight[: attn.num_heads * attn.head_dim]
    torch.testing.assert_close(layer.dequantized_weight(), float_weight.float(), atol=1e-5, rtol=1e-5)
    out = gguf.generate(["The capital of France is"], SamplingParams(max_tokens=4))[0].outputs[0].text
    assert "Paris" in out


QUALITY = [  # measured on these 3 prompts x 16 tokens (KL / top-1): the bounds leave about 3x (KL) margin
    ("bf16", {"name": "none"}, "auto", 0.004, 0.95),  # 0.0011 / 1.00
    ("kv-int8", {"name": "none"}, "int8", 0.01, 0.95),  # 0.0029 / 1.00
    ("int8", {"name": "int8"}, "auto", 0.02, 0.90),  # 0.0064 / 0.98
    ("gguf", {"name": "gguf"}, "auto", 0.01, 0.95),  # 0.0034 / 1.00
    ("int4-rtn", {"name": "int4"}, "auto", 0.7, 0.55),  # 0.42 / 0.71: INT4 of a model already Q4_1
    ("int4-awq", {"name": "int4", "awq": True}, "auto", 0.4, 0.65),  # 0.24 / 0.81
]


@pytest.fixture(scope="module")
def quality_reference(engine):
    from core.model.quantize import forward_prompt

    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    conts = [o.outputs[0].token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    base = [torch.log_softmax(forward_prompt(engine.model, p + c, engine.attention, engine.kv_spec)[len(p) - 1:-1]
                              .float(), -1) for p, c in zip(prompts, conts)]
    return prompts, conts, base


_measured: dict[str, tuple[float, float]] = {}


def variant_quality(reference, name: str) -> tuple[float, float]:
    """(mean KL(fp32 || variant), top-1 agreement) along the baseline's greedy continuations, through
    the variant's own model, attention and KV-cache dtype; measured once per module."""
    from core.engine.registry import get_registry
    from core.model.quantize import forward_prompt
    from plugins.cache.paged import PagedCacheConfig

    if name not in _measured:
        _, quant, kv, _, _ = next(q for q in QUALITY if q[0] == name)
        e = Engine(EngineConfig(model=ModelConfig(dtype="bf16", max_model_len=256),
                                quant=get_registry().config("quant", quant),
                                cache=PagedCacheConfig(name="paged", memory_gb=0.05, dtype=kv)))
        kls, top1 = [], []
        for p, c, lp0 in zip(*reference):
            lp = torch.log_softmax(forward_prompt(e.model, p + c, e.attention, e.kv_spec)[len(p) - 1:-1].float(), -1)
            kls.append((lp0.exp() * (lp0 - lp)).sum(-1).mean().item())
            top1.append((lp.argmax(-1) == lp0.argmax(-1)).float().mean().item())
        _measured[name] = (sum(kls) / len(kls), sum(top1) / len(top1))
    return _measured[name]


@pytest.mark.parametrize("name, max_kl, min_top1", [(q[0], q[3], q[4]) for q in QUALITY], ids=[q[0] for q in QUALITY])
def test_quality_guards_against_the_fp32_baseline(quality_reference, name, max_kl, min_top1):
    kl, agree = variant_quality(quality_reference, name)
    assert kl < max_kl and agree >= min_top1, (name, kl, agree)


def test_awq_is_better_than_round_to_nearest(quality_reference):
    assert variant_quality(quality_reference, "int4-awq")[0] < 0.8 * variant_quality(quality_reference, "int4-rtn")[0]
