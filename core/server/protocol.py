"""OpenAI's wire format: typed request bodies in, response bodies and SSE chunks out.

A body is validated once into these models; the handler reads their fields, never the raw JSON.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.engine.types import MAX_N, RequestOutput, SamplingParams

MAX_LOGPROBS = 20  # vLLM's max_logprobs default


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share (unknown OpenAI fields are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None  # a served model (see /v1/models); None: the main one
    max_tokens: int | None = Field(None, ge=1)  # None: 16
    temperature: float | None = Field(None, ge=0, le=2)  # None: 1
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: no top-k filter (vLLM accepts both)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int | None = None
    # servelab's extra fields: this request's service-level targets (None: its pool's, else the scheduler's)
    slo_ttft_s: float | None = Field(None, gt=0)
    slo_tpot_s: float | None = Field(None, gt=0)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises RequestError on a value the engine refuses."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0), seed=self.seed,
            n=1 if self.n is None else self.n, stop=stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
            slo_ttft_s=self.slo_ttft_s, slo_tpot_s=self.slo_tpot_s,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    """The body of /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text ones
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """The body of /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


# ---- responses ---------------------------------------------------------------------------------


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(tokenizer, entries: list[dict]) -> dict:
    return {
        "tokens": [tokenizer.decode([e["token_id"]], skip_special_tokens=False) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in e["top"]} for e in entries],
        "text_offset": [],
    }


def chat_logprobs(tokenizer, entries: list[dict]) -> dict:
    def one(tid, lp):
        tok = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {"content": [{**one(e["token_id"], e["logprob"]), "top_logprobs": [one(t, lp) for t, lp in e["top"]]}
                        for e in entries]}


def choice(chat: bool, stream: bool, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    """One choice, in a response (`message` / `text`) or in a stream chunk (`delta` / `text`)."""
    if chat and stream:
        body = {"delta": {"content": text} if text else {}}
    elif chat:
        body = {"message": {"role": "assistant", "content": text}}
    else:
        body = {"text": text}
    return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}


def choice_logprobs(tokenizer, chat: bool, entries: list[dict]) -> dict:
    return chat_logprobs(tokenizer, entries) if chat else completion_logprobs(tokenizer, entries)


def response(finals: list[RequestOutput], n: int, want_logprobs: bool, chat: bool, rid: str, created: int, model: str,
             tokenizer) -> dict:
    choices = []
    for i, out in enumerate(finals):
        for o in out.outputs:
            lp = choice_logprobs(tokenizer, chat, o.logprobs) if want_logprobs else None
            choices.append(choice(chat, False, i * n + o.index, o.text, o.finish_reason, lp))
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(finals)}


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def chunk(chat: bool, rid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None) -> str:
    d = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
         "model": model, "choices": choices}
    if usage_ is not None:
        d["usage"] = usage_
    return sse(d)


def delta_choices(out: RequestOutput, sub: int, n: int, chat: bool, tokenizer, want_logprobs: bool,
                  sent_logprobs: dict) -> list[dict]:
    """The choices of one stream chunk: what `out` added since the last one."""
    choices = []
    for o in out.outputs:
        text, _ids = out.deltas.get(o.index, ("", []))
        if not text and o.finish_reason is None:
            continue
        lp = None
        if want_logprobs:
            start = sent_logprobs.get((sub, o.index), 0)
            sent_logprobs[(sub, o.index)] = len(o.logprobs)
            lp = choice_logprobs(tokenizer, chat, o.logprobs[start:])
        choices.append(choice(chat, True, sub * n + o.index, text, o.finish_reason, lp))
    return choices


def error_body(message: str, kind: str, param: str | None, code) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

