"""pluggy hook specifications: what a servelab plugin may implement.

A plugin is any module or object with functions marked `@hookimpl` (from `core.api`).
Component hooks return `{name: factory}`; the factories are called with keyword arguments:

- scheduler:       factory(config, allocator) -> Scheduler
- cache allocator: factory(config, spec: KVCacheSpec, max_num_seqs: int, device: torch.device,
                           reserved_bytes: int) -> CacheAllocator  (reserved_bytes: the engine's
                           estimate of a step's activations, to leave out of a memory budget)
- quantizer:       factory(config, tokenizer, source: str) -> Quantizer
                   (source: the model path, for quantizers that read the file's own blocks)
- decoder:         factory(config, vocab_size: int, seed: int, model, model_args, engine_config, registry,
                   device) -> Decoder
- backend:         factory(config, model: nn.Module, spec: KVCacheSpec, attention: AttentionBackend,
                           device: torch.device, max_num_seqs: int) -> Backend
- attention:       factory(config, device: torch.device) -> AttentionBackend
- peer:            factory(config) -> Peer (a whole other system, run by `run`/`compare` in place
                   of the engine)

A factory receives the context arguments its signature names (all of them if it takes
**kwargs), so a later servelab may add context without breaking it.

`config` is the kind's dataclass from `core.api` (`SchedulerConfig`, ...) or the factory's own
subclass of it, named by its `config_class` attribute: keys outside it are rejected at start-up.
The contracts, and the optional capabilities a component may declare, are in
`core.engine.interfaces`; they are checked when the component is built.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("servelab")


@hookspec
def servelab_schedulers() -> dict:
    """Return {name: factory} of schedulers this plugin provides."""


@hookspec
def servelab_cache_allocators() -> dict:
    """Return {name: factory} of KV cache allocators this plugin provides."""


@hookspec
def servelab_quantizers() -> dict:
    """Return {name: factory} of weight quantizers this plugin provides."""


@hookspec
def servelab_decoders() -> dict:
    """Return {name: factory} of decoders (token choice: sampling, speculative) this plugin provides."""


@hookspec
def servelab_backends() -> dict:
    """Return {name: factory} of model-execution backends this plugin provides."""


@hookspec
def servelab_attention_backends() -> dict:
    """Return {name: factory} of attention backends (KV layout + attention kernels) this plugin provides."""


@hookspec
def servelab_peers() -> dict:
    """Return {name: factory} of benchmark peers: other systems `run` and `compare` measure on the
    same workload, in place of the engine."""


@hookspec
def servelab_request_finished(request_id: str, sequences: list, records: list, engine: str) -> None:
    """Observer: a request ended (finished or aborted). `records` holds one
    `core.engine.records.RequestRecord` per sequence (absolute times: origin 0); `engine` names
    the engine (its served model name), for processes that run several."""


@hookspec
def servelab_step_finished(step_stats) -> None:
    """Observer: an engine step ended, with its `core.engine.types.StepStats` (`.engine` names it)."""
