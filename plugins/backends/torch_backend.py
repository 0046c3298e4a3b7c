"""Backend `torch`: the model forward in PyTorch, on the CPU or a CUDA device.

On CUDA, decode-only steps replay CUDA graphs captured at start-up, one per batch-size bucket
(`backend.cuda_graphs`, on by default there; it needs an attention backend with the
`cuda_graphs` capability, such as `triton`). Steps with a prefill chunk run eagerly.
On the CPU, decode-only steps run as one C++ call (`backend.native_decode`, on where it applies:
core/model/decode_plan.py), the same kernels as the eager forward without Python between them, and
on CPUs with AMX-BF16 tiles bf16 linears multiply on them (`backend.amx_linear`, on where it applies),
on AVX512-BF16 CPUs without them on bf16 dot products over a copy packed for them (`backend.dot_linear`),
and on AVX2 CPUs without AVX-512 fp32 linears on FMA tiles over such a copy (`backend.fp32_linear`),
packed in bf16 where `model.dtype=auto` took fp32 (`backend.fp32_linear_weights`).
With `backend.compile=true` the forward of every other step runs through torch.compile (see
plugins/backends/compiled.py): off by default, as the first steps pay its compile time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from core.api import (
    AttentionBackend,
    BackendConfig,
    ConfigError,
    KVCacheSpec,
    ModelInput,
    NativeDecode,
    has_capability,
    hookimpl,
    native_decode_why_not,
)
from plugins.backends.compiled import CompiledForward
from plugins.backends.cuda_graphs import DecodeGraphs
from servelab_kernels import amx_linear, dot_linear, fp32_linear

log = logging.getLogger("servelab")


@dataclass
class TorchBackendConfig(BackendConfig):
    cuda_graphs: bool | None = None  # None: on for CUDA devices with a capable attention backend
    compile: bool = False  # torch.compile (inductor) of the forward, attention opaque; steps the graphs skip
    # CPU decode-only steps as one C++ call (core/model/decode_plan.py). None: where the model, its
    # layers and the attention backend allow it; true: refuse to start where they do not; false: eager
    native_decode: bool | None = None
    # bf16 linears on AMX tiles (servelab_kernels/linear.py, csrc/cpu_gemm_amx.cpp). None: where the CPU
    # has AMX-BF16 tiles; true: refuse to start where it has none; false: oneDNN's packed weights
    amx_linear: bool | None = None
    # bf16 linears on bf16 dot products (servelab_kernels/dot_linear.py). None: where the CPU has AVX512-BF16
    # and no AMX; true: refuse to start elsewhere; false: oneDNN's packed weights
    dot_linear: bool | None = None
    # fp32 linears on AVX2 FMA tiles (servelab_kernels/fp32_linear.py). None: where the CPU has AVX2 and no
    # AVX-512; true: refuse to start elsewhere; false: F.linear
    fp32_linear: bool | None = None
    # the dtype of those tiles' packed weights: "bf16" halves the bytes a step streams (the products and
    # sums stay fp32); "auto": bf16 where model.dtype=auto took fp32 for want of native bf16 on a CPU the
    # tiles serve (core/engine/defaults.py), else fp32
    fp32_linear_weights: str = "auto"


def _cpu_layout(wanted: bool | None, ready, device: torch.device, what: str, lacking: str) -> bool:
    """Whether an engine's linears take a CPU packed layout (`backend.amx_linear`, `backend.dot_linear`,
    `backend.fp32_linear`):
    None and true take it where `ready()`, false never; true refuses to start where it is not ready."""
    if wanted and not (device.type == "cpu" and ready()):
        raise ConfigError(f"{what}, and this {'CPU (or its build)' if device.type == 'cpu' else 'device'} {lacking}")
    return wanted is not False


class TorchBackend:
    config_class = TorchBackendConfig

    def __init__(self, config: TorchBackendConfig, model: nn.Module, spec: KVCacheSpec, attention: AttentionBackend,
                 device: torch.device, max_num_seqs: int = 1) -> None:
        if config.num_threads and device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.model, self.spec, self.attention, self.device = model, spec, attention, device
        self.max_num_seqs = max_num_seqs
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        capable = has_capability(attention, "cuda_graphs")
        if config.cuda_graphs and (device.type != "cuda" or not capable):
            raise ConfigError("backend.cuda_graphs=true needs a CUDA device and an attention backend with the "
                              "cuda_graphs capability (attention=triton)")
        self.use_graphs = capable and device.type == "cuda" if config.cuda_graphs is None else config.cuda_graphs
        self.graphs: DecodeGraphs | None = None
        self.forward = CompiledForward(model) if config.compile else model
        self.native_decode: NativeDecode | None = None
        self.native_wanted = config.native_decode is not False and device.type == "cpu"
        if config.native_decode and device.type != "cpu":
            raise ConfigError(f"backend.native_decode=true runs decode steps on the CPU; the model is on {device}")
        self.native_required = bool(config.native_decode)
        # each on unless set false, scoped to this engine's steps (see execute); true refuses a device without it
        self.amx_linear = _cpu_layout(config.amx_linear, amx_linear.ready, device,
                                      "backend.amx_linear=true multiplies bf16 on AMX tiles", "has none")
        self.dot_linear = _cpu_layout(config.dot_linear, dot_linear.ready, device,
                                      "backend.dot_linear=true multiplies bf16 on AVX512-BF16 dot products where "
                                      "the CPU has no AMX tiles", "does not")
        self.fp32_linear = _cpu_layout(config.fp32_linear, fp32_linear.ready, device,
                                       "backend.fp32_linear=true multiplies fp32 on AVX2 FMA tiles where the CPU "
                                       "has no AVX-512", "does not")
        if config.fp32_linear_weights not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"backend.fp32_linear_weights must be auto, fp32 or bf16, not {config.fp32_linear_weights!r}")
        # auto is resolved with model.dtype (core/engine/defaults.py): left auto, the model's dtype was named
        self.fp32_weights = "bf16" if config.fp32_linear_weights == "bf16" else "fp32"

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv_caches = self.attention.allocate_kv_cache(num_blocks, block_size, self.spec, self.device)
        if self.use_graphs:
            t0 = time.perf_counter()
            self.graphs = DecodeGraphs(self.model, self.attention, self.kv_caches, self.max_num_seqs, block_size,
                                       self.spec.max_model_len, self.device)
            self.graphs.capture_all()
            log.info("captured %d CUDA graphs of decode steps (batch sizes %s) in %.1f s", len(self.graphs.sizes),
                     self.graphs.sizes, time.perf_counter() - t0)
        if self.native_wanted:
            with self.layouts():  # the plan's layers take their packed copies in this engine's layout
                self._native_decode()

    def _native_decode(self) -> None:
        reason = native_decode_why_not(self.model, self.attention, self.kv_caches)
        if reason and self.native_required:
            raise ConfigError(f"backend.native_decode=true, but {reason}")
        if reason:
            log.info("decode steps run eagerly: %s", reason)
        else:
            self.native_decode = NativeDecode(self.model, self.attention, self.kv_caches)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.attention.copy_blocks(self.kv_caches, src, dst)

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> torch.Tensor:
        with self.layouts():  # process-wide switches, set for this engine's step only
            return self._execute(batch)

    @contextlib.contextmanager
    def layouts(self):
        """This engine's packed-weight layouts (amx_linear, dot_linear, fp32_linear and its weights' dtype),
        set while it runs a step; a forward outside `execute` (the eval's teacher-forced one) enters it too."""
        with amx_linear.enabled(self.amx_linear), dot_linear.enabled(self.dot_linear), \
                fp32_linear.enabled(self.fp32_linear), fp32_linear.weights(self.fp32_weights):
            yield

    def _execute(self, batch: ModelInput) -> torch.Tensor:
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(batch)
        if self.native_decode is not None and self.native_decode.serves(batch):
            hidden = self.native_decode.forward(batch)
        else:
            hidden = self.forward(batch.input_ids, batch.positions, batch.attn, self.kv_caches, self.attention)
        return self.model.compute_logits(hidden[batch.logits_indices])


@hookimpl
def servelab_backends():
    return {"torch": TorchBackend}
