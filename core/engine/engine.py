"""The engine: requests in, outputs out. Built from a config; the step loop is `EngineCore`,
the text side is `OutputProcessor`.

add_request -> [EngineCore.step -> OutputProcessor.process]* -> request_finished observers
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from core.config.schema import EngineConfig
from core.engine.components import build_parts, require_shedding
from core.engine.core import EngineCore
from core.engine.output import OutputProcessor, RequestState
from core.engine.records import sequence_record
from core.engine.registry import get_registry
from core.engine.types import RequestOutput, SamplingParams, Sequence, SequenceStatus, StepStats
from core.errors import DeadlineError, RequestError


class Engine:
    def __init__(self, config: EngineConfig, loaded=None, registry=None) -> None:
        self.registry = registry or get_registry()
        parts = build_parts(config, self.registry, loaded)
        self.config, self.loaded, self.model, self.device = parts.config, parts.loaded, parts.model, parts.device
        self.tokenizer = parts.loaded.tokenizer
        self.kv_spec, self.quantizer, self.allocator = parts.kv_spec, parts.quantizer, parts.allocator
        self.attention, self.backend, self.scheduler, self.decoder = (parts.attention, parts.backend,
                                                                      parts.scheduler, parts.decoder)
        self.max_model_len = config.model.max_model_len
        self.hooks = self.registry.pm.hook
        self.core = EngineCore(parts.scheduler, parts.allocator, parts.backend, parts.decoder, parts.runner,
                               self.hooks, parts.context)
        self.output = OutputProcessor(self.tokenizer, detokenize=self.model is not None)
        self.name = config.model.name

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel ranks); a no-op otherwise."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    @property
    def name(self) -> str:
        """What the observers see this engine as (the server sets its served model name)."""
        return self.core.name

    @name.setter
    def name(self, value: str) -> None:
        self.core.name = value

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.output.requests

    @property
    def last_step(self) -> StepStats | None:
        """The stats of the most recent step (also sent to the step observers)."""
        return self.core.last_stats

    # ---- requests --------------------------------------------------------------------------

    def _prompt_ids(self, prompt, prompt_token_ids) -> tuple[str | None, list[int]]:
        if prompt_token_ids is None:
            if isinstance(prompt, list):
                prompt_token_ids, prompt = prompt, None
            elif isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            else:
                raise RequestError("a request needs a prompt or prompt_token_ids")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                               f"(prompt plus at least one output token)")
        vocab = self.loaded.args.vocab_size if self.model is not None else float("inf")  # simulated: any id
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
        return prompt, list(prompt_token_ids)

    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None, priority: int = 0,
                    arrival_time: float | None = None, shed: bool = False) -> str:
        """Queue a request; returns its id. `shed`: refuse it at once (DeadlineError) when the
        scheduler predicts it would miss its TTFT target."""
        params = params or SamplingParams()
        prompt, ids = self._prompt_ids(prompt, prompt_token_ids)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id '{request_id}' is already in use")
        now = self.core.context.clock() if arrival_time is None else arrival_time
        eos = tuple(self.tokenizer.eos_token_ids)
        seqs = [Sequence(request_id, ids, params, index=i, priority=priority, arrival_time=now, eos_token_ids=eos)
                for i in range(params.n)]
        if not self.allocator.can_admit(seqs[0]):
            raise RequestError(f"prompt of {len(ids)} tokens can never fit the KV cache "
                               f"({self.allocator.num_blocks} blocks of {self.allocator.block_size} tokens)")
        if shed:
            self._shed(seqs[0])
        self.output.add(request_id, prompt, ids, seqs)
        self.core.add(seqs)
        return request_id

    def _shed(self, seq: Sequence) -> None:
        require_shedding(self.config, "load shedding", self.registry)
        predicted, target = self.scheduler.predict_ttft(seq), self.scheduler.ttft_target(seq)
        if predicted > target:
            raise DeadlineError(f"the request would get its first token in about {predicted:.1f} s, past its "
                                f"TTFT target of {target:g} s; retry later", predicted, target)

    def abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        for seq in state.seqs:
            if not seq.is_finished:
                self.core.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._retire(state)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ---- the loop --------------------------------------------------------------------------

    def step(self, outputs: bool = True) -> list[RequestOutput]:
        """One scheduling step and one forward pass; returns the requests that changed (none with
        `outputs=False`: a driver that reads the records only skips building them)."""
        result = self.core.step()
        touched, stops = self.output.process(result.new_tokens)
        for seq, stop, extra in stops:
            self.core.finish(seq, SequenceStatus.FINISHED_STOPPED, stop, drop_tokens=extra)
        outputs = [self.output.output(state) for state in touched] if outputs else []
        for state in touched:
            if state.finished:
                self._retire(state)
        return outputs

    def _retire(self, state: RequestState) -> None:
        self.output.pop(state.request_id)
        self.hooks.servelab_request_finished(request_id=state.request_id, sequences=state.seqs,
                                             records=[sequence_record(s) for s in state.seqs], engine=self.name)

    # ---- convenience ------------------------------------------------------------------------

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion (offline batch); results in input order."""
        from tqdm import tqdm

        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm) as bar:
            while self.has_unfinished():
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]
