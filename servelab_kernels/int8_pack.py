"""INT8 weights laid out once for the CPU build's integer GEMM (csrc/cpu_quant.cpp).

- AVX512-VNNI builds (`q8_pack_vnni` / `q8_gemm_vnni`): oneDNN's INT8 GEMM (`torch._int_mm`, which
  `q8_gemm_int` calls) takes the weight as stored and re-lays it out at every call: at decode sizes,
  with the weight out of cache, that pass costs more than the products. The copy is laid out for
  `vpdpbusd` (per 16 outputs, K/4 lines of 16 x 4 inputs, as unsigned bytes w + 128) and `q8_matmul`
  multiplies by it up to VNNI_ROWS part rows: the same integer sums, bit for bit.
- AVX2 builds without AVX-512 (`q8_pack_madd` / `q8_gemm_madd`; AMD Zen 2 / 3, where models run
  fp32): per 16 outputs, K/2 lines of 16 x 2 inputs (signed), the pairs `vpmaddwd` multiplies by a
  broadcast pair of 14-bit activations; `q8_matmul` multiplies by it from 3 rows, where the plain
  weight took the GEMV up to 16 rows and fp32 panels of the dequantized weight above (the GEMV's
  integer sums, bit for bit; 1.3-1.7x the copy-less layers' speed at 64 rows on a 2-core Zen 3).

Int8Linear keeps the copy beside the plain weight. Copies are made while all packed copies (the bf16
ones of servelab_kernels.linear too) stay within PACK_MEMORY_SHARE of the machine's memory, as a
second copy doubles the INT8 weights' bytes.
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


def packing_on() -> bool:
    """Whether layers made now keep a packed copy (False inside `packing(False)`)."""
    return _pack.on


def packable(n: int, k: int) -> bool:
    """csrc/cpu_quant.cpp's vnni_packable: outputs in panels of 32, inputs in dwords, int32 sums exact."""
    return n % 32 == 0 and k % 4 == 0 and k < 66000


def madd_packable(n: int, k: int) -> bool:
    """csrc/cpu_quant.cpp's madd_packable: outputs in panels of 16, inputs in lines of 8."""
    return n % 16 == 0 and k % 8 == 0


def layout() -> str | None:
    """The layout this machine's build packs for: "vnni", "madd" or None (no integer GEMM over a copy)."""
    fast = cpu_quant.ops()
    if fast is None:
        return None
    if hasattr(fast, "q8_pack_vnni"):
        return "vnni"
    return "madd" if hasattr(fast, "q8_pack_madd") else None


def _packed(q: torch.Tensor, fits, op: str) -> torch.Tensor | None:
    if not _pack.on or q.device.type != "cpu" or q.dtype != torch.int8 or not fits(*q.shape):
        return None
    fast = cpu_quant.ops()
    if fast is None or not hasattr(fast, op) or not linear.claim_pack_memory(q.numel()):
        return None
    packed = getattr(fast, op)(q)
    weakref.finalize(packed, linear.release_pack_memory, q.numel())
    return packed


def pack(q: torch.Tensor) -> torch.Tensor | None:
    """q [N, K] int8 laid out for this build's packed GEMM (`layout()`), or None where none applies."""
    kind = layout()
    if kind == "vnni":
        return pack_vnni(q)
    return pack_madd(q) if kind == "madd" else None


def pack_vnni(q: torch.Tensor) -> torch.Tensor | None:
    """q [N, K] int8 laid out for q8_gemm_vnni, or None: packing off, not a CPU tensor, no VNNI
    build, a shape it does not take, or no room left under the packed copies' memory share."""
    return _packed(q, packable, "q8_pack_vnni")


def pack_madd(q: torch.Tensor) -> torch.Tensor | None:
    """q [N, K] int8 laid out for q8_gemm_madd (AVX2 builds), or None as pack_vnni."""
    return _packed(q, madd_packable, "q8_pack_madd")


def unpack_vnni(packed: torch.Tensor) -> torch.Tensor:
    """The torch twin of the layout: [N/16, K/4, 16, 4] unsigned (w + 128) back to q [N, K] int8."""
    nb, kq = packed.shape[:2]
    return (packed.permute(0, 2, 1, 3).reshape(nb * 16, kq * 4).to(torch.int16) - 128).to(torch.int8)


def unpack_madd(packed: torch.Tensor) -> torch.Tensor:
    """The torch twin of the madd layout: [N/16, K/2, 16, 2] back to q [N, K] int8."""
    nb, kp = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(nb * 16, kp * 2)
