"""Tokenizer, chat template and incremental detokenization.

Built on the `tokenizers` library from either a Hugging Face `tokenizer.json` or the vocabulary a
GGUF file carries in its metadata. Chat templates are rendered with jinja2 in a sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from core.errors import RequestError

# llama.cpp's pre-tokenizer names -> the split regexes their vocabularies were trained with
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise RequestError("this model has no chat template; send a plain prompt instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        tok = self.backend.id_to_token
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=tok(self.eos_token_id) if self.eos_token_id is not None else "",
        )

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The template writes the special tokens itself; a BOS is added only where it did not.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=True)

    def detokenize_incrementally(
        self, all_ids: list[int], prefix_offset: int, read_offset: int, final: bool = False
    ) -> tuple[str, int, int]:
        """New text since `read_offset`, decoding a few tokens of context so that word
        boundaries and multi-byte characters come out right (vLLM's scheme). Text ending in an
        incomplete character is held back until more tokens come, or until `final`.
        Returns (new_text, new_prefix_offset, new_read_offset)."""
        prefix_text = self.decode(all_ids[prefix_offset:read_offset])
        new_text = self.decode(all_ids[prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            return new_text[len(prefix_text) :], read_offset, len(all_ids)
        return "", prefix_offset, read_offset

    def save(self, path: Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and a config.json holding the special ids, which
        `from_hf_dir` reads back (e.g. to carry the embedded GGUF's tokenizer without its weights)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / "tokenizer.json"))
        tok = self.backend.id_to_token
        (path / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": tok(self.bos_token_id) if self.bos_token_id is not None else None,
            "eos_token": tok(self.eos_token_id) if self.eos_token_id is not None else None,
            "add_bos_token": self.add_bos, "chat_template": self.chat_template,
        }))
        (path / "config.json").write_text(json.dumps({"bos_token_id": self.bos_token_id,
                                                      "eos_token_id": list(self.eos_token_ids)}))

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path, config: dict) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            from core.errors import ModelNotFoundError

            raise ModelNotFoundError(f"{path} has no tokenizer.json (servelab needs a fast tokenizer)")
        backend = HFTokenizer.from_file(str(tok_file))
        tc = {}
        if (path / "tokenizer_config.json").exists():
            tc = json.loads((path / "tokenizer_config.json").read_text())
        template = tc.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

        def token_id(v):
            if isinstance(v, dict):
                v = v.get("content")
            return backend.token_to_id(v) if isinstance(v, str) else None

        bos = token_id(tc.get("bos_token"))
        if bos is None:
            bos = config.get("bos_token_id")
        eos_ids = config.get("eos_token_id")
        eos_ids = list(eos_ids) if isinstance(eos_ids, list) else ([eos_ids] if eos_ids is not None else [])
        eos_tok = token_id(tc.get("eos_token"))
        if eos_tok is not None and eos_tok not in eos_ids:
            eos_ids.insert(0, eos_tok)
        gen = path / "generation_config.json"
        if gen.exists():
            g = json.loads(gen.read_text()).get("eos_token_id")
            for e in g if isinstance(g, list) else ([g] if g is not None else []):
                if e not in eos_ids:
                    eos_ids.append(e)
        # BOS is added by encode() itself; a tokenizer.json whose post-processor adds one asks for it too.
        post_adds_bos = bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
        add_bos = bool(tc.get("add_bos_token", False)) or post_adds_bos
        return cls(backend, bos_token_id=bos, eos_token_ids=eos_ids, add_bos=add_bos,
                   chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        if kind == "gpt2":
            backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
            pre = meta.get("tokenizer.ggml.pre", "default")
            if pre == "smollm":  # SmolLM's vocabulary splits digits one by one before GPT-2's regex
                backend.pre_tokenizer = pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(individual_digits=True),
                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
                )
            elif pre in _SPLITS:
                backend.pre_tokenizer = pre_tokenizers.Sequence(
                    [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
                )
            else:
                backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            backend.decoder = decoders.ByteLevel()
        elif kind == "llama":  # SentencePiece BPE written out as a vocabulary and merges
            backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                                             unk_token=tokens[meta.get("tokenizer.ggml.unknown_token_id", 0)]))
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
            backend.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
            )
        else:
            raise ValueError(f"GGUF tokenizer type '{kind}' is not supported (supported: gpt2, llama)")
        # Control tokens (type 3) and user-defined ones (type 4) are matched whole in text.
        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
        backend.add_special_tokens(specials)
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
        if user:
            backend.add_tokens(user)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos] if eos is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        template = meta.get("tokenizer.chat_template")
        # A chat model's turn ends with the template's end-of-turn token: stop there too.
        for candidate in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = vocab.get(candidate)
            if template and candidate in template and tid is not None and tid not in eos_ids:
                eos_ids.append(tid)
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=template,
        )


def _raise(message: str):
    raise RequestError(f"chat template: {message}")
