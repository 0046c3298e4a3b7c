"""The contracts of the hooked components, checked when a plugin is loaded.

Each kind has a Protocol of required members. Optional capabilities (fork, copy-on-write,
describe, truncate) are declared by the plugin in `capabilities` and then their members are
required too; the engine asks `has_capability` instead of probing with `hasattr`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol

from core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from core.engine.types import (
        CacheStats,
        DecoderOutput,
        KVCacheSpec,
        ScheduledSeq,
        SchedulerOutput,
        Sequence,
        SequenceStatus,
    )
    from core.runner.metadata import AttentionMetadata, ModelInput


class CacheAllocator(Protocol):
    """Owns the KV pool's bookkeeping: which blocks belong to which sequence. It hands out block
    ids; the model runner turns them into the model's inputs. It never writes a Sequence."""

    spec: KVCacheSpec
    num_blocks: int
    block_size: int
    capabilities: frozenset[str]

    def can_admit(self, seq: Sequence) -> bool:
        """Could this sequence ever fit if the pool were empty?"""

    def match_prefix(self, seq: Sequence) -> int:
        """Leading tokens of a fresh sequence already cached (a lookup: nothing is taken)."""

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Reserve room for tokens [num_computed, num_computed + num_new_tokens); False if there
        is none. Nothing changes when it fails."""

    def block_table(self, seq: Sequence) -> list[int]:
        """The blocks holding the sequence's tokens, in order (token p is in block p // block_size)."""

    def free(self, seq: Sequence) -> None: ...

    def stats(self) -> CacheStats: ...


class SupportsFork(Protocol):
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (n > 1 samples of one prompt)."""


class SupportsCopyOnWrite(Protocol):
    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies owed before the next forward."""


class SupportsTruncate(Protocol):
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens' KV (the caller sets num_computed_tokens)."""


class SupportsDescribe(Protocol):
    def describe(self) -> str:
        """One line of pool arithmetic for the start-up log and the reports."""


class SupportsCudaGraphs(Protocol):
    """An attention backend whose decode-only `plan` makes no tensor and whose kernels' launch
    shapes depend only on the batch size: a decode step through it can be captured in a CUDA graph."""


class Scheduler(Protocol):
    """Picks each step's batch and is the one writer of sequence state (`update_from_output`)."""

    def add(self, seq: Sequence) -> None: ...

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch; reserves KV through the allocator."""

    def update_from_output(self, output: SchedulerOutput, decoded: DecoderOutput, now: float) -> list[Sequence]:
        """After the forward: advance computed tokens, append accepted tokens, finish the ones that
        stop. Returns the sequences that finished."""

    def fork(self, row: ScheduledSeq, children: list[Sequence]) -> list[ScheduledSeq]:
        """Children join the running set sharing the KV of the parent (`row`, scheduled this step);
        returns their rows for this step."""

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: str | int | None = None,
               drop_tokens: int = 0) -> None:
        """End a sequence (stop string, abort, ...): drop it and free its KV."""

    def has_unfinished(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...


class SupportsDeadlines(Protocol):
    """A scheduler that knows each request's TTFT target and can predict when a new request would
    get its first token: the engine can then refuse at once what cannot make it (load shedding)."""

    def ttft_target(self, seq: Sequence) -> float: ...

    def predict_ttft(self, seq: Sequence) -> float:
        """Seconds from now to the first token of `seq` (not yet queued) if it were queued now."""


class Decoder(Protocol):
    """Accept after the forward pass; propose drafts for the next one (speculative decoding)."""

    def accept(self, logits: torch.Tensor, scheduled: list[ScheduledSeq], proposals: object | None = None
               ) -> DecoderOutput:
        """Accepted tokens (and logprobs) per sequence id. Each scheduled entry has 1 + d logits
        rows, in order: d = its `num_draft_tokens` (0 unless drafts were proposed)."""

    def propose(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """After a step, given every running sequence: draft tokens for the next step, per seq id
        of a sequence past its prompt ({}: none)."""


class AttentionBackend(Protocol):
    """Owns the KV layout and the attention arithmetic over block tables."""

    def allocate_kv_cache(self, num_blocks: int, block_size: int, spec: KVCacheSpec, device: Any) -> list[tuple]:
        """One tuple of tensors per layer (K, V, and whatever else the layout needs)."""

    def plan(self, meta: AttentionMetadata) -> object | None:
        """Once per step, before the layers: derived index tensors the forward reuses in every layer."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """Store the new tokens' K/V at meta.slot_mapping, then attend; q [tokens, heads, dim]."""

    def copy_blocks(self, kv_caches: list[tuple], src: torch.Tensor, dst: torch.Tensor) -> None: ...


class Backend(Protocol):
    """Runs the model over one step's inputs (the model and the attention backend come from the
    factory; the engine keeps its own reference to the model).

    A simulator says so with the class attribute `needs_weights = False`: the engine then loads
    only the model's shape and tokenizer, and the backend provides `weight_bytes`,
    `kv_budget_bytes(...)` (the KV pool of the simulated devices), a `clock` (callable, with
    `sleep`) that every timestamp of the engine reads, and a `runner` that builds no tensors
    (see plugins/backends/simulator.py)."""

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None: ...

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer."""

    def execute(self, batch: ModelInput) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in the model's dtype (bf16 for a bf16 model: the
        head's output as it is; a decoder upcasts what it computes probabilities on)."""


class Quantizer(Protocol):
    def quantize(self, model: nn.Module) -> nn.Module:
        """Transform the loaded weights once, before serving (module swaps)."""


class Peer(Protocol):
    """A whole other system run on the same workload (e.g. transformers `generate`): not part of
    the engine, it returns the same per-request records and step stats."""

    def load(self, model: Any, path: str, device: Any) -> None:
        """The same model (a ModelConfig: path or dummy shape, dtype) on `device`."""

    def warm_up(self, requests: list, max_num_seqs: int, pad_token_id: int, n: int) -> None:
        """Pay one-time costs (compiles, allocations) before the measured run."""

    def run(self, requests: list, max_num_seqs: int, pad_token_id: int, progress=None) -> tuple[list, list]:
        """Serve the requests (arrival-ordered RequestSpecs); per-request records and per-step stats."""

    def weight_bytes(self) -> int: ...

    def describe(self) -> str: ...


CONTRACTS: dict[str, type] = {
    "scheduler": Scheduler, "cache": CacheAllocator, "quant": Quantizer, "decoder": Decoder, "backend": Backend,
    "attention": AttentionBackend, "peer": Peer,
}
CAPABILITIES: dict[str, dict[str, type]] = {
    "scheduler": {"deadlines": SupportsDeadlines},
    "cache": {"fork": SupportsFork, "copy_on_write": SupportsCopyOnWrite, "truncate": SupportsTruncate,
              "describe": SupportsDescribe},
    "attention": {"cuda_graphs": SupportsCudaGraphs},
}


def protocol_members(proto: type) -> list[str]:
    """The names a Protocol requires: its methods, properties and annotated attributes."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if not n.startswith("_") and (inspect.isfunction(v) or
                                                                               isinstance(v, property))}
    return sorted(names)


def has_capability(component: Any, capability: str) -> bool:
    return capability in getattr(component, "capabilities", ())


def check_contract(kind: str, name: str, component: Any, source: str = "") -> None:
    """Every required member, and every member of each declared capability, must be there."""
    where = f"{kind} '{name}'" + (f" (from {source})" if source else "")
    declared = set(getattr(component, "capabilities", ()))
    known = CAPABILITIES.get(kind, {})
    unknown = sorted(declared - set(known))
    if unknown:
        raise ConfigError(f"{where} declares unknown capabilit{'ies' if len(unknown) > 1 else 'y'} "
                          f"{', '.join(unknown)}; known: {', '.join(known) or 'none'}")
    for label, proto in [(None, CONTRACTS[kind])] + [(c, known[c]) for c in sorted(declared)]:
        missing = [m for m in protocol_members(proto) if m != "capabilities" and not hasattr(component, m)]
        if missing:
            why = f"for its capability '{label}'" if label else "required of every " + kind
            raise ConfigError(f"{where} lacks {', '.join(missing)} ({why})")
