"""The physical limit: the model's device's matmul peak and memory bandwidth (the host CPU's, or a
GPU's), and the least time a workload could take on it.

Measured once per machine (CPU model, cores, torch version, threads) and cached under
~/.cache/servelab/; measured again when a quick read probe finds 10 % more bandwidth than the cached
figure (keeping each rate's highest), and on `run.remeasure_machine=true` (afresh).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from core.engine.hardware import cpu_model

CACHE_DIR = Path(os.environ.get("SERVELAB_CACHE", Path.home() / ".cache" / "servelab"))


def machine_info() -> dict:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _best_of(fn, reps: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm up
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def measure_matmul_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 5, device="cpu", budget_s: float = 0.5) -> float:
    """The best rate of an n x n x n linear (x @ W^T, the op the model's layers run). Where the dtype
    is emulated (bf16 on an AVX2-only CPU runs 1-20 GFLOP/s) a 2048^3 product takes a minute: the
    size grows from 256 only while one product stays under `budget_s`."""
    device = torch.device(device)
    size = min(256, n)
    while True:
        a = torch.randn(size, size, dtype=dtype, device=device)
        b = torch.randn(size, size, dtype=dtype, device=device)
        seconds = _best_of(lambda a=a, b=b: torch.nn.functional.linear(a, b), 1 if size < n else reps, device)
        if size >= n or seconds * 8 > budget_s:
            return 2 * size**3 / seconds / 1e9
        size *= 2


def measure_bandwidth_gbs(num_bytes: int = 1 << 30, reps: int = 5, device="cpu") -> float:
    """Read bandwidth of the device's memory: a sum over a buffer far larger than the last-level cache."""
    device = torch.device(device)
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / _best_of(lambda: x.sum(), reps, device) / 1e9


def machine_rates(remeasure: bool = False, device="cpu") -> dict:
    """The roofline of the device the model runs on: the host CPU's, or the GPU's (HBM read
    bandwidth and bf16 matmul peak, named after the GPU)."""
    device = torch.device(device)
    info = machine_info()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    # "method": rates cached by an earlier way of measuring (a 2048^3 `mm`) must not serve
    ident = {k: info[k] for k in ("cpu", "cores", "torch_threads", "torch")} | {"gpu": gpu, "method": "linear"}
    key = hashlib.sha1(json.dumps(ident).encode())
    path = CACHE_DIR / f"machine-{key.hexdigest()[:12]}.json"
    cached = json.loads(path.read_text()) if path.exists() else None
    # A peak measured while something else ran (a first run on a fresh machine, a build beside it)
    # would cap every later report below what the machine does: a quick probe that finds more
    # bandwidth measures again, and each rate keeps the highest seen (noise only ever lowers them).
    if cached is not None and not remeasure and \
            measure_bandwidth_gbs(256 << 20, reps=3, device=device) <= 1.1 * cached["mem_bandwidth_gbs"]:
        return cached
    n, size = (8192, 4 << 30) if gpu else (2048, 1 << 30)
    flops = {"fp32": measure_matmul_gflops(torch.float32, n, device=device),
             "bf16": measure_matmul_gflops(torch.bfloat16, n, device=device)}
    bandwidth = measure_bandwidth_gbs(size, device=device)
    if cached is not None and not remeasure:
        flops = {k: max(v, cached["matmul_gflops"].get(k, 0.0)) for k, v in flops.items()}
        bandwidth = max(bandwidth, cached["mem_bandwidth_gbs"])
    rates = {
        **info, "device": gpu or info["cpu"], "device_type": device.type,
        "matmul_gflops": flops, "mem_bandwidth_gbs": bandwidth,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rates, indent=1))
    return rates


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer a forward pass reads (tied weights once). A
    non-persistent buffer (a kernel's second layout of a weight: Int8Linear.packed) is left out: a
    step reads one of the two copies."""
    seen, total = set(), 0
    for name, t in _tensors(model):
        if t.data_ptr() in seen or name.startswith("rope."):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _tensors(model: torch.nn.Module):
    yield from model.named_parameters()
    saved = model.state_dict().keys()
    yield from ((name, b) for name, b in model.named_buffers() if name in saved)


class CostModel:
    """FLOPs and bytes of a step for a Llama-family model, and the least time they take."""

    def __init__(self, args, weight_bytes: int, kv_bytes_per_token: int, peak_gflops: float, bandwidth_gbs: float):
        h = args.hidden_size
        per_layer = h * (args.num_heads + 2 * args.num_kv_heads) * args.head_dim + args.num_heads * args.head_dim * h
        per_layer += 3 * h * args.intermediate_size
        self.linear_params = args.num_layers * per_layer
        self.lm_head_params = args.vocab_size * h
        self.attn_flops_per_pair = 4 * args.num_layers * args.num_heads * args.head_dim
        self.weight_bytes = weight_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.peak = peak_gflops * 1e9
        self.bandwidth = bandwidth_gbs * 1e9

    def step_flops(self, num_tokens: int, num_sampled: int, attn_pairs: float) -> float:
        return 2 * self.linear_params * num_tokens + 2 * self.lm_head_params * num_sampled + self.attn_flops_per_pair * attn_pairs

    def step_bytes(self, num_tokens: int, kv_tokens_read: int) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * (kv_tokens_read + num_tokens)

    def step_time(self, num_tokens: int, num_sampled: int, attn_pairs: float, kv_tokens_read: int) -> tuple[float, str]:
        compute = self.step_flops(num_tokens, num_sampled, attn_pairs) / self.peak
        memory = self.step_bytes(num_tokens, kv_tokens_read) / self.bandwidth
        return (compute, "compute") if compute >= memory else (memory, "memory")

    def schedule_floor(self, steps: list[dict]) -> dict:
        """Least time of the schedule the engine actually ran: each step at its own roofline."""
        total, bound = 0.0, {"compute": 0, "memory": 0}
        for s in steps:
            t, which = self.step_time(s["num_prefill_tokens"] + s["num_decode_tokens"], s.get("num_sampled", 0),
                                      s.get("attn_pairs", 0.0), s.get("kv_tokens_read", 0))
            total += t
            bound[which] += 1
        return {"time_s": total, "steps_compute_bound": bound["compute"], "steps_memory_bound": bound["memory"]}

    def workload_floor(self, prompt_lens: list[int], output_lens: list[int]) -> dict:
        """Least time of the workload under any schedule on this machine.

        Compute: every prompt and output token's FLOPs at peak. Memory: weights read at least once
        per decode step, and the longest request needs that many steps; each decode step reads
        its sequence's whole KV. The floor is the larger of the two.
        """
        tokens = sum(prompt_lens) + sum(output_lens)
        pairs = sum(p * (p + 1) / 2 + o * p + o * (o - 1) / 2 for p, o in zip(prompt_lens, output_lens))
        flops = 2 * self.linear_params * tokens + 2 * self.lm_head_params * sum(output_lens) + self.attn_flops_per_pair * pairs
        kv_reads = sum(o * p + o * (o - 1) / 2 for p, o in zip(prompt_lens, output_lens))
        bytes_ = max(output_lens, default=0) * self.weight_bytes + self.kv_bytes_per_token * (kv_reads + tokens)
        compute, memory = flops / self.peak, bytes_ / self.bandwidth
        return {"time_s": max(compute, memory), "compute_s": compute, "memory_s": memory,
                "bound": "compute" if compute >= memory else "memory", "flops": flops, "bytes": bytes_}
