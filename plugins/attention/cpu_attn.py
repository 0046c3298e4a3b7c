"""Attention backend `cpu`: decode rows (and rows of up to 8 queries, such as speculative verifies,
a query at a time) through the C++ paged kernel of kernels.cpu_attention (blocks read in place,
GQA without repeated KV, online softmax), prefill chunks through PyTorch's CPU flash attention
(SDPA with the offset causal mask). `auto` picks it on the CPU
whenever the C++ kernel builds, the torch reference otherwise."""

from __future__ import annotations

from core.api import AttentionConfig, hookimpl
from kernels import cpu_attention
from plugins.attention.torch_ref import TorchAttention


class CPUAttention(TorchAttention):
    decode_kernel = staticmethod(cpu_attention.decode_attention)
    pack_decodes = False
    # a speculative verify (1 + k queries) costs the C++ kernel k + 1 decode rows; CPU flash
    # attention spent about 1.2 ms a layer on such a row (measured at k = 4, 1,000 keys)
    decode_max_query_len = 8

    def __init__(self, config: AttentionConfig, device=None) -> None:
        from core.api import ConfigError

        if not cpu_attention.available():
            raise ConfigError("attention=cpu needs its C++ kernel, which did not build here (a C++ compiler and "
                              "Python's headers); use attention=torch")
        super().__init__(config, device)
        self.kernels = cpu_attention.load()

    def forward(self, q, k, v, kv_cache: tuple, meta, scale: float):
        if len(kv_cache) > 2:  # an int8 cache quantizes as it writes: the torch path
            return super().forward(q, k, v, kv_cache, meta, scale)
        k_cache, v_cache = kv_cache
        if meta.plan.all_decode:  # one C++ call a layer: a decode step's attention is mostly call overhead
            return self.kernels.write_and_decode(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                                 meta.context_lens, scale)
        self.kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)


@hookimpl
def servelab_attention_backends():
    return {"cpu": CPUAttention}
