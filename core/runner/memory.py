"""How much memory the KV pool may take, on the CPU or a CUDA device.

`cache.memory_utilization` means what vLLM's `gpu_memory_utilization` means on a GPU: the share of
the device's whole memory this engine may use, weights and activations included; the pool gets
that share minus what is already in use (the weights, other processes) and a reserve for the
step's activations. On the CPU it is the share of the memory available at start.
"""

from __future__ import annotations

import os

import torch


def available_host_bytes() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_memory_budget(utilization: float, device: torch.device | str = "cpu", reserved_bytes: int = 0) -> tuple[float, str]:
    """(bytes the pool may take, a phrase saying where that came from)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = utilization * total - in_use - reserved_bytes
        return budget, (f"cache.memory_utilization={utilization} of {total / 1e9:.1f} GB on "
                        f"{torch.cuda.get_device_name(device)}, less {in_use / 1e9:.1f} GB in use and "
                        f"{reserved_bytes / 1e9:.1f} GB for activations")
    avail = available_host_bytes()
    return utilization * avail, f"cache.memory_utilization={utilization} of {avail / 1e9:.1f} GB available"


def activation_reserve(args, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A generous bound on one step's transient memory: fp32 activations of the widest layer for
    every batched token, logits for every sequence, and 512 MB for kernels' workspaces and graphs."""
    per_token = 4 * (4 * args.hidden_size + 3 * args.intermediate_size)
    return max_num_batched_tokens * per_token + 2 * max_num_seqs * args.vocab_size * 4 + (512 << 20)
