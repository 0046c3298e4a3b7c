"""pluggy hook specifications: what a servelab plugin may implement.

A plugin is any module or object with functions marked `@hookimpl` (from `core.plugins`).
Component hooks return `{name: factory}`; the factories are called with keyword arguments:

- scheduler:       factory(config=SchedulerConfig, allocator=CacheAllocator) -> Scheduler
- cache allocator: factory(config=CacheConfig, spec=KVCacheSpec, max_num_seqs=int) -> CacheAllocator
- quantizer:       factory(config=QuantConfig, tokenizer=Tokenizer, source=str) -> Quantizer
                   (source: the model path, for quantizers that read the file's own blocks)
- decoder:         factory(config=DecoderConfig, vocab_size=int, seed=int) -> Decoder
- backend:         factory(config=BackendConfig, model=nn.Module, spec=KVCacheSpec) -> Backend

Every config is a dataclass from `core.config`; keys a plugin needs beyond the common ones
arrive in `config.extra`.
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
def servelab_request_finished(request_id: str, sequences: list, metrics: list) -> None:
    """Observer: a request ended. `metrics` holds one dict of latencies and counts per sequence
    (see `core.metrics.request_metrics`)."""


@hookspec
def servelab_step_finished(step_stats) -> None:
    """Observer: an engine step ended, with its `core.types.StepStats`."""
