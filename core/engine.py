"""The engine loop: the one place that calls the components in order.

add_request -> [schedule -> attention metadata -> execute -> decode -> postprocess]* -> free
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from core.config import EngineConfig
from core.errors import ConfigError, RequestError
from core.loader import DTYPES, LoadedModel, load_model
from core.metrics import request_metrics
from core.plugins import get_registry

log = logging.getLogger("servelab")

from core.types import (  # noqa: E402
    CompletionOutput,
    KVCacheSpec,
    ModelInput,
    RequestOutput,
    SamplingParams,
    ScheduledSeq,
    Sequence,
    SequenceStatus,
    StepStats,
)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    deltas: dict[int, tuple[str, list[int]]] = field(default_factory=dict)
    unforked: list[Sequence] = field(default_factory=list)  # samples 1..n-1, forked after the prompt's prefill

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def resolve_model_path(config: EngineConfig) -> str:
    if config.model.path:
        return config.model.path
    if config.model.name == "smollm2-135m":
        from core.default_model import default_model_path

        return str(default_model_path())
    raise ConfigError(f"model '{config.model.name}' has no path; set model.path=DIR_OR_GGUF")


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, registry=None) -> None:
        self.config = config
        self.registry = registry or get_registry()
        # Check every component name before the (slow) model load.
        for kind in ("scheduler", "cache", "quant", "decoder", "backend"):
            self.registry.get(kind, getattr(config, kind).name)
        if getattr(self.registry.get("backend", config.backend.name).factory, "is_peer", False):
            raise ConfigError(f"backend '{config.backend.name}' is a benchmark peer: use it with `run` or `compare`")
        torch.manual_seed(config.seed)
        mc = config.model
        if loaded is None:
            loaded = load_model(resolve_model_path(config), mc.dtype, mc.max_model_len)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.max_model_len = mc.max_model_len
        args = loaded.args
        self.quantizer = self.registry.create("quant", config.quant.name, config=config.quant,
                                              tokenizer=loaded.tokenizer, source=loaded.source)
        model = self.quantizer.quantize(loaded.model)
        kv_dtype = torch.int8 if config.cache.dtype == "int8" else DTYPES[mc.dtype]
        self.kv_spec = KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, kv_dtype, mc.max_model_len)
        self.allocator = self.registry.create(
            "cache", config.cache.name, config=config.cache, spec=self.kv_spec,
            max_num_seqs=config.scheduler.max_num_seqs,
        )
        self.backend = self.registry.create("backend", config.backend.name, config=config.backend, model=model,
                                            spec=self.kv_spec)
        self.backend.init_kv_cache(self.allocator.num_blocks, self.allocator.block_size)
        if hasattr(self.allocator, "describe"):
            log.info(self.allocator.describe())
        self.scheduler = self.registry.create("scheduler", config.scheduler.name, config=config.scheduler,
                                              allocator=self.allocator)
        self.decoder = self.registry.create("decoder", config.decoder.name, config=config.decoder,
                                            vocab_size=args.vocab_size, seed=config.seed)
        self.hooks = self.registry.pm.hook
        self.requests: dict[str, RequestState] = {}
        self.step_count = 0

    # ---- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        params = params or SamplingParams()
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
            raise RequestError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len} "
                f"(prompt plus at least one output token)"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.loaded.args.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {self.loaded.args.vocab_size})")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise RequestError(f"request id '{request_id}' is already in use")
        now = time.perf_counter() if arrival_time is None else arrival_time
        eos = self.tokenizer.eos_token_ids
        seqs = [
            Sequence(request_id, prompt_token_ids, params, index=i, priority=priority, arrival_time=now,
                     eos_token_id=eos[0] if eos else None)
            for i in range(params.n)
        ]
        for seq in seqs:
            if not self.allocator.can_admit(seq):
                raise RequestError(
                    f"prompt of {seq.num_prompt_tokens} tokens can never fit the KV cache "
                    f"({self.allocator.num_blocks} blocks of {self.allocator.block_size} tokens)"
                )
        n = len(prompt_token_ids)
        # With an allocator that can fork, the n samples share one prefill of the prompt.
        share = len(seqs) > 1 and getattr(self.allocator, "supports_fork", False)
        for seq in seqs:
            seq.prefix_offset, seq.read_offset = max(n - 5, 0), n
        for seq in seqs[:1] if share else seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = RequestState(request_id, prompt, list(prompt_token_ids), seqs,
                                                 unforked=seqs[1:] if share else [])
        return request_id

    def abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        for seq in state.seqs:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        self._retire(state)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step and one forward pass; returns the requests that changed."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        for seq in out.preempted:
            seq.num_preemptions += 1
        if not out.scheduled:
            if self.scheduler.has_unfinished() and not out.preempted:
                raise RuntimeError("scheduler made no progress with work pending")
            return []
        scheduled = out.scheduled
        for s in scheduled:
            if s.seq.timings.first_scheduled is None:
                s.seq.timings.first_scheduled = t0
        proposals = self.decoder.propose(scheduled)
        batch = self._model_input(scheduled)
        self.backend.copy_blocks(self.allocator.take_block_copies())
        logits = self.backend.execute(batch)
        sampling = [s for s in scheduled if s.needs_sample]
        now = time.perf_counter()
        num_prefill = num_decode = 0
        for s in scheduled:
            seq = s.seq
            if seq.in_prefill:
                num_prefill += s.num_new_tokens
            else:
                num_decode += s.num_new_tokens
            seq.num_computed_tokens += s.num_new_tokens
            if seq.timings.prefill_done is None and not seq.in_prefill:
                seq.timings.prefill_done = now
        forked = self._fork_samples(sampling, now)
        if forked:  # each forked sample draws its first token from its parent's logits row
            rows = [sampling.index(parent) for parent, _ in forked]
            logits = torch.cat([logits, logits[rows]])
            sampling = sampling + [child for _, child in forked]
        accepted = self.decoder.accept(logits, sampling, proposals)
        now = time.perf_counter()
        touched: dict[str, RequestState] = {}
        for s in sampling:
            seq = s.seq
            state = self.requests[seq.request_id]
            for token in accepted.get(seq.seq_id, []):
                if seq.is_finished:
                    break
                self._append(seq, token, now, state)
            touched[state.request_id] = state
        for _, child in forked:
            if not child.seq.is_finished:
                self.scheduler.add(child.seq)
        outputs = [self._output(state) for state in touched.values()]
        for state in touched.values():
            if state.finished:
                self._retire(state)
        self.step_count += 1
        stats = self.allocator.stats()
        qlens, ctxs = batch.attn.query_lens.tolist(), batch.attn.context_lens.tolist()
        self.hooks.servelab_step_finished(step_stats=StepStats(
            step=self.step_count, time=now, duration_s=now - t0,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_preempted=len(out.preempted), num_prefill_tokens=num_prefill, num_decode_tokens=num_decode,
            kv_usage=stats.usage, prefix_queries=stats.prefix_queries, prefix_hits=stats.prefix_hits,
            num_seqs=len(scheduled), num_sampled=len(sampling), kv_tokens_read=sum(ctxs),
            attn_pairs=sum(q * (c - (q - 1) / 2) for q, c in zip(qlens, ctxs)),
        ))
        return outputs

    def _fork_samples(self, sampling: list[ScheduledSeq], now: float) -> list[tuple[ScheduledSeq, ScheduledSeq]]:
        """Fork the waiting samples of requests whose prompt just finished prefilling."""
        forked = []
        for s in sampling:
            state = self.requests[s.seq.request_id]
            if not state.unforked or s.seq.num_output_tokens:
                continue
            for child in state.unforked:
                self.allocator.fork(s.seq, child)
                child.status = SequenceStatus.RUNNING
                child.timings.first_scheduled = s.seq.timings.first_scheduled
                child.timings.prefill_done = now
                forked.append((s, ScheduledSeq(child, 0)))
            state.unforked = []
        return forked

    def _model_input(self, scheduled: list[ScheduledSeq]) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            ids.extend(s.seq.token_ids[start : start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
            if s.needs_sample:
                logits_indices.append(len(ids) - 1)
        return ModelInput(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            attn=self.allocator.attention_metadata(scheduled),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        )

    def _append(self, seq: Sequence, token: int, now: float, state: RequestState) -> None:
        seq.output_token_ids.append(token)
        if seq.timings.first_token is None:
            seq.timings.first_token = now
        seq.timings.token_times.append(now)
        all_ids = seq.token_ids
        p = seq.params
        status = None
        if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, None
        elif token in p.stop_token_ids:
            status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            status = SequenceStatus.FINISHED_LENGTH
        text, seq.prefix_offset, seq.read_offset = self.tokenizer.detokenize_incrementally(
            all_ids, seq.prefix_offset, seq.read_offset, final=status is not None
        )
        old_len = len(seq.output_text)
        full = seq.output_text + text
        if text and p.stop and (status is None or status is SequenceStatus.FINISHED_LENGTH):
            # A stop string may straddle the old and new text; the output is cut where it starts.
            window_start = max(0, old_len - max(len(s) for s in p.stop) + 1)
            hits = [(i, s) for s in p.stop if (i := full.find(s, window_start)) >= 0]
            if hits:
                cut, seq.stop_reason = min(hits)
                full = full[:cut]
                status = SequenceStatus.FINISHED_STOPPED
        text = full[old_len:]
        seq.output_text = full
        prev_text, prev_ids = state.deltas.get(seq.index, ("", []))
        state.deltas[seq.index] = (prev_text + text, prev_ids + [token])
        if status is not None:
            self._finish(seq, status, now)

    def _finish(self, seq: Sequence, status: SequenceStatus, now: float | None = None) -> None:
        seq.status = status
        seq.timings.finished = time.perf_counter() if now is None else now
        self.scheduler.finish(seq)

    def _output(self, state: RequestState) -> RequestOutput:
        outs = [
            CompletionOutput(s.index, s.output_text, list(s.output_token_ids),
                             s.status.value if s.is_finished else None, list(s.output_logprobs))
            for s in state.seqs
        ]
        out = RequestOutput(state.request_id, state.prompt_token_ids, outs, state.finished, dict(state.deltas))
        state.deltas.clear()
        return out

    def _retire(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        self.hooks.servelab_request_finished(
            request_id=state.request_id, sequences=state.seqs, metrics=[request_metrics(s) for s in state.seqs]
        )

    # ---- convenience ------------------------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion (offline batch); results in input order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]
