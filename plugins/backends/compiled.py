"""`backend.compile=true`: the model's forward through torch.compile (inductor), attention left opaque.

A small model's step on the CPU is mostly op dispatch: thousands of small ops (norms, rotary,
residual adds, views, casts) around the matmuls. Inductor fuses them into a few C++ loops, but it
cannot trace the attention backends, whose per-step metadata holds Python lists and plans. So the
whole forward becomes one graph in which attention is one custom op, `servelab::attention`: the
graph sees each layer's KV cache only as its layer index, and the op finds this step's metadata,
caches and backend in a slot that `CompiledForward.__call__` fills just before running the graph.
The op writes the KV cache as a side effect the graph does not see; that is safe because nothing
in the graph reads the cache outside the op, and each call's output depends on its own inputs.

Inductor writes the graph's wrapper in C++ (`cpp_wrapper`), not Python: at batch 1 that took a
gguf step from 10.5 to 9.5 ms here. Shapes are dynamic in the number of tokens, so one graph
serves every step size (torch also specializes size 1: batch-1 decode gets its own graph); ops
that pick a path by the number of rows do it inside one op (servelab_kernels.cpu_quant), since a branch
in the graph would guard on it and recompile under load. Both graphs compile on the first steps
of those sizes (the engine's warm-up requests cover them); the time each took is logged and kept
in `compile_s`.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import types

import torch

log = logging.getLogger("servelab")

_current = threading.local()  # this thread's step: (metadata, kv caches, attention backend)


@torch.library.custom_op("servelab::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    meta, kv_caches, attention = _current.step
    out = attention.forward(q, k, v, kv_caches[layer], meta, scale)
    # a custom op may not return one of its inputs or a view of one
    if out._base is not None or any(out.data_ptr() == t.data_ptr() for t in (q, k, v)):
        out = out.clone()
    return out.contiguous()


@attention_op.register_fake
def _(q, k, v, layer, scale):
    return torch.empty_like(q)


class _OpaqueAttention:
    """What the traced model calls as its attention backend: the `kv_cache` it is handed is the
    layer index (see CompiledForward)."""

    def forward(self, q, k, v, kv_cache, meta, scale):
        return attention_op(q, k, v, kv_cache, scale)


_OPAQUE = _OpaqueAttention()


def _traced(self: CompiledForward, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return self.model(input_ids, positions, None, self.layers, _OPAQUE)


class CompiledForward:
    """`model(input_ids, positions, meta, kv_caches, attention)` with the same result, compiled."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = list(range(len(model.model.layers)))
        # Checking the guards on every parameter costs about 1 ms a step, and a model's parameters
        # do not change once served, so those guards go. Dynamo keeps its compiled graphs on the
        # function's code object, so each instance traces its own copy of `_traced`: another
        # model's graph can then never be reused for this one.
        traced = types.FunctionType(_traced.__code__.replace(), _traced.__globals__, "traced")
        self.graph = torch.compile(functools.partial(traced, self), dynamic=True, fullgraph=True,
                                   options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, "cpp_wrapper": True})
        self.compile_s: dict[str, float] = {}  # "1 token" / "n tokens": seconds the first call took

    def __call__(self, input_ids, positions, meta, kv_caches, attention) -> torch.Tensor:
        shape = "1 token" if input_ids.shape[0] == 1 else "n tokens"
        first = shape not in self.compile_s
        t0 = time.perf_counter()
        _current.step = (meta, kv_caches, attention)
        try:
            hidden = self.graph(input_ids, positions)
        finally:
            _current.step = None
        if first:
            self.compile_s[shape] = time.perf_counter() - t0
            log.info("compiled the forward for %s in %.1f s", shape, self.compile_s[shape])
        return hidden
