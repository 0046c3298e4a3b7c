"""The model's linear layers: `nn.Linear`, whose bf16 calls of few rows on the CPU take a C++ GEMV.

A decode step at small batch reads every weight once, so its linears run at the rate weights
stream from memory. oneDNN's bf16 GEMM (what `F.linear` calls) reads them at 11-38 GB/s there on
2-core AVX-512 EPYCs whose memory gives 50-76, and each call has a fixed cost. `bf16_linear`
(csrc/cpu_gemv.cpp, built with kernels.cpu_ops) streams each weight row once, prefetched, against
up to 8 activation rows at a time with AVX512-BF16 dot products, summing in fp32 and rounding once
to bf16 as the GEMM does (the only difference is the order of the sums): 31-57 GB/s at 1 to 8 rows
on the faster of those machines, 1.5-3.4x oneDNN on SmolLM2's shapes, and a batch-1 decode step
1.4-1.9x faster depending on the machine (reports/gemv, `python -m benchmarks.gemv`).

It serves up to `GEMV_ROWS` rows, bf16, no bias, where the build has the bf16 dot instruction;
everything else (more rows, fp32, autograd) is `F.linear`. Under torch.compile the graph calls one
op, `bf16_matmul`, that makes the same choice by the number of rows when it runs (the graph's
rows are symbolic: a branch here would guard on them and recompile for each step size).
`linear_ref` is its torch twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_ops
from kernels.cpp_build import namespace

# Up to this many rows the GEMV serves: at 16 it still reads 1.05-2.2x faster than oneDNN on every
# SmolLM2 shape, at 24 the down projection (K = 1536) loses (0.83x) and at 32 the head (reports/gemv).
GEMV_ROWS = 16


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The GEMV's twin: fp32 sums of bf16 products, rounded once to bf16."""
    return (x.float() @ weight.float().T).to(x.dtype)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if bias is not None or x.dtype != torch.bfloat16 or x.shape[-1] != weight.shape[-1]:
        return False
    if x.numel() > GEMV_ROWS * x.shape[-1] or not weight.is_contiguous():
        return False
    return cpu_ops.use_cpu_ops(x, weight) and _native()


def _native() -> bool:
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = bool(cpu_ops.load().bf16_dot_native())
    return _NATIVE


_NATIVE: bool | None = None  # whether the build has the bf16 dot instruction (asked once)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 (columns contiguous) @ weight [N, K].T in C++ (any M, any CPU: without the bf16
    dot instruction a plain loop computes the same sums)."""
    return cpu_ops.load().bf16_linear(x, weight)


@torch.compiler.assume_constant_result
def compiled_gemv_ready() -> bool:
    """Whether a graph may call `bf16_matmul` (asked once while tracing, its answer a constant there):
    the build loads, has the bf16 dot instruction, and the op's output shape is known to tracing."""
    global _FAKED
    if not _enabled_for_graphs or cpu_ops.load() is None or not _native():
        return False
    if not _FAKED:
        torch.library.register_fake(f"{_NS}::bf16_matmul")(lambda x, w, rows: x.new_empty(x.shape[0], w.shape[0]))
        _FAKED = True
    return True


_NS = namespace("cpu_ops", portable=False)
_FAKED = False
_enabled_for_graphs = True  # benchmarks.gemv turns it off to trace a graph without the op, to compare


def _graph_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` inside torch.compile's tracing: bf16 CPU linears without a bias go to the op."""
    if (bias is None and x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and x.shape[-1] == weight.shape[-1] and not (torch.is_grad_enabled() and weight.requires_grad)
            and compiled_gemv_ready()):
        rows = x.reshape(-1, x.shape[-1])
        return getattr(torch.ops, _NS).bf16_matmul(rows, weight, GEMV_ROWS).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the GEMV where it serves."""
    if torch.compiler.is_compiling():  # first: a test on the number of rows would guard on it in the graph
        return _graph_linear(x, weight, bias)
    if use_gemv(x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return gemv(rows, weight).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
