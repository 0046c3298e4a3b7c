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

from kernels.cpp_build import build


def load(portable: bool = False):
    """The compiled module (built on first use, then cached per machine), or None if it cannot build.
    `portable`: without the AVX-512 code, as machines without it build it (for tests)."""
    return build("cpu_attention", portable, functions=["paged_decode", "write_kv", "write_and_decode"])


def write_kv(k, v, k_cache, v_cache, slot_mapping, portable=False) -> None:
    """kernels.attention.write_kv for bf16 and fp32 caches."""
    load(portable).write_kv(k, v, k_cache, v_cache, slot_mapping)


def available() -> bool:
    return load() is not None


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None, v_scale=None, packed=None,
                     portable=False):
    """Same arguments as kernels.attention.decode_attention (`packed` is not needed here)."""
    return load(portable).paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale), k_scale, v_scale)
