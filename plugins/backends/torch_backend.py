"""Backend `torch`: the model forward in eager PyTorch, on the CPU or a CUDA device."""

from __future__ import annotations

import torch
from torch import nn

from core.api import AttentionBackend, BackendConfig, KVCacheSpec, ModelInput, hookimpl


class TorchBackend:
    def __init__(self, config: BackendConfig, model: nn.Module, spec: KVCacheSpec, attention: AttentionBackend,
                 device: torch.device) -> None:
        if config.num_threads and device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.model, self.spec, self.attention, self.device = model, spec, attention, device
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_caches = self.attention.allocate_kv_cache(num_blocks, block_size, self.spec, self.device)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.attention.copy_blocks(self.kv_caches, src, dst)

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> torch.Tensor:
        hidden = self.model(batch.input_ids, batch.positions, batch.attn, self.kv_caches, self.attention)
        return self.model.compute_logits(hidden[batch.logits_indices])


@hookimpl
def servelab_backends():
    return {"torch": TorchBackend}
