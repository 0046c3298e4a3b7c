"""Paged decode attention for the CPU in C++: the twin of servelab_kernels.attention.decode_attention.

Each sequence's blocks are read in place through its block table (no gathered copy, the block
after next prefetched), for all of a KV head's query heads at once (GQA without repeating KV), the
softmax in fp32; bf16, fp32 and the INT8 cache (per-token scales) are read as stored. Sequences x
KV heads run in parallel on ATen's thread pool. On AVX-512 machines tiles of 16 keys go through
vector code (bf16 and INT8 in two passes, q.k and P.V as AVX512-BF16 pair products where the CPU
has them); on x86 CPUs without AVX-512 all three caches take an AVX2 + FMA kernel in two passes,
8-key tiles, fp32 arithmetic (csrc/cpu_decode_avx2.cpp, `avx2_decode`); elsewhere, and in the
portable build (`attention.decode=portable`), a plain loop with an online softmax serves. On CPUs with AMX-BF16 tiles a bf16 cache
(block size a multiple of 16, head_dim a multiple of 64) is read by a tile kernel instead: two
passes, S = Q.K^T then the exact softmax then P.V, both products on the tiles (`amx_decode`).

Paged prefill (csrc/cpu_prefill.cpp), the twin of servelab_kernels.attention.prefill_attention: every
chunk of a step in one call, causal over its cached prefix, read in place. For a bf16 cache with
head_dim 64 and AVX512-BF16, a task is a KV head of a tile of 16 queries (their G query heads
each), handed out longest first; per key tile the keys are transposed once into (d, d+1) pairs,
a key per lane, so a row's scores are pair products without horizontal sums. On x86 CPUs without
AVX-512 fp32 and bf16 caches (head_dim a multiple of 16) take an AVX2 + FMA kernel (`avx2_prefill`):
a task is a KV head of 48 query rows, kept with the rows in lanes (the softmax runs down the keys,
the causal mask is a compare), 24-key tiles copied as fp32, both products in 6 x 16 register tiles
of broadcast FMAs; 1.1-2.9x SDPA on a 2-core Zen 3. Elsewhere one query row at a time in plain C++
(callers keep SDPA there: `prefill_fast`). On CPUs with AMX tiles
a bf16 cache (block size a multiple of 16, head_dim a multiple of 64) goes to a tile kernel
instead (`amx_prefill`): a task is 16 query rows of a KV head, S^T = K.Q^T on the tiles, the
exact softmax down the keys a row per lane, then P.V on the tiles against value pairs packed once
per (sequence, KV head); it beats PyTorch's CPU flash attention, which runs its GEMMs on the tiles
too (`sdpa_prefill_wins`), by 1.4-2.4x.

The source is csrc/cpu_attention.cpp (after csrc/cpu_amx.cpp, csrc/cpu_read_ahead.cpp and
csrc/cpu_decode_avx2.cpp) with
csrc/cpu_prefill.cpp, built
once per machine with torch's cpp_extension (about half a minute, cached under
~/.cache/torch_extensions, keyed by the source and the CPU's flags); `available()` says whether
it built, and the torch reference serves where it did not.
"""

from __future__ import annotations

from contextlib import contextmanager

from servelab_kernels.cpp_build import build, has_amx, namespace


def load(portable: bool = False):
    """The compiled module (built on first use, then cached per machine), or None if it cannot build.
    `portable`: without the AVX-512 code, as machines without it build it (for tests)."""
    return build("cpu_attention", portable, parts=("cpu_prefill",),
                 prelude=("cpu_amx", "cpu_read_ahead", "cpu_decode_avx2"),
                 functions=["paged_decode", "write_kv", "write_and_decode", "paged_prefill", "prefill_fast", "prefill_on_tiles",
                            "set_amx_decode", "set_two_pass_decode", "amx_decode_ready", "set_amx_prefill", "read_blocks",
                            "set_avx2_decode", "avx2_decode_built", "set_avx2_prefill"])


def write_kv(k, v, k_cache, v_cache, slot_mapping, portable=False) -> None:
    """servelab_kernels.attention.write_kv for bf16 and fp32 caches."""
    load(portable).write_kv(k, v, k_cache, v_cache, slot_mapping)


def available() -> bool:
    return load() is not None


def amx_decode_ready() -> bool:
    """Whether bf16 decode runs on AMX tiles here (built with them, and the OS grants their state)."""
    module = load()
    return module is not None and bool(module.amx_decode_ready())


@contextmanager
def _switched(setter: str, on: bool):
    """Inside the block, the module's AMX switch `setter` set to `on`; the setting before after it."""
    module = load()
    before = getattr(module, setter)(on)
    try:
        yield
    finally:
        getattr(module, setter)(before)


def amx_decode(on: bool):
    """bf16 decode on the AMX tile kernel (on, the default where ready) or the vector kernel (off)
    inside the block: for A/B runs and for tests of one against the other."""
    return _switched("set_amx_decode", on)


def two_pass_decode(on: bool):
    """bf16 and INT8 decode on the vector path in two passes (on, the default: scores, then P.V) or in
    one pass with a running max (off) inside the block: for A/B runs and tests."""
    return _switched("set_two_pass_decode", on)


def avx2_decode(on: bool):
    """Decode on CPUs without AVX-512 on the AVX2 two-pass kernel (on, the default where built) or the
    portable loop (off) inside the block: for A/B runs and for tests of one against the other."""
    return _switched("set_avx2_decode", on)


def avx2_decode_built() -> bool:
    """Whether this machine's build has the AVX2 decode kernel (x86 with AVX2 + FMA, no AVX-512)."""
    module = load()
    return module is not None and bool(module.avx2_decode_built())


def amx_prefill(on: bool):
    """bf16 prefill on the AMX tile kernel (on, the default where ready) or the vector kernel / loop
    (off) inside the block: for A/B runs and for tests of one against the other."""
    return _switched("set_amx_prefill", on)


def avx2_prefill(on: bool):
    """Prefill on CPUs without AVX-512 on the AVX2 kernel (on, the default where built) or the
    portable loop (off) inside the block: for A/B runs and for tests of one against the other."""
    return _switched("set_avx2_prefill", on)


def read_blocks(k_cache, v_cache, block_tables, context_lens) -> int:
    """The bytes decode attention reads (every K and V row of each sequence's context, through its
    block table, on the same threads in the same order) and nothing else: the floor the
    micro-benchmark sets the kernels against. Returns their 64-bit words' sum modulo 2^64 (a checksum)."""
    return int(load().read_blocks(k_cache, v_cache, block_tables, context_lens)) % 2**64


def write_and_decode_op(portable: bool = False) -> str:
    """The qualified name of `write_and_decode` as a torch op (for callers in C++: csrc/cpu_decode.cpp),
    of the portable build's module when `portable` (which must be loaded: load(portable=True))."""
    return f"{namespace('cpu_attention', portable=portable)}::write_and_decode"


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None, v_scale=None, packed=None,
                     portable=False):
    """Same arguments as servelab_kernels.attention.decode_attention (`packed` is not needed here)."""
    return load(portable).paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale), k_scale, v_scale)


def prefill_attention(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, portable=False):
    """servelab_kernels.attention.prefill_attention over a bf16 / fp32 cache: the chunks read in place, causal
    over their cached prefix (csrc/cpu_prefill.cpp)."""
    return load(portable).paged_prefill(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, float(scale))


def prefill_fast(k_cache) -> bool:
    """Whether the C++ prefill has its tile or vector path for this cache here (bf16: AMX tiles with
    block size a multiple of 16 and head_dim a multiple of 64; else head_dim 64 and AVX512-BF16)."""
    return bool(load().prefill_fast(k_cache))


def prefill_on_tiles(k_cache) -> bool:
    """Whether the C++ prefill runs this cache on AMX tiles here (`amx_prefill`)."""
    return bool(load().prefill_on_tiles(k_cache))


def sdpa_prefill_wins(k_cache) -> bool:
    """Whether PyTorch's CPU flash attention (SDPA) outruns the C++ prefill for this cache here: on a
    CPU with AMX tiles, whose bf16 GEMMs it runs on them, unless the C++ prefill runs on them too.
    Measured on a 2-core AMX Xeon (2026-12-02): SDPA 1.33 / 3.33 / 16.8 ms against the vector
    kernel's 2.07 / 9.14 / 29.5 ms for a 512-token chunk, the same after a 1,024-token prefix, and a
    2,048-token chunk; on AVX512-BF16 CPUs without AMX the vector kernel was 1.6-2.7x SDPA. The tile
    kernel (2026-12-03, same kind): 1.49-2.32x SDPA (`python -m benchmarks.decode_attention --prefill-only`)."""
    return has_amx() and not prefill_on_tiles(k_cache)
