"""Decoder `speculative`: a cheap proposer guesses up to k tokens per sequence, the target model
checks them all in one forward, and the output is what the target alone would produce (greedy:
token for token; sampled: the same distribution, by rejection sampling).

The step, as in vLLM V1:
- after step N, `propose` drafts up to k tokens for each running decode; the scheduler keeps
  them on the sequence (`spec_token_ids`) and schedules 1 + k query tokens for it in step N+1,
  mixed with ordinary decodes and prefill chunks (a short budget trims the drafts);
- step N+1's forward returns logits at all 1 + k positions; `accept` keeps the drafts up to the
  first one the target rejects, plus the target's own token there (or a bonus token after a
  fully accepted run), so every verify step emits between 1 and k + 1 tokens;
- the scheduler rolls the sequence's computed tokens back to what was kept and gives the rejected
  positions' KV back to the allocator (`truncate`).

Methods (`decoder.method`): `ngram` (prompt lookup: the tokens that followed the latest earlier
occurrence of the context's last n-gram, in the prompt or the output; no second model), `draft`
(a second model sharing the tokenizer, `decoder.draft_model=DIR_OR_GGUF`, with its own paged KV),
`self` (the target as its own draft without a second file: by default its INT4 copy, `gguf`'s
own blocks for a GGUF file; with `decoder.draft_layers=N` its first N layers with its final norm
and head instead, a layer-skip draft that shares its weights).

k adapts per sequence (`decoder.adaptive`): after a verify that kept `a` drafts the next proposal
is at most a + 1 long, so a sequence whose guesses fail stops paying for long verifies, and one
whose guesses hold grows back to k. Under load speculation turns itself off: with
`decoder.disable_by_batch_size` or more sequences running no drafts are proposed (vLLM's
`speculative_disable_by_batch_size`), because verifying k extra tokens per row costs real compute
once the batch is large.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from core.api import (
    ConfigError,
    DecoderConfig,
    DecoderOutput,
    ScheduledSeq,
    Sequence,
    fuse_projections,
    hookimpl,
    load_weights,
)
from plugins.decoders.proposers import DraftProposer, NgramProposer, layer_skip_model
from plugins.decoders.sampling import SamplingDecoder, apply_top_k_top_p, exponential_race, greedy_tokens

METHODS = ("ngram", "draft", "self")


@dataclass
class SpeculativeDecoderConfig(DecoderConfig):
    method: str = "ngram"  # ngram | draft | self
    num_speculative_tokens: int = 4  # k: the most drafts per sequence per step
    adaptive: bool = True  # the next proposal is at most (drafts kept last time) + 1 long
    disable_by_batch_size: int = 16  # no drafts while this many sequences run (0: never off)
    prompt_lookup_max: int = 4  # ngram: the longest suffix n-gram looked up
    prompt_lookup_min: int = 2  # ngram: the shortest
    draft_model: str = ""  # draft: DIR_OR_GGUF of a model with the target's tokenizer
    draft_layers: int = 0  # self: draft with the target's first N layers (layer skip); 0: its quantized copy
    draft_quant: str = "auto"  # self, quantized copy: a quant plugin (auto: gguf for a GGUF file, else int4)
    draft_memory_gb: float = 0.25  # draft and self: the draft's own KV pool


@dataclass
class VerifyResult:
    """Per sequence: the emitted tokens and how many of its drafts were kept."""

    tokens: list[list[int]]
    accepted: list[int]
    offsets: list[int]  # sequence i's logits rows are offsets[i]:offsets[i + 1]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft's replacement comes from: max(p - q, 0), unnormalized (the
    exponential race draws from it as if normalized)."""
    return (p - q).clamp(min=0)


def verify(logits: torch.Tensor, num_drafts: list[int], drafts: list[list[int]], greedy: list[bool],
           temperature: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
           top_p: torch.Tensor | None = None, draft_probs: list[torch.Tensor | None] | None = None,
           uniform: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> VerifyResult:
    """Check every sequence's drafts against the target's logits, in one pass over the batch.

    logits [R, V] holds, per sequence in order, 1 + d rows (d = num_drafts[i]): the target's
    distribution after each prefix, last real token first. Greedy rows keep drafts while they
    equal the target's argmax. Sampled rows (temperature, top_k, top_p given per row) keep draft
    x at a position with probability min(1, p(x) / q(x)) (uniform[r] decides), where q is the
    draft's own distribution (draft_probs[i], [d, V]; None for a deterministic proposer such as
    n-gram lookup: q is one-hot, so the test is u < p(x)); at the first rejection the token is
    drawn from max(p - q, 0) renormalized, after a full run the bonus token from p. This is the
    rule of Leviathan et al. and Chen et al. (2023): the emitted tokens follow the target's
    distribution exactly. noise [R, V] (Exp(1) draws) picks those tokens. One host sync.
    """
    offsets = [0]
    for d in num_drafts:
        offsets.append(offsets[-1] + d + 1)
    flat = torch.tensor([t for ds, d in zip(drafts, num_drafts) for t in ds[:d] + [-1]], device=logits.device)
    choice = greedy_tokens(logits)
    keep = choice == flat
    rows = [r for i, g in enumerate(greedy) if not g for r in range(offsets[i], offsets[i + 1])]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        z = logits.index_select(0, idx).float() / temperature[idx, None]
        if top_k is not None and ((top_k[idx] > 0).any() or (top_p[idx] < 1).any()):
            z = apply_top_k_top_p(z, top_k[idx], top_p[idx])
        p = z.softmax(dim=-1)
        q = torch.zeros_like(p)
        row_of = {r: j for j, r in enumerate(rows)}
        for i, g in enumerate(greedy):
            if g or not num_drafts[i]:
                continue
            first = row_of[offsets[i]]
            d = num_drafts[i]
            if draft_probs is not None and draft_probs[i] is not None:
                q[first:first + d] = draft_probs[i][:d].to(q.dtype)
            else:  # a deterministic draft: all its mass on the drafted token
                q[torch.arange(first, first + d), flat[idx[first:first + d]]] = 1.0
        x = flat[idx].clamp(min=0)
        px, qx = p.gather(1, x[:, None])[:, 0], q.gather(1, x[:, None])[:, 0]
        accept = (uniform[idx] * qx < px) & (flat[idx] >= 0)
        residual = residual_distribution(p, q)
        last = flat[idx] < 0  # the row after a sequence's last draft: its bonus token comes from p
        residual[last] = p[last]
        keep[idx] = accept
        choice[idx] = exponential_race(residual, noise[idx].clone())
    host = torch.cat([choice, keep.long()]).tolist()  # the verify's one host sync
    n = len(host) // 2
    tokens, kept = [], []
    for i, d in enumerate(num_drafts):
        r0 = offsets[i]
        a = 0
        while a < d and host[n + r0 + a]:
            a += 1
        tokens.append(drafts[i][:a] + [host[r0 + a]])
        kept.append(a)
    return VerifyResult(tokens, kept, offsets)


def quantized_copy(engine_config, registry, device, quant: str):
    """The target's weights loaded again and quantized (INT4): a draft that agrees with the target
    most of the time and, at batch 1 on a CPU, decodes about twice as fast as bf16."""
    loaded = load_weights(engine_config, device)
    if quant == "auto":
        quant = "gguf" if str(loaded.source).endswith(".gguf") else "int4"
    quantizer = registry.create("quant", registry.config("quant", {"name": quant}), tokenizer=loaded.tokenizer,
                                source=loaded.source)
    return fuse_projections(quantizer.quantize(loaded.model)), loaded.args


class SpeculativeDecoder(SamplingDecoder):
    config_class = SpeculativeDecoderConfig

    def __init__(self, config: SpeculativeDecoderConfig, vocab_size: int, seed: int = 0, model=None,
                 model_args=None, engine_config=None, registry=None, device=None) -> None:
        super().__init__(config, vocab_size, seed)
        if config.method not in METHODS:
            raise ConfigError(f"decoder.method must be one of {', '.join(METHODS)}, got '{config.method}'")
        if config.num_speculative_tokens < 1:
            raise ConfigError(f"decoder.num_speculative_tokens must be at least 1, got {config.num_speculative_tokens}")
        self.k = config.num_speculative_tokens
        self.max_model_len = engine_config.model.max_model_len if engine_config is not None else 1 << 30
        self._next_k: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._draft_probs: dict[int, torch.Tensor] = {}  # seq id -> q of its pending drafts
        self.num_drafts = 0  # verify rows (sequences with at least one draft)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
        if config.method == "ngram":
            if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
                raise ConfigError("decoder.prompt_lookup_min must be between 1 and decoder.prompt_lookup_max")
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "draft":
            if not config.draft_model:
                raise ConfigError("decoder.method=draft needs decoder.draft_model=DIR_OR_GGUF (a model with the "
                                  "target's tokenizer)")
            self.proposer = DraftProposer.from_path(config.draft_model, engine_config, registry, device, vocab_size,
                                                    config.draft_memory_gb, seed)
        else:
            if model is None:
                raise ConfigError("decoder.method=self needs the target model")
            layers = len(model.model.layers)
            if config.draft_layers:
                if not 1 <= config.draft_layers < layers:
                    raise ConfigError(f"decoder.draft_layers must be between 1 and {layers - 1} (the target has "
                                      f"{layers} layers), or 0 for a quantized copy; got {config.draft_layers}")
                draft, draft_args = layer_skip_model(model, model_args, config.draft_layers)
            else:
                draft, draft_args = quantized_copy(engine_config, registry, device, config.draft_quant)
            self.proposer = DraftProposer(draft, draft_args, engine_config, registry, device, config.draft_memory_gb,
                                          seed)

    # ---- proposing, after a step ----------------------------------------------------------

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """Drafts for the running sequences past their prompt, seq id -> tokens (absent: no
        draft this step). `seqs`: every running sequence, so the batch-size switch sees them all."""
        limit = self.config.disable_by_batch_size
        if not seqs or (limit and len(seqs) >= limit):
            self._draft_probs.clear()
            self.proposer.idle(seqs)
            return {}
        want = {}
        for seq in seqs:
            if seq.in_prefill or seq.is_finished:
                continue
            # never draft past max_tokens or max_model_len: those tokens could never be emitted
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = min(self._next_k.get(seq, self.k) if self.config.adaptive else self.k, room)
            if k > 0:
                want[seq] = k
        proposals = self.proposer.propose(want)
        self._draft_probs = {s.seq_id: q for s, (_, q) in proposals.items() if q is not None}
        return {s.seq_id: toks for s, (toks, _) in proposals.items() if toks}

    # ---- verifying, after the forward ----------------------------------------------------------

    def accept(self, logits: torch.Tensor, scheduled: list[ScheduledSeq], proposals=None) -> DecoderOutput:
        if not any(s.num_draft_tokens for s in scheduled):
            return super().accept(logits, scheduled, proposals)
        seqs = [s.seq for s in scheduled]
        num_drafts = [s.num_draft_tokens for s in scheduled]
        drafts = [s.seq.spec_token_ids[:d] for s, d in zip(scheduled, num_drafts)]
        greedy = [s.params.greedy for s in seqs]
        dev = logits.device
        kw = {}
        if not all(greedy):
            per_row = [(s.params.temperature or 1.0, s.params.top_k, s.params.top_p)
                       for s, d in zip(seqs, num_drafts) for _ in range(d + 1)]
            params = torch.tensor(per_row, device=dev)
            uniform = torch.empty(len(per_row), device=dev)
            noise = torch.empty(len(per_row), logits.shape[-1], device=dev)
            uniform.uniform_(generator=self._shared_generator(dev))
            noise.exponential_(generator=self._shared_generator(dev))
            r = 0
            for s, d in zip(seqs, num_drafts):  # a seeded request draws from its own stream
                if s.params.seed is not None:
                    gen = self._generator(s, dev)
                    uniform[r:r + d + 1].uniform_(generator=gen)
                    noise[r:r + d + 1].exponential_(generator=gen)
                r += d + 1
            kw = dict(temperature=params[:, 0], top_k=params[:, 1].long(), top_p=params[:, 2], uniform=uniform,
                      noise=noise, draft_probs=[self._draft_probs.get(s.seq_id) for s in seqs])
        result = verify(logits.float(), num_drafts, drafts, greedy, **kw)
        out = DecoderOutput({s.seq_id: toks for s, toks in zip(seqs, result.tokens)})
        offsets = result.offsets
        for i, (s, d, a) in enumerate(zip(seqs, num_drafts, result.accepted)):
            if d:
                out.spec[s.seq_id] = (d, a)
                self.num_drafts += 1
                self.num_draft_tokens += d
                self.num_accepted_tokens += a
                for pos in range(a):
                    self.accepted_per_pos[pos] += 1
                self._next_k[s] = min(self.k, a + 1)
            if s.params.logprobs is not None:
                lp = logits[offsets[i]:offsets[i + 1]].float().log_softmax(dim=-1)
                k = s.params.logprobs
                entries = []
                for j, t in enumerate(result.tokens[i]):  # token j was chosen from the target's row j
                    top = lp[j].topk(k) if k else None
                    entries.append({"token_id": t, "logprob": lp[j, t].item(),
                                    "top": list(zip(top.indices.tolist(), top.values.tolist())) if top is not None
                                    else []})
                out.logprobs[s.seq_id] = entries
        return out

    def metrics(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
        return {"method": self.config.method, "num_speculative_tokens": self.k, "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": rate,
                "mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None,
                "accepted_per_pos": list(self.accepted_per_pos)}


@hookimpl
def servelab_decoders():
    return {"speculative": SpeculativeDecoder}
