"""INT8 weights laid out once for the VNNI GEMM (csrc/cpu_quant.cpp's `q8_pack_vnni` / `q8_gemm_vnni`).

oneDNN's INT8 GEMM (`torch._int_mm`, which `q8_gemm_int` calls) takes the weight as stored and
re-lays it out at every call: at decode sizes, with the weight out of cache, that pass costs more
than the products. Int8Linear keeps a second copy laid out for `vpdpbusd` (per 16 outputs, K/4
lines of 16 x 4 inputs, as unsigned bytes w + 128) and `q8_matmul` multiplies by it up to
VNNI_ROWS part rows: the same integer sums, bit for bit. Copies are made while all packed copies
(the bf16 ones of servelab_kernels.linear too) stay within PACK_MEMORY_SHARE of the machine's
memory, as a second copy doubles the INT8 weights' bytes.
"""

from __future__ import annotations

import weakref

import torch

from servelab_kernels import cpu_quant, linear
from servelab_kernels.dispatch import Switch

_pack = Switch()


def packing(on: bool):
    """`with packing(False):` Int8Linear layers made inside keep no packed copy (A/B runs, tests)."""
    return _pack.set(on)


def packable(n: int, k: int) -> bool:
    """csrc/cpu_quant.cpp's vnni_packable: outputs in panels of 32, inputs in dwords, int32 sums exact."""
    return n % 32 == 0 and k % 4 == 0 and k < 66000


def pack_vnni(q: torch.Tensor) -> torch.Tensor | None:
    """q [N, K] int8 laid out for q8_gemm_vnni, or None: packing off, not a CPU tensor, no VNNI
    build, a shape it does not take, or no room left under the packed copies' memory share."""
    if not _pack.on or q.device.type != "cpu" or q.dtype != torch.int8 or not packable(*q.shape):
        return None
    fast = cpu_quant.ops()
    if fast is None or not hasattr(fast, "q8_pack_vnni") or not linear.claim_pack_memory(q.numel()):
        return None
    packed = fast.q8_pack_vnni(q)
    weakref.finalize(packed, linear.release_pack_memory, q.numel())
    return packed


def unpack_vnni(packed: torch.Tensor) -> torch.Tensor:
    """The torch twin of the layout: [N/16, K/4, 16, 4] unsigned (w + 128) back to q [N, K] int8."""
    nb, kq = packed.shape[:2]
    return (packed.permute(0, 2, 1, 3).reshape(nb * 16, kq * 4).to(torch.int16) - 128).to(torch.int8)
