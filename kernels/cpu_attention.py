"""Paged decode attention for the CPU in C++: the twin of kernels.attention.decode_attention.

One pass over each sequence's blocks, read in place through its block table (no gathered copy,
the next-but-one block prefetched), for all of a KV head's query heads at once (GQA without
repeating KV), with an online softmax in fp32; bf16, fp32 and the INT8 cache (per-token scales)
are read as stored. Sequences x KV heads run in parallel on ATen's thread pool. On AVX-512
machines tiles of 16 keys go through vector code (bf16 q.k as AVX512-BF16 pair products where the
CPU has them); elsewhere a portable loop serves. The source is csrc/cpu_attention.cpp, built
once per machine with torch's cpp_extension (about half a minute, cached under
~/.cache/torch_extensions, keyed by the source and the CPU's flags); `available()` says whether
it built, and the torch reference serves where it did not.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger("servelab")

_SOURCE_FILE = Path(__file__).parent / "csrc" / "cpu_attention.cpp"

_modules: dict[bool, object] = {}
_failed = False


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def load(portable: bool = False):
    """The compiled module (built on first use, then cached per machine), or None if it cannot build.
    `portable`: without the AVX-512 code, as machines without it build it (for tests)."""
    global _failed
    if portable in _modules or _failed or os.environ.get("SERVELAB_NO_CPP") == "1":
        return _modules.get(portable)
    from torch.utils.cpp_extension import load_inline

    source = _SOURCE_FILE.read_text()
    key = hashlib.sha1((source + _cpu_flags() + torch.__version__ + str(portable)).encode()).hexdigest()[:12]
    try:
        _modules[portable] = load_inline(
            name=f"servelab_cpu_attention_{key}", cpp_sources=[source], functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"] + (["-DSERVELAB_PORTABLE"] if portable else []),
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers: the torch reference serves
        _failed = True
        log.warning("the C++ decode attention did not build (%s); using the torch reference", str(e).splitlines()[0])
    return _modules.get(portable)


def available() -> bool:
    return load() is not None


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None, v_scale=None, packed=None,
                     portable=False):
    """Same arguments as kernels.attention.decode_attention (`packed` is not needed here)."""
    return load(portable).paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale), k_scale, v_scale)
