"""Decoder `sampling`: greedy, temperature, top-k and top-p, with per-request seeds."""

from __future__ import annotations

import torch

from core.config import DecoderConfig
from core.plugins import hookimpl
from core.types import ScheduledSeq, Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what lies outside each row's top-k and top-p nucleus.

    logits [N, V]; top_k [N] (0 = keep all); top_p [N] in (0, 1]. The nucleus is the smallest set
    of most likely tokens whose probability reaches top_p; the most likely token is always kept.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class SamplingDecoder:
    def __init__(self, config: DecoderConfig, vocab_size: int, seed: int = 0) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed

    def propose(self, scheduled: list[ScheduledSeq]) -> None:
        return None

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.generator is None:
            # Each of the n samples of a seeded request gets its own reproducible stream.
            seq.generator = torch.Generator().manual_seed(seq.params.seed + seq.index)
        return seq.generator

    def accept(self, logits: torch.Tensor, scheduled: list[ScheduledSeq], proposals) -> dict[int, list[int]]:
        """`logits` has one row per scheduled sequence that samples this step, in order."""
        seqs = [s.seq for s in scheduled if s.needs_sample]
        if not seqs:
            return {}
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            temps = torch.tensor([seqs[i].params.temperature for i in sampled_rows])
            top_k = torch.tensor([seqs[i].params.top_k for i in sampled_rows])
            top_p = torch.tensor([seqs[i].params.top_p for i in sampled_rows])
            probs = apply_top_k_top_p(logits[rows] / temps[:, None], top_k, top_p).softmax(dim=-1)
            for j, i in enumerate(sampled_rows):
                tokens[i] = torch.multinomial(probs[j], 1, generator=self._generator(seqs[i]))[0]
        chosen = tokens.tolist()
        want_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if want_logprobs:
            logprobs = logits[want_logprobs].log_softmax(dim=-1)
            for j, i in enumerate(want_logprobs):
                top = logprobs[j].topk(seqs[i].params.logprobs) if seqs[i].params.logprobs else None
                seqs[i].output_logprobs.append({
                    "token_id": chosen[i],
                    "logprob": logprobs[j, chosen[i]].item(),
                    "top": list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
                })
        return {s.seq_id: [t] for s, t in zip(seqs, chosen)}


@hookimpl
def servelab_decoders():
    return {"sampling": SamplingDecoder}
