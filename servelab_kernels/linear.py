"""The model's linear layers: `nn.Linear`, whose bf16 calls of few rows on the CPU take a C++ GEMV.

A decode step at small batch reads every weight once, so its linears run at the rate weights
stream from memory. oneDNN's bf16 GEMM (what `F.linear` calls) reads them at 11-38 GB/s there on
2-core AVX-512 EPYCs whose memory gives 50-76, and each call has a fixed cost. `bf16_linear`
(csrc/cpu_gemv.cpp, built with servelab_kernels.cpu_ops) streams each weight row once, prefetched, against
up to 8 activation rows at a time with AVX512-BF16 dot products, summing in fp32 and rounding once
to bf16 as the GEMM does (the only difference is the order of the sums): 31-57 GB/s at 1 to 8 rows
on the faster of those machines, 1.5-3.4x oneDNN on SmolLM2's shapes, and a batch-1 decode step
1.4-1.9x faster depending on the machine (reports/gemv, `python -m benchmarks.gemv`).

It serves up to `GEMV_ROWS` rows (`GEMV_ROWS_AMX` on AMX CPUs), bf16, no bias, where the build has the
bf16 dot instruction.
Above that a bf16 `Linear` multiplies by a copy of its weight that oneDNN packed once
(`torch.ops.mkldnn._reorder_linear_weight`, the layout inductor's CPU freezing uses): `F.linear`
hands oneDNN a plain weight, which it re-lays out on every call. The same sums (bit-identical
results on the AMX Xeon measured): 1.05-1.6x `F.linear` on SmolLM2's shapes at 17-256 rows there,
up to 2.1x the GEMV at 8 rows, and a 64-row decode step 1.15x faster (`python -m
benchmarks.packed_linear`, reports/packed-linear), at the cost of a second copy of the bf16 weights: copies are made while
they total at most `PACK_MEMORY_SHARE` of the machine's memory, so a large model is not doubled.

On CPUs with AMX-BF16 tiles the copy is laid out for the tiles instead, and steps of
`GEMV_ROWS_TILES` + 1 to `TILE_ROWS` rows multiply on them (servelab_kernels/amx_linear.py); above that
`F.linear` over the plain weight, which oneDNN re-lays out itself. On CPUs with AVX512-BF16 and no
AMX the copy is laid out for bf16 dot products, multiplied by servelab_kernels/dot_linear.py at any
number of rows, the GEMV's too (a Zen 4: 1.06-1.35x oneDNN's packed GEMM at 17-128 rows, a batch-1
decode step 1.76x the GEMV's). On CPUs without AVX-512, where fp32 is the default, an fp32 Linear
takes a copy laid out for AVX2 FMA tiles at every number of rows (servelab_kernels/fp32_linear.py).
Everything else (fp32 elsewhere, autograd, tracing) is `F.linear`. Under torch.compile the graph calls one
op, `bf16_matmul`, that makes the same choice by the number of rows when it runs (the graph's
rows are symbolic: a branch here would guard on them and recompile for each step size).
`linear_ref` is its torch twin.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from servelab_kernels import amx_linear, cpu_ops, dot_linear, fp32_linear
from servelab_kernels.cpp_build import has_amx, namespace
from servelab_kernels.dispatch import Switch

# Up to this many rows the GEMV serves: at 16 it still reads 1.05-2.2x faster than oneDNN on every
# SmolLM2 shape, at 24 the down projection (K = 1536) loses (0.83x) and at 32 the head (reports/gemv).
GEMV_ROWS = 16
# On AMX CPUs oneDNN's GEMM over packed weights wins from 4 rows (0.86-1.48x the GEMV's speed on
# SmolLM2's shapes; 2.8-4.5x at 16 rows); at 3 rows it is 0.70-1.15x, at 1-2 rows the GEMV is 1.1-2.8x
# faster (2-core Xeon, benchmarks.packed_linear)
GEMV_ROWS_AMX = 3
# Where amx_linear serves (servelab_kernels/amx_linear.py): the GEMV keeps 1-2 rows (a step's 120 layer linears
# out of memory, called directly: GEMV 10.8 / 12.0 / 13.6 ms at 1 / 2 / 3 rows, tiles 12.8 / 12.2 / 12.5; through
# the Linear at 3 rows tiles 1.03x (0.97-1.08) the GEMV, reports/amx-linear), the tiles take the rest up to
# TILE_ROWS (a layer's four linears, warm, at 384 rows: tiles 1.64 ms, oneDNN 1.97, F.linear 1.67; at 512 F.linear
# 2.07, tiles 2.29)
GEMV_ROWS_TILES = 2
TILE_ROWS = 384


def gemv_rows() -> int:
    """Rows up to which the eager GEMV serves here: GEMV_ROWS, GEMV_ROWS_TILES where bf16 linears take
    AMX tiles, or GEMV_ROWS_AMX where oneDNN's packed weights run on them (F.linear on plain weights
    also beats the GEMV at 16 rows there)."""
    if _pack_weights.on and amx_linear.switch.on and amx_linear.ready():
        return GEMV_ROWS_TILES
    return GEMV_ROWS_AMX if _pack_weights.on and _amx() else GEMV_ROWS


def _amx() -> bool:
    global _AMX
    if _AMX is None:
        _AMX = has_amx() and _mkldnn_bf16()
    return _AMX


_AMX: bool | None = None


def linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The GEMV's twin: fp32 sums of bf16 products, rounded once to bf16."""
    return (x.float() @ weight.float().T).to(x.dtype)


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if bias is not None or x.dtype != torch.bfloat16 or x.shape[-1] != weight.shape[-1]:
        return False
    if x.numel() > gemv_rows() * x.shape[-1] or not weight.is_contiguous():
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: Callable[[], torch.Tensor | None] | None = None) -> torch.Tensor:
    """F.linear, through the GEMV where it serves, else through the packed weight (`packed()` gives it,
    or None where there was no room) where that serves: on AMX tiles up to TILE_ROWS rows where
    `amx_linear.use`s it, on dot products where `dot_linear.use`s it, oneDNN's GEMM elsewhere."""
    if torch.compiler.is_compiling():  # first: a test on the number of rows would guard on it in the graph
        return _graph_linear(x, weight, bias)
    layout = _layout(weight) if packed is not None and use_packed(x, weight) else None
    if layout in ("dot", "fp32", "fp32-bf16"):
        packed_weight = packed()  # these tiles win from one row on (dot_linear's, fp32_linear's docstrings)
        if packed_weight is not None:
            return _KERNELS[layout].linear(x, packed_weight, bias)
    if use_gemv(x, weight, bias):
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        return gemv(rows, weight).view(*x.shape[:-1], weight.shape[0])
    if layout in ("onednn", "tiles"):
        packed_weight = packed()
        if packed_weight is not None:
            if layout == "onednn":
                return packed_linear(x, packed_weight, bias)
            if x.numel() <= TILE_ROWS * x.shape[-1]:
                return amx_linear.linear(x, packed_weight, weight.shape[0], bias)
    return F.linear(x, weight, bias)


_pack_weights = Switch()  # benchmarks.packed_linear turns it off to compare


def packing(on: bool):
    """`with packing(False):` bf16 Linears multiply by their plain weights (F.linear), for A/B runs."""
    return _pack_weights.set(on)


def use_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call the GEMV does not serve may take the packed weight: on the CPU, no autograd,
    packing on, and bf16 with oneDNN's bf16 support or fp32 where fp32_linear serves."""
    if not _pack_weights.on or x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float32):
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu" or x.shape[-1] != weight.shape[-1]:
        return False
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return False
    return fp32_linear.use(weight) if x.dtype == torch.float32 else _mkldnn_bf16()


def _mkldnn_bf16() -> bool:
    global _MKLDNN_BF16
    if _MKLDNN_BF16 is None:
        _MKLDNN_BF16 = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _MKLDNN_BF16


_MKLDNN_BF16: bool | None = None

PACK_MEMORY_SHARE = 0.125  # packed copies stop (the rest keep F.linear) once they would pass this share of RAM
_packed_bytes = 0


def _release(nbytes: int) -> None:
    global _packed_bytes
    _packed_bytes -= nbytes


def _room_to_pack(nbytes: int) -> bool:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return False
    return _packed_bytes + nbytes <= PACK_MEMORY_SHARE * ram


def claim_pack_memory(nbytes: int) -> bool:
    """Count a packed copy of `nbytes` against PACK_MEMORY_SHARE, shared with the bf16 copies
    (servelab_kernels.int8_pack's too); False, counting nothing, once there is no room.
    The caller gives the bytes back with `weakref.finalize(copy, release_pack_memory, nbytes)`."""
    global _packed_bytes
    if not _room_to_pack(nbytes):
        return False
    _packed_bytes += nbytes
    return True


release_pack_memory = _release


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of a [N, K] bf16 weight (an opaque mkldnn tensor; any number of rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose forward is `linear` with its packed weight
    (made at the first call that needs it, again whenever the weight changes)."""

    # (the weight's storage pointer, its version, its shape, {layout: the packed copy or None where
    # there was no room}), the layout "tiles", "dot", "fp32", "fp32-bf16" or "onednn" (`_layout`); a weight
    # replaced or changed in place through autograd's view of it is packed again. A layout is made when first asked for,
    # so an A/B run that flips `amx_linear.enabled` holds both (and times neither's packing)
    _packed: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)

    def packed_weight(self) -> torch.Tensor | None:
        global _packed_bytes
        w = self.weight
        # a weight made under inference_mode has no version counter: only replacing it repacks
        key = (w.data_ptr(), -1 if w.is_inference() else w._version, tuple(w.shape))
        if self._packed is None or self._packed[:3] != key:
            self._packed = (*key, {})  # the old copies' bytes are given back as they are freed
        layout = _layout(w)
        copies = self._packed[3]
        if layout not in copies:
            nbytes = w.numel() * (2 if layout == "fp32-bf16" else w.element_size())
            packed = None
            if _room_to_pack(nbytes):
                packed = _PACK[layout](w) if layout in _PACK else pack_weight(w)
                _packed_bytes += nbytes
                weakref.finalize(packed, _release, nbytes)
            copies[layout] = packed
        return copies[layout]

    def packed_copy(self) -> torch.Tensor | None:
        """The packed copy of the layout in use now, if one was made (None: not made, or no room)."""
        return self._packed[3].get(_layout(self.weight)) if self._packed is not None else None


# the packed layouts servelab's own kernels multiply by (pack, linear); "onednn" is torch's
_KERNELS = {"tiles": amx_linear, "dot": dot_linear, "fp32": fp32_linear, "fp32-bf16": fp32_linear}
_PACK = {layout: kernel.pack for layout, kernel in _KERNELS.items()} | {"fp32-bf16": fp32_linear.pack_bf16}


def _layout(weight: torch.Tensor) -> str:
    """Which packed copy a weight's calls take now: an fp32 weight fp32_linear's (`use_packed` asked
    `fp32_linear.use`), in fp32 or, under `fp32_linear.weights("bf16")`, in bf16; a bf16 one the tiles'
    (`amx_linear.use`), the dot products' (`dot_linear.use`) or oneDNN's."""
    if weight.dtype == torch.float32:
        return "fp32-bf16" if fp32_linear.bf16_lines.on else "fp32"
    if amx_linear.use(weight):
        return "tiles"
    return "dot" if dot_linear.use(weight) else "onednn"
