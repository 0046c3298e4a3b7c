"""What a device can do, and what one engine step costs on it: the simulator backend's clock.

A `HardwareProfile` holds a device's datasheet rates (dense bf16/fp8/int8 peaks, memory bandwidth
and size, interconnect bandwidth) and what no datasheet gives: the share of each peak a serving
engine reaches (large matmuls, attention kernels, streaming reads) and its per-step and
per-sequence overheads. Profiles of named GPUs live in conf/hardware/; this machine's CPU profile
is fitted by `python -m core calibrate` from measured steps.

`StepTimeModel` is the roofline of one step's actual batch, operator by operator, in the manner
of Vidur: each of the linear layers, the LM head (sampled rows only) and attention takes the larger
of its FLOPs at the achieved peak and its bytes at the achieved bandwidth (weights read once per
step, each sequence's KV read once per layer); tensor parallelism divides both and adds two
ring all-reduces a layer; the overheads come on top.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.errors import ConfigError

# bytes a weight takes in memory, by quantization (scales included: int4 and Q4_1 carry one scale
# and one offset per group of 32 or 128)
WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 128, "gguf": 0.625}


def weight_bytes_per_param(quant: str, dtype_bytes: int) -> float:
    return WEIGHT_BYTES.get(quant) or dtype_bytes


@dataclass
class HardwareProfile:
    name: str
    bf16_tflops: float  # dense peak of one device
    memory_bandwidth_gbs: float
    memory_gb: float
    fp8_tflops: float | None = None
    int8_tops: float | None = None
    interconnect_gbs: float = 0.0  # one device's all-reduce bandwidth (NVLink, PCIe), one direction
    matmul_efficiency: float = 0.7  # achieved share of the peak on a step's GEMMs
    attention_efficiency: float = 0.5  # prefill attention's share of the peak (flash attention)
    bandwidth_efficiency: float = 0.8  # achieved share of the bandwidth on streaming reads
    step_overhead_s: float = 0.0  # per step: scheduling, input building, launches, sampling
    sequence_overhead_s: float = 0.0  # per scheduled sequence of a step
    allreduce_latency_s: float = 10e-6
    default_memory_utilization: float = 0.9  # the KV pool's share of memory when cache.memory_utilization is unset
    source: str = ""  # where the numbers come from (datasheet, calibration run)
    notes: list[str] = field(default_factory=list)

    def validate(self) -> HardwareProfile:
        for f in ("bf16_tflops", "memory_bandwidth_gbs", "memory_gb"):
            if not getattr(self, f) or getattr(self, f) <= 0:
                raise ConfigError(f"hardware '{self.name}': {f} must be positive, got {getattr(self, f)}")
        for f in ("matmul_efficiency", "attention_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ConfigError(f"hardware '{self.name}': {f} must be in (0, 1], got {getattr(self, f)}")
        return self

    def peak_flops(self, compute: str) -> float:
        """FLOP/s of the matmuls' compute type: bf16, fp8 (where the device has it), int8."""
        rate = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "int8": self.int8_tops}.get(compute)
        if not rate:
            raise ConfigError(f"hardware '{self.name}' has no {compute} peak")
        return rate * 1e12

    @classmethod
    def from_dict(cls, data: dict) -> HardwareProfile:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"hardware profile: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        try:
            return cls(**data).validate()
        except TypeError as e:
            raise ConfigError(f"hardware profile: {e}") from None


@dataclass
class StepTime:
    """One step's simulated time, by part (seconds)."""

    linear: float = 0.0
    lm_head: float = 0.0
    attention: float = 0.0
    allreduce: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.lm_head + self.attention + self.allreduce + self.overhead


class StepTimeModel:
    """Seconds of one step of a Llama-family model (ModelArgs) on `tensor_parallel_size` devices."""

    def __init__(self, args, hw: HardwareProfile, weight_bytes_per_param: float, kv_bytes_per_token: int,
                 tensor_parallel_size: int = 1, compute: str = "bf16") -> None:
        self.args, self.hw, self.tp, self.compute = args, hw, tensor_parallel_size, compute
        counts = self.param_counts(args)
        self.linear_params, self.head_params = counts["linear"], counts["lm_head"]
        self.weight_params = counts["total"]
        self.bytes_per_param = weight_bytes_per_param
        self.attn_flops_per_pair = 4 * args.num_layers * args.num_heads * args.head_dim
        self.kv_bytes_per_token_all_ranks = kv_bytes_per_token
        # KV heads are split across ranks, or replicated when there are fewer than ranks
        self.kv_bytes_per_token = kv_bytes_per_token / min(tensor_parallel_size, args.num_kv_heads)
        self.peak = hw.peak_flops(compute)
        self.bandwidth = hw.memory_bandwidth_gbs * 1e9 * hw.bandwidth_efficiency

    def on(self, hw: HardwareProfile) -> StepTimeModel:
        """The same model and arithmetic on other hardware (the calibration's candidate profiles)."""
        return StepTimeModel(self.args, hw, self.bytes_per_param, self.kv_bytes_per_token_all_ranks, self.tp,
                             self.compute)

    @staticmethod
    def param_counts(args) -> dict[str, int]:
        """Parameters of the decoder layers' linear layers, of the LM head (the embedding is as
        large; norms are negligible), and in all (the embedding once more unless tied)."""
        h, d = args.hidden_size, args.head_dim
        per_layer = h * (args.num_heads + 2 * args.num_kv_heads) * d + args.num_heads * d * h
        per_layer += 3 * h * args.intermediate_size
        linear, head = args.num_layers * per_layer, args.vocab_size * h
        return {"linear": linear, "lm_head": head, "total": linear + head * (1 if args.tie_word_embeddings else 2)}

    def _roofline(self, flops, num_bytes, efficiency):
        return np.maximum(flops / (self.peak * efficiency), num_bytes / self.bandwidth)

    def step(self, num_tokens, num_sampled, kv_tokens_read, attn_pairs, num_seqs) -> StepTime:
        """A step of `num_tokens` new tokens over `num_seqs` sequences; `kv_tokens_read`: cached
        tokens its attention reads; `attn_pairs`: (query, key) pairs it scores. Numbers, or numpy
        arrays of many steps (and a profile whose efficiencies are arrays: the calibration's grid)."""
        hw, tp = self.hw, self.tp
        t = StepTime(overhead=hw.step_overhead_s + hw.sequence_overhead_s * num_seqs)
        runs = np.asarray(num_tokens) > 0  # an empty step reads no weights
        t.linear = self._roofline(2 * self.linear_params * num_tokens / tp,
                                  self.linear_params * self.bytes_per_param / tp * runs, hw.matmul_efficiency)
        t.lm_head = self._roofline(2 * self.head_params * num_sampled / tp,
                                   self.head_params * self.bytes_per_param / tp * (np.asarray(num_sampled) > 0),
                                   hw.matmul_efficiency)
        t.attention = self._roofline(self.attn_flops_per_pair * attn_pairs / tp,
                                     self.kv_bytes_per_token * (kv_tokens_read + num_tokens), hw.attention_efficiency)
        if tp > 1:  # after attention and after the MLP, a ring all-reduce of the hidden states
            message = num_tokens * self.args.hidden_size * 2
            per_allreduce = hw.allreduce_latency_s + 2 * (tp - 1) / tp * message / (hw.interconnect_gbs * 1e9)
            t.allreduce = 2 * self.args.num_layers * per_allreduce * runs
        return t


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrated_profile_path() -> Path:
    """Where `python -m core calibrate` keeps this machine's fitted CPU profile (per CPU model,
    core count and torch version: a fit from another machine kind must not serve)."""
    import torch

    key = hashlib.sha1(json.dumps([cpu_model(), os.cpu_count(), torch.__version__]).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("SERVELAB_CACHE", Path.home() / ".cache" / "servelab"))
    return cache / f"hardware-cpu-{key}.json"


def load_hardware(node) -> HardwareProfile | None:
    """The `hardware` config section as a profile: a named GPU's rates, or (calibrated: true) the
    fit `python -m core calibrate` saved for this machine or at `path`."""
    if node is None:
        return None
    data = dict(node)
    if data.pop("calibrated", False):
        path = Path(data.pop("path", None) or calibrated_profile_path())
        if not path.exists():
            raise ConfigError(f"hardware={data.get('name', 'cpu')} is fitted on this machine: run `python -m core "
                              f"calibrate` first (or give hardware.path=FILE); no profile at {path}")
        data = json.loads(path.read_text())
    data.pop("path", None)
    return HardwareProfile.from_dict(data)
