"""Attention backends `triton` and `auto`.

`triton`: the Triton kernels of servelab_kernels.triton_attention over servelab's head-major KV layout;
decode rows in one launch (split-K), prefill chunks in one launch for the whole batch. A
decode-only step needs no per-step tensors at all (the kernels read the metadata's block tables
and lengths directly), so it can be captured in a CUDA graph: capability `cuda_graphs`.

`auto`: `triton` on a CUDA device (when Triton is installed), `cpu` on the CPU (when its C++ kernel
builds), `torch` elsewhere.
"""

from __future__ import annotations

import torch

from core.api import AttentionConfig, AttentionMetadata, KVCacheSpec, hookimpl
from plugins.attention.cpu_attn import CPUAttentionConfig
from plugins.attention.torch_ref import TorchAttention, split_rows
from servelab_kernels.attention import allocate_kv_layer


class TritonAttention:
    capabilities = frozenset({"cuda_graphs"})

    def __init__(self, config: AttentionConfig, device=None) -> None:
        from servelab_kernels import triton_attention  # imported here: Triton is optional where it is not used

        self.config, self.kernels, self.max_model_len = config, triton_attention, None

    def allocate_kv_cache(self, num_blocks: int, block_size: int, spec: KVCacheSpec, device) -> list[tuple]:
        self.max_model_len = spec.max_model_len  # fixes the decode kernel's splits (CUDA-graph safe)
        return [allocate_kv_layer(num_blocks, spec.num_kv_heads, block_size, spec.head_dim, spec.dtype, device)
                for _ in range(spec.num_layers)]

    def plan(self, meta: AttentionMetadata):
        return split_rows(meta, pack=False)

    def forward(self, q, k, v, kv_cache: tuple, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache, *scales = kv_cache
        self.kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
        return self.attend(q, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: tuple, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache, *scales = kv_cache
        k_scale, v_scale = scales if scales else (None, None)
        plan = meta.plan
        if plan.all_decode:
            return self.kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                                 k_scale, v_scale, max_context_len=self.max_model_len)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self.kernels.decode_attention(
                q.index_select(0, plan.decode_rows), k_cache, v_cache, plan.decode_tables, plan.decode_ctx, scale,
                k_scale, v_scale, max_context_len=self.max_model_len)
        out[plan.prefill_rows] = self.kernels.prefill_attention(
            q.index_select(0, plan.prefill_rows), k_cache, v_cache, plan.prefill_tables, plan.prefill_ctx,
            plan.prefill_starts, scale, k_scale, v_scale, host=plan.prefill_host)
        return out

    def copy_blocks(self, kv_caches: list[tuple], src: torch.Tensor, dst: torch.Tensor) -> None:
        for layer in kv_caches:
            for t in layer:
                t[dst] = t[src]


def auto_attention(config: AttentionConfig, device=None):
    """Triton on CUDA; on the CPU the C++ decode kernel when it builds; the torch reference otherwise."""
    from plugins.attention.cpu_attn import CPUAttention
    from servelab_kernels import cpu_attention
    from servelab_kernels.dispatch import HAVE_TRITON

    device = torch.device(device or "cpu")
    if device.type == "cuda" and HAVE_TRITON:
        return TritonAttention(config, device)
    if device.type == "cpu" and cpu_attention.available():
        return CPUAttention(config, device)
    return TorchAttention(config, device)


auto_attention.config_class = CPUAttentionConfig  # the CPU backend's keys (prefill); CUDA ignores them


@hookimpl
def servelab_attention_backends():
    return {"triton": TritonAttention, "auto": auto_attention}
