"""CUDA graphs of decode-only steps, one per batch-size bucket, captured at start-up.

A decode step's shapes depend only on its batch size, so it is padded up to the next bucket and
replayed from static input buffers: padded rows write their KV nowhere (slot -1) and attend over
nothing (context 0). Mixed steps (a prefill chunk in them) run eagerly. With `capture=False` the
same buffers and padding run eagerly: the path the CPU tests check.
"""

from __future__ import annotations

import torch

from core.api import AttentionMetadata, ModelInput


def buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model, attention, kv_caches, max_num_seqs: int, block_size: int, max_model_len: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model, self.attention, self.kv_caches = model, attention, kv_caches
        self.block_size, self.max_model_len, self.capture = block_size, max_model_len, capture
        self.sizes = buckets(max_num_seqs)
        b, width = self.sizes[-1], -(-max_model_len // block_size)
        z = dict(device=device)
        self.input_ids = torch.zeros(b, dtype=torch.int64, **z)
        self.positions = torch.zeros(b, dtype=torch.int64, **z)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, **z)
        self.block_tables = torch.zeros(b, width, dtype=torch.int32, **z)
        self.context_lens = torch.zeros(b, dtype=torch.int64, **z)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int64, **z)
        self.ones = torch.ones(b, dtype=torch.int64, **z)
        self.metas = {n: self._meta(n) for n in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _meta(self, n: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n], context_lens=self.context_lens[:n],
            query_lens=self.ones[:n], query_start_loc=self.query_start_loc[: n + 1], block_size=self.block_size,
            max_query_len=1, max_context_len=self.max_model_len, query_lens_cpu=[1] * n,
            context_lens_cpu=[self.max_model_len] * n, query_start_loc_cpu=list(range(n + 1)), block_tables_cpu=[])
        meta.plan = self.attention.plan(meta)  # decode-only: reads the static buffers, makes no tensor
        return meta

    def _forward(self, n: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.metas[n], self.kv_caches, self.attention)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Largest bucket first, so the smaller graphs reuse its memory pool."""
        pool = None
        for n in reversed(self.sizes):
            self.context_lens[:n].fill_(1)  # a harmless step to warm up and capture: slots -1, one token each
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernels outside the graph
                    self._forward(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[n] = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = graph
        self.context_lens.zero_()

    def fits(self, batch: ModelInput) -> bool:
        meta = batch.attn
        return meta.max_query_len == 1 and meta.num_seqs <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, batch: ModelInput) -> torch.Tensor:
        """Logits of a decode-only batch's sampling rows, through the bucket's graph (a one-token row
        is its token, so the batch's logits_indices pick the rows)."""
        n = batch.attn.num_seqs
        b = next(s for s in self.sizes if s >= n)
        meta = batch.attn
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.context_lens[:n].copy_(meta.context_lens)
        self.context_lens[n:b].fill_(0)
        if self.capture:
            self.graphs[b].replay()
            return self.logits[b][batch.logits_indices]
        return self._forward(b)[batch.logits_indices]
