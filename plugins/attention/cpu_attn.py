"""Attention backend `cpu`: decode rows (and rows of up to 8 queries, such as speculative verifies,
a query at a time) through the C++ paged kernel of servelab_kernels.cpu_attention (blocks read in place,
GQA without repeated KV; AMX tiles, AVX-512 or AVX2 two-pass code where the CPU has them, a portable
loop elsewhere or with `attention.decode=portable`), prefill chunks of a bf16 cache through the C++ paged
prefill kernel (every chunk of the step in one call, causal over its cached prefix, read in
place; about 2.5x PyTorch's CPU flash attention on a 512-token chunk where the CPU multiplies bf16
with AVX512-BF16 pair products, 1.4-2.4x where it runs on AMX tiles), fp32 and bf16 caches the same
way through its AVX2 kernel on x86 CPUs without AVX-512, other caches through SDPA with the offset
causal mask (`attention.prefill`: auto | cpp | sdpa). `auto` picks this backend on the CPU whenever
the C++ kernel builds, the torch reference otherwise."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from core.api import AttentionConfig, hookimpl
from plugins.attention.torch_ref import TorchAttention, split_rows
from servelab_kernels import cpu_attention
from servelab_kernels.attention import prefill_attention

PREFILL_CHOICES = ("auto", "cpp", "sdpa")
DECODE_CHOICES = ("auto", "portable")


@dataclass
class CPUAttentionConfig(AttentionConfig):
    # prefill chunks of a bf16/fp32 cache: auto (the C++ kernel where it has its tile path, or its
    # vector path on a CPU without AMX tiles: AVX512-BF16 for bf16, AVX2 for both on CPUs without
    # AVX-512; else SDPA) | cpp (the C++ kernel) | sdpa (PyTorch's CPU flash attention)
    prefill: str = "auto"
    # the KV cache on 2 MB pages where Linux gives them (servelab_kernels.huge_pages: fewer TLB misses
    # on the scattered blocks a decode step reads)
    huge_pages: bool = True
    # decode rows: auto (this CPU's fastest kernel: AMX tiles, AVX-512, or the AVX2 two-pass kernel on
    # CPUs without AVX-512) | portable (the plain C++ loop every CPU builds, for A/B runs)
    decode: str = "auto"

    def __post_init__(self) -> None:  # checked when the config is read, before any model loads
        from core.api import ConfigError

        if self.prefill not in PREFILL_CHOICES:
            raise ConfigError(f"attention.prefill must be {', '.join(PREFILL_CHOICES[:-1])} or {PREFILL_CHOICES[-1]}, "
                              f"got '{self.prefill}'")
        if self.decode not in DECODE_CHOICES:
            raise ConfigError(f"attention.decode must be {' or '.join(DECODE_CHOICES)}, got '{self.decode}'")


class CPUAttention(TorchAttention):
    pack_decodes = False
    # a speculative verify (1 + k queries) costs the C++ kernel k + 1 decode rows; CPU flash
    # attention spent about 1.2 ms a layer on such a row (measured at k = 4, 1,000 keys)
    decode_max_query_len = 8

    def __init__(self, config: AttentionConfig, device=None) -> None:
        from core.api import ConfigError

        if not cpu_attention.available():
            raise ConfigError("attention=cpu needs its C++ kernel, which did not build here (a C++ compiler and "
                              "Python's headers); use attention=torch")
        self.prefill_choice = getattr(config, "prefill", "auto")
        super().__init__(config, device)
        self.kernels = cpu_attention.load()
        self.portable_decode = getattr(config, "decode", "auto") == "portable"
        # decode rows go to the portable build's kernel (its own module and op namespace) when asked
        self.decode_kernels = cpu_attention.load(portable=True) if self.portable_decode else self.kernels
        self.decode_kernel = functools.partial(cpu_attention.decode_attention, portable=self.portable_decode)
        self.fast_prefill = False  # set once the cache exists (cpp_prefill)

    def allocate_kv_cache(self, num_blocks, block_size, spec, device):
        caches = super().allocate_kv_cache(num_blocks, block_size, spec, device)
        self.fast_prefill = len(caches[0]) == 2 and self.cpp_prefill(caches[0][0])
        return caches

    def cpp_prefill(self, k_cache: torch.Tensor) -> bool:
        """Whether this cache's prefill chunks go to the C++ kernel (an int8 cache never does)."""
        if self.prefill_choice != "auto":
            return self.prefill_choice == "cpp"
        return cpu_attention.prefill_fast(k_cache) and not cpu_attention.sdpa_prefill_wins(k_cache)


    def plan(self, meta):  # the C++ prefill needs no padded SDPA groups
        return split_rows(meta, pack=False, group_prefill=not self.fast_prefill,
                          decode_max_query_len=self.decode_max_query_len)

    def prefill_kernel(self, q, k_cache, v_cache, block_tables, context_lens, starts, scale, k_scale=None,
                       v_scale=None, host=None, groups=None) -> torch.Tensor:
        if self.fast_prefill and k_scale is None:
            return self.kernels.paged_prefill(q, k_cache, v_cache, block_tables, context_lens, starts, float(scale))
        return prefill_attention(q, k_cache, v_cache, block_tables, context_lens, starts, scale, k_scale, v_scale,
                                 host=host, groups=groups)

    def decode_op(self, kv_cache: tuple) -> str | None:
        """The torch op `forward` runs for a decode-only step on this layer's cache (a native decode
        plan calls it from C++): bf16, fp32 and INT8 caches (the last with its scales)."""
        return cpu_attention.write_and_decode_op(portable=self.portable_decode)

    def forward(self, q, k, v, kv_cache: tuple, meta, scale: float):
        k_cache, v_cache, *scales = kv_cache
        if meta.plan.all_decode:  # one C++ call a layer: a decode step's attention is mostly call overhead
            return self.decode_kernels.write_and_decode(q, k, v, k_cache, v_cache, meta.slot_mapping,
                                                        meta.block_tables, meta.context_lens, scale,
                                                        *(scales or (None, None)))
        if scales:  # an int8 cache's prefill chunks: the torch path, which quantizes as it writes
            return super().forward(q, k, v, kv_cache, meta, scale)
        self.kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)


@hookimpl
def servelab_attention_backends():
    return {"cpu": CPUAttention}


CPUAttention.config_class = CPUAttentionConfig
