"""Attention backend `cpu`: decode rows through the C++ paged kernel of kernels.cpu_attention (blocks
read in place, GQA without repeated KV, online softmax), prefill chunks through PyTorch's CPU
flash attention (SDPA with the offset causal mask), one call per chunk. `auto` picks it on the CPU
whenever the C++ kernel builds, the torch reference otherwise."""

from __future__ import annotations

from core.api import AttentionConfig, hookimpl
from kernels import cpu_attention
from plugins.attention.torch_ref import TorchAttention


class CPUAttention(TorchAttention):
    decode_kernel = staticmethod(cpu_attention.decode_attention)
    pack_decodes = False

    def __init__(self, config: AttentionConfig, device=None) -> None:
        from core.api import ConfigError

        if not cpu_attention.available():
            raise ConfigError("attention=cpu needs its C++ kernel, which did not build here (a C++ compiler and "
                              "Python's headers); use attention=torch")
        super().__init__(config, device)


@hookimpl
def servelab_attention_backends():
    return {"cpu": CPUAttention}
