"""Backend `simulator`: no weights, no forward pass; each step costs what the hardware profile's
roofline says that step's batch costs, on a virtual clock the whole engine reads.

`backend=simulator hardware=a100-80gb model=llama-2-7b` runs the real scheduler, allocator and
decoder plugins over a model's shape: the KV pool is sized from the device's memory less the
weights, the steps are the ones the scheduler forms, and virtual time advances by each step's
modelled cost (core.engine.hardware.StepTimeModel), so `run`, `compare` and their reports work
unchanged (and say they were simulated). Token ids are synthetic: every row's logits peak at one
ordinary token, which is never an end-of-sequence token, so outputs run to max_tokens (the forced
lengths of `run`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.api import (
    DTYPES,
    AttentionMetadata,
    BackendConfig,
    ConfigError,
    KVCacheSpec,
    ModelInput,
    StepShape,
    StepTime,
    StepTimeModel,
    hookimpl,
    weight_bytes_per_param,
)

SYNTHETIC_TOKEN = 100  # an ordinary word piece in the embedded tokenizer
LOGITS_WIDTH = SYNTHETIC_TOKEN + 1  # narrow rows: a 128K-wide row per sequence would cost more than the step


@dataclass
class SimulatorConfig(BackendConfig):
    tensor_parallel_size: int = 1  # devices the model is split over (Megatron layout), simulated
    compute: str = "bf16"  # the matmuls' type: bf16 (weight-only quantization dequantizes), fp8, int8


class VirtualClock:
    """The engine's clock while simulating: time moves only when a step (or an idle wait) says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class SimulatedRunner:
    """The model runner of a simulated step: the lengths the step-time model reads, no tensors."""

    def prepare(self, scheduled, block_tables, block_size: int) -> ModelInput:
        # a remote prefill's tokens arrive as KV (P/D disaggregation): they take KV slots but no compute
        qlens = [s.num_new_tokens - max(0, min(s.num_new_tokens, s.seq.params.remote_prefill_tokens
                                               - s.seq.num_computed_tokens)) for s in scheduled]
        ctxs = [s.seq.num_computed_tokens + s.num_new_tokens for s in scheduled]
        sample_rows = [i for i, s in enumerate(scheduled) if s.needs_sample]
        logits = sum(1 + scheduled[i].num_draft_tokens for i in sample_rows)
        meta = AttentionMetadata(
            slot_mapping=None, block_tables=None, context_lens=None, query_lens=None, query_start_loc=None,
            block_size=block_size, max_query_len=max(qlens, default=0), max_context_len=max(ctxs, default=0),
            query_lens_cpu=qlens, context_lens_cpu=ctxs, query_start_loc_cpu=[], block_tables_cpu=block_tables)
        return ModelInput(None, None, meta, range(logits), sample_rows)


class SimulatorBackend:
    config_class = SimulatorConfig
    needs_weights = False  # the engine builds no model: the shape (ModelArgs) is enough

    def __init__(self, config: SimulatorConfig, spec: KVCacheSpec, model_args, engine_config) -> None:
        hw = engine_config.hardware
        if hw is None:
            raise ConfigError("backend=simulator needs hardware=NAME (a100-80gb, h100-80gb, h200-141gb, l4, or cpu "
                              "after `python -m core calibrate`)")
        if config.tensor_parallel_size < 1:
            raise ConfigError(f"backend.tensor_parallel_size must be at least 1, got {config.tensor_parallel_size}")
        if config.tensor_parallel_size > 1 and hw.interconnect_gbs <= 0:
            raise ConfigError(f"backend.tensor_parallel_size={config.tensor_parallel_size} needs an interconnect; "
                              f"hardware '{hw.name}' has interconnect_gbs=0")
        self.config, self.hardware, self.spec, self.args = config, hw, spec, model_args
        quant = engine_config.quant.name
        self.bytes_per_param = weight_bytes_per_param(quant, DTYPES[engine_config.model.dtype].itemsize)
        self.time_model = StepTimeModel(model_args, hw, self.bytes_per_param, spec.bytes_per_token,
                                        config.tensor_parallel_size, config.compute)
        self.weight_bytes = int(self.time_model.weight_params * self.bytes_per_param)  # all ranks together
        self.clock = VirtualClock()
        self.runner = SimulatedRunner()
        self.spent = StepTime()  # the run's simulated time, by part
        self.block_bytes = 0

    @staticmethod
    def kv_budget_bytes(engine_config, model_args, weight_bytes: int, reserved_bytes: int, utilization: float) -> float:
        """The simulated devices' memory for the KV pool: vLLM's arithmetic (utilization x memory,
        less weights and activations), summed over the tensor-parallel ranks."""
        tp = engine_config.backend.tensor_parallel_size
        return utilization * engine_config.hardware.memory_gb * 1e9 * tp - weight_bytes - reserved_bytes * tp

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_bytes = block_size * self.spec.bytes_per_token

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:  # copy-on-write: read and write each block once
            self.clock.sleep(2 * len(copies) * self.block_bytes / self.time_model.bandwidth)

    def execute(self, batch: ModelInput) -> torch.Tensor:
        meta = batch.attn
        shape = StepShape(sampled=len(batch.logits_indices))
        for q, c in zip(meta.query_lens_cpu, meta.context_lens_cpu):
            if q:  # (a chunk of loaded KV only computes nothing)
                shape.add(q, c, sampled=False)
        t = self.time_model.step(shape.tokens, shape.sampled, shape.kv_read, shape.attn_pairs, meta.num_seqs)
        for part in ("linear", "lm_head", "attention", "allreduce", "overhead"):
            setattr(self.spent, part, getattr(self.spent, part) + float(getattr(t, part)))
        self.clock.sleep(float(t.total))  # plain floats on the clock: numpy scalars would reach the reports
        logits = torch.zeros(shape.sampled, LOGITS_WIDTH)
        logits[:, SYNTHETIC_TOKEN] = 1.0
        return logits

    def describe(self) -> str:
        tp = self.config.tensor_parallel_size
        return (f"simulated: {self.hardware.name} x {tp}, {self.weight_bytes / 1e9:.2f} GB of weights "
                f"({self.bytes_per_param:g} B a parameter), {self.config.compute} matmuls")


@hookimpl
def servelab_backends():
    return {"simulator": SimulatorBackend}
