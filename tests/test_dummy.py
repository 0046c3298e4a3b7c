"""Dummy weights at real shapes (model.load_format=dummy) and the presets in conf/model/."""

import pytest
import torch

from core.config.compose import compose
from core.engine.components import engine_config, model_args
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.errors import ConfigError

TINY_SHAPE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152, "tie_word_embeddings": False}


@pytest.mark.parametrize("preset, params_b, layers, vocab", [
    ("llama-3.2-1b", 1.074, 16, 49152), ("llama-3.1-8b", 8.030, 32, 128256), ("qwen2.5-7b", 7.615, 28, 152064),
])
def test_presets_have_the_real_models_geometry(preset, params_b, layers, vocab):
    a = model_args(engine_config(compose([f"model={preset}"])))
    per_layer = a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim * a.hidden_size
    per_layer += 3 * a.hidden_size * a.intermediate_size
    params = a.num_layers * per_layer + a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
    assert (round(params / 1e9, 3), a.num_layers, a.vocab_size) == (params_b, layers, vocab)
    assert a.qkv_bias == (preset == "qwen2.5-7b")


def test_a_dummy_model_serves_at_its_shape_with_the_embedded_tokenizer():
    cfg = compose(["model.load_format=dummy", "model.name=tiny-dummy", "model.dtype=fp32", "model.max_model_len=128",
                   "cache.memory_gb=0.01", "model.shape={" + ",".join(f"{k}:{v}" for k, v in TINY_SHAPE.items()) + "}"])
    e = Engine(engine_config(cfg))
    assert e.loaded.source == "dummy:tiny-dummy" and e.tokenizer.vocab_size == 49152
    w = e.model.model.layers[1].mlp.gate_up_proj.inner.weight  # gate and up, fused (core.model.fuse)
    assert w.shape == (256, 64) and w.dtype == torch.float32 and 0 < w.abs().max() <= 1e-3
    assert torch.equal(e.model.model.norm.weight, torch.ones(64))
    out = e.generate(["Hello there"], SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and all(0 <= t < 49152 for t in out.token_ids)


def test_dummy_without_a_shape_or_with_a_bad_format_is_one_line():
    with pytest.raises(ConfigError, match="model.load_format=dummy needs model.shape"):
        Engine(engine_config(compose(["model.load_format=dummy"])))
    with pytest.raises(ConfigError, match="model.load_format must be auto or dummy, got 'npz'"):
        engine_config(compose(["model.load_format=npz"]))


def test_the_embedded_tokenizer_travels_without_its_weights(tmp_path, default_gguf):
    """benchmarks/gpu_prepare.sh saves it for the GPU machine, where the 97 MB GGUF cannot go."""
    from core.model.loader import load_tokenizer

    tok = load_tokenizer(default_gguf)
    tok.save(tmp_path / "tok")
    back = load_tokenizer(tmp_path / "tok")
    text = "The capital of France is Paris. 12345 def f(x): return x"
    assert back.encode(text) == tok.encode(text) and back.decode(tok.encode(text)) == text
    chat = [{"role": "user", "content": "Hi"}]
    assert back.encode_chat(chat) == tok.encode_chat(chat)
    assert (back.eos_token_ids, back.bos_token_id, back.vocab_size) == (tok.eos_token_ids, tok.bos_token_id,
                                                                       tok.vocab_size)
