"""Which twin runs: the Triton kernel on a CUDA tensor (when Triton is installed), the torch
reference elsewhere. `force_triton()` runs the Triton twins on the CPU too, which works only
under TRITON_INTERPRET=1, set before triton is imported (the tests do this)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch


class Switch:
    """A process-wide on/off for one fast path (`switch.on`), set for a block with `with
    switch.set(False):` (A/B benchmarks, tests); the value before comes back after the block."""

    def __init__(self, on: bool = True) -> None:
        self.on = on

    @contextlib.contextmanager
    def set(self, on: bool):
        before, self.on = self.on, on
        try:
            yield
        finally:
            self.on = before


HAVE_TRITON = importlib.util.find_spec("triton") is not None
_forced = Switch(os.environ.get("SERVELAB_TRITON") == "1")


def use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.is_cuda or _forced.on)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def force_triton(on: bool = True):
    return _forced.set(on)
