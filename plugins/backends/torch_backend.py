"""Backend `torch`: the model forward in eager PyTorch on the CPU (or a CUDA device)."""

from __future__ import annotations

import torch
from torch import nn

from core.config import BackendConfig
from core.plugins import hookimpl
from core.types import KVCacheSpec, ModelInput
from kernels.attention import allocate_kv_layer


class TorchBackend:
    def __init__(self, config: BackendConfig, model: nn.Module, spec: KVCacheSpec) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model = model
        self.spec = spec
        self.device = next(model.parameters()).device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        sp = self.spec
        self.kv_caches = [allocate_kv_layer(num_blocks, sp.num_kv_heads, block_size, sp.head_dim, sp.dtype, self.device)
                          for _ in range(sp.num_layers)]

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.kv_caches:
            for t in layer:
                t[dst] = t[src]

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches)
        return self.model.compute_logits(hidden[batch.logits_indices])


@hookimpl
def servelab_backends():
    return {"torch": TorchBackend}
