"""Which twin runs: the Triton kernel on a CUDA tensor (when Triton is installed), the torch
reference elsewhere. `force_triton()` runs the Triton twins on the CPU too, which works only
under TRITON_INTERPRET=1, set before triton is imported (the tests do this)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
_forced = os.environ.get("SERVELAB_TRITON") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return HAVE_TRITON and (t.is_cuda or _forced)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def force_triton(on: bool = True):
    global _forced
    before, _forced = _forced, on
    try:
        yield
    finally:
        _forced = before
