"""Where the speculative decoder's guesses come from.

- `NgramProposer`: prompt lookup decoding. The context's last n tokens (n from
  `prompt_lookup_max` down to `prompt_lookup_min`) are looked up earlier in the same sequence
  (prompt and output); the tokens that followed the latest match are the draft. Free to compute,
  and right whenever the output copies its input (edits, quotes, code).
- `DraftProposer`: a smaller causal LM run beside the target on its own paged KV pool. Each
  target sequence has a shadow sequence in the draft's pool; before proposing, the shadow's
  computed tokens are cut back to what still agrees with the target's tokens (rejected drafts
  leave), the draft catches up on what the target emitted (its prompt, the first time), and then
  drafts k tokens one forward at a time for the whole batch.
- `layer_skip_model`: the target's first layers plus its final norm and head, sharing its weights:
  the `self` draft (no second file, no second copy of the weights).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from core.api import (
    ConfigError,
    ForwardContext,
    KVCacheSpec,
    ModelRunner,
    SamplingParams,
    ScheduledSeq,
    Sequence,
    load_model,
)
from plugins.decoders.sampling import apply_top_k_top_p, exponential_race, greedy_tokens


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    @staticmethod
    def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
        size = len(tokens)
        for n in range(min(max_n, size - 1), min_n - 1, -1):
            suffix = tokens[size - n:]
            last = suffix[-1]
            # scan candidate ends right to left: the latest match is the freshest context
            for end in range(size - 2, n - 2, -1):
                if tokens[end] == last and tokens[end - n + 1:end + 1] == suffix:
                    return tokens[end + 1:end + 1 + k]
        return []

    def propose(self, want: dict[Sequence, int]) -> dict[Sequence, tuple[list[int], None]]:
        return {seq: (self.lookup(seq.token_ids, k, self.min_n, self.max_n), None) for seq, k in want.items()}

    def idle(self, seqs: list[Sequence]) -> None:
        pass


class LayerSkipDraft(nn.Module):
    """The first `num_layers` decoder layers of `target`, then its final norm and head."""

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        self.target = [target]  # a list: not a submodule, so the target is not counted twice
        self.num_layers = num_layers

    def forward(self, input_ids, positions, meta=None, kv_caches=None, attention=None) -> torch.Tensor:
        t = self.target[0]
        ctx = ForwardContext(meta, kv_caches, attention)
        x, residual = t.model.embed_tokens(input_ids), None
        for i, layer in enumerate(t.model.layers[: self.num_layers]):
            x, residual = layer(x, residual, positions, t.rope, ctx, i)
        return t.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target[0].compute_logits(hidden)


def layer_skip_model(target: nn.Module, args, num_layers: int):
    return LayerSkipDraft(target, num_layers), dataclasses.replace(args, num_layers=num_layers)


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of a draft's floating weights (a layer-skip draft's live in its target)."""
    source = model.target[0] if isinstance(model, LayerSkipDraft) else model
    return next((p.dtype for p in source.parameters() if p.is_floating_point()), torch.float32)


class DraftProposer:
    """A draft model with its own KV pool, allocator, attention plan and runner."""

    def __init__(self, model: nn.Module, args, engine_config, registry, device, memory_gb: float, seed: int = 0):
        self.model, self.device = model, torch.device(device)
        mc, sc = engine_config.model, engine_config.scheduler
        dtype = torch.int8 if engine_config.cache.dtype == "int8" else _model_dtype(model)
        self.spec = KVCacheSpec(args.num_layers, args.num_kv_heads, args.head_dim, dtype, mc.max_model_len)
        pool = registry.config("cache", {"name": "paged", "block_size": 16, "memory_gb": memory_gb,
                                         "enable_prefix_caching": False})
        self.allocator = registry.create("cache", pool,
                                         spec=self.spec, max_num_seqs=sc.max_num_seqs, device=self.device)
        self.attention = registry.create("attention", engine_config.attention, device=self.device)
        backend_cfg = engine_config.backend
        if hasattr(backend_cfg, "cuda_graphs"):  # the draft's batches vary step to step; eager is enough
            backend_cfg = dataclasses.replace(backend_cfg, cuda_graphs=False)
        self.backend = registry.create("backend", backend_cfg, model=model, spec=self.spec, attention=self.attention,
                                       device=self.device, max_num_seqs=sc.max_num_seqs)
        self.backend.init_kv_cache(self.allocator.num_blocks, self.allocator.block_size)
        self.runner = ModelRunner(self.device, self.attention)
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        # target seq id -> (target, the draft's sequence, how many target tokens it was last given)
        self.shadows: dict[int, tuple[Sequence, Sequence, int]] = {}

    @classmethod
    def from_path(cls, path: str, engine_config, registry, device, vocab_size: int, memory_gb: float, seed: int = 0):
        loaded = load_model(path, engine_config.model.dtype, engine_config.model.max_model_len, torch.device(device))
        if loaded.args.vocab_size != vocab_size:
            raise ConfigError(f"decoder.draft_model has a vocabulary of {loaded.args.vocab_size} tokens, the target "
                              f"{vocab_size}: a draft must share the target's tokenizer")
        return cls(loaded.model, loaded.args, engine_config, registry, device, memory_gb, seed)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.stats().num_free_blocks

    def _drop(self, seq_id: int) -> None:
        _, shadow, _ = self.shadows.pop(seq_id)
        self.allocator.free(shadow)

    def idle(self, seqs: list[Sequence]) -> None:
        """No drafts this step: only let go of the shadows of sequences that ended."""
        for sid, (target, _, _) in list(self.shadows.items()):
            if target.is_finished:
                self._drop(sid)

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, its computed tokens cut back to the longest prefix that still agrees
        with the target's tokens (rejected drafts leave), its tokens set to the target's."""
        real = seq.token_ids
        if seq.seq_id not in self.shadows:
            shadow = Sequence(seq.request_id, real, SamplingParams(max_tokens=1 << 30, ignore_eos=True))
            self.shadows[seq.seq_id] = (seq, shadow, len(real))
            return shadow
        _, shadow, known = self.shadows[seq.seq_id]
        fed = shadow.prompt_token_ids
        limit = min(shadow.num_computed_tokens, len(real) - 1)  # the last token is always fed again
        common = min(known, limit)  # the target's tokens never change, so only the drafts after them can differ
        while common < limit and fed[common] == real[common]:
            common += 1
        if common < shadow.num_computed_tokens:
            shadow.num_computed_tokens = common
            self.allocator.truncate(shadow, common)
        shadow.prompt_token_ids = real
        self.shadows[seq.seq_id] = (seq, shadow, len(real))
        return shadow

    def _forward(self, rows: list[ScheduledSeq]) -> torch.Tensor:
        tables = [self.allocator.block_table(r.seq) for r in rows]
        batch = self.runner.prepare(rows, tables, self.allocator.block_size)
        return self.backend.execute(batch)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], torch.Tensor | None]:
        """The draft's token per row (greedy: argmax; sampled: from its own filtered distribution,
        whose probabilities the verifier needs)."""
        tokens = greedy_tokens(logits)
        probs = None
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            params = torch.tensor([[seqs[i].params.temperature, seqs[i].params.top_k, seqs[i].params.top_p]
                                   for i in sampled], device=logits.device)
            z = logits.index_select(0, idx).float() / params[:, :1]
            if (params[:, 1] > 0).any() or (params[:, 2] < 1).any():
                z = apply_top_k_top_p(z, params[:, 1].long(), params[:, 2])
            probs = torch.zeros_like(logits, dtype=torch.float32)
            probs[idx] = z.softmax(dim=-1)
            noise = torch.empty_like(probs[idx]).exponential_(generator=self.generator)
            tokens[idx] = exponential_race(probs[idx], noise)
        return tokens.tolist(), probs

    @torch.inference_mode()
    def propose(self, want: dict[Sequence, int]) -> dict[Sequence, tuple[list[int], torch.Tensor | None]]:
        self.idle([])
        rows = []
        for seq, k in want.items():
            shadow = self._sync(seq)
            new = shadow.num_tokens - shadow.num_computed_tokens
            if not self.allocator.allocate(shadow, new + k - 1):  # its catch-up and k - 1 more drafts
                self._drop(seq.seq_id)  # no room in the draft's pool: this sequence goes undrafted
                continue
            rows.append((seq, shadow, k, new))
        out: dict[Sequence, tuple[list[int], list[torch.Tensor] | None]] = {}
        step = [ScheduledSeq(shadow, new) for _, shadow, _, new in rows]
        active = rows
        while active:
            tokens, probs = self._draw(self._forward(step), [seq for seq, *_ in active])
            nxt_rows, nxt_step = [], []
            for j, ((seq, shadow, k, _), s) in enumerate(zip(active, step)):
                shadow.num_computed_tokens += s.num_new_tokens
                toks, qs = out.setdefault(seq, ([], [] if not seq.params.greedy else None))
                toks.append(tokens[j])
                if qs is not None:
                    qs.append(probs[j])
                shadow.prompt_token_ids.append(tokens[j])  # its own list, a copy of the target's tokens
                if len(toks) < k:
                    nxt_rows.append((seq, shadow, k, 1))
                    nxt_step.append(ScheduledSeq(shadow, 1))
            active, step = nxt_rows, nxt_step
        return {seq: (toks, torch.stack(qs) if qs else None) for seq, (toks, qs) in out.items()}
