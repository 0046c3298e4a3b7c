"""The output processor: token ids to text, stop strings, and per-step deltas for streaming.

It owns everything textual about a request (vLLM V1's OutputProcessor); the engine core never
sees text. When a stop string appears it reports the sequence, and the engine ends it through
the scheduler, so sequence state keeps its one writer. While a sequence runs, a delta holds back
the end of its text that could still begin a stop string, so the streamed text is always the
final text, never a stop string's first half.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.engine.types import CompletionOutput, RequestOutput, Sequence, SequenceStatus


def stop_prefix_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (0: none)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


@dataclass
class Detokenized:
    """Incremental detokenization state of one sequence (vLLM's prefix/read offsets)."""

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    sent: int = 0  # characters of `text` already handed out as deltas


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    detok: dict[int, Detokenized] = field(default_factory=dict)  # seq id -> state
    deltas: dict[int, tuple[str, list[int]]] = field(default_factory=dict)  # sample index -> (text, ids)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize  # False: token ids only (a simulator's synthetic tokens have no text)
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], seqs: list[Sequence]) -> None:
        n = len(prompt_token_ids)
        state = RequestState(request_id, prompt, list(prompt_token_ids), seqs)
        for seq in seqs:
            state.detok[seq.seq_id] = Detokenized(prefix_offset=max(n - 5, 0), read_offset=n)
        self.requests[request_id] = state

    def process(self, new_tokens: list[tuple[Sequence, list[int]]]) -> tuple[list[RequestState], list[tuple]]:
        """Detokenize this step's tokens. Returns the requests that changed and the stop-string
        hits as (sequence, stop string, tokens after the hit to drop) triples, for the engine to end."""
        touched: dict[str, RequestState] = {}
        stops = []
        for seq, tokens in new_tokens:
            state = self.requests.get(seq.request_id)
            if state is None:
                continue
            touched[state.request_id] = state
            if not self.detokenize:
                prev_text, prev_ids = state.deltas.get(seq.index, ("", []))
                state.deltas[seq.index] = (prev_text, prev_ids + list(tokens))
                continue
            if len(tokens) == 1 or not seq.params.stop:
                hit = self._append_text(state, seq, tokens, seq.token_ids, seq.is_finished)
                if hit is not None:
                    stops.append((seq, hit, 0))
                continue
            # several tokens in one step (speculative decoding): one at a time, so a stop string
            # ends the output at the same token as plain decoding; the tokens after it are dropped
            ids = seq.token_ids
            first = len(ids) - len(tokens)
            for j, token in enumerate(tokens):
                last = j == len(tokens) - 1
                hit = self._append_text(state, seq, [token], ids[: first + j + 1], seq.is_finished and last)
                if hit is not None:
                    stops.append((seq, hit, len(tokens) - 1 - j))
                    break
        return list(touched.values()), stops

    def _append_text(self, state: RequestState, seq: Sequence, tokens: list[int], all_ids: list[int],
                     final: bool) -> str | None:
        d = state.detok[seq.seq_id]
        text, d.prefix_offset, d.read_offset = self.tokenizer.detokenize_incrementally(
            all_ids, d.prefix_offset, d.read_offset, final=final)
        old_len = len(d.text)
        full = d.text + text
        hit = None
        stops = seq.params.stop
        if text and stops and seq.status in (SequenceStatus.RUNNING, SequenceStatus.FINISHED_LENGTH):
            # A stop string may straddle the old and new text; the output is cut where it starts.
            window_start = max(0, old_len - max(len(s) for s in stops) + 1)
            hits = [(i, s) for s in stops if (i := full.find(s, window_start)) >= 0]
            if hits:
                cut, hit = min(hits)
                full = full[:cut]
        d.text = full
        done = hit is not None or final
        upto = len(full) if done or not stops else len(full) - stop_prefix_holdback(full, stops)
        prev_text, prev_ids = state.deltas.get(seq.index, ("", []))
        state.deltas[seq.index] = (prev_text + full[d.sent:upto], prev_ids + list(tokens))
        d.sent = max(d.sent, upto)
        return hit

    def output(self, state: RequestState) -> RequestOutput:
        """The request's outputs so far; its deltas are handed over and cleared."""
        outs = [CompletionOutput(s.index, state.detok[s.seq_id].text, list(s.output_token_ids),
                                 s.status.value if s.is_finished else None, list(s.output_logprobs))
                for s in state.seqs]
        out = RequestOutput(state.request_id, state.prompt_token_ids, outs, state.finished, dict(state.deltas))
        state.deltas.clear()
        return out

    def pop(self, request_id: str) -> RequestState | None:
        return self.requests.pop(request_id, None)
