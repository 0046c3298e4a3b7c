"""Weight-only quantized linear layers: INT8 per output channel, INT4 group-wise asymmetric.

Each matmul has fast paths (on the CPU the C++ kernels of servelab_kernels.cpu_quant for steps of few
rows, a bf16 GEMM over the weight dequantized per call for many rows, INT8 on AMX tiles at any
number of rows where the CPU has them, and PyTorch's packed
`_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` where the C++ kernels did not build; on
CUDA the Triton kernels of servelab_kernels.triton_quant, which dequantize inside the matmul) and a torch
reference twin that dequantizes and multiplies; tests hold them together.

INT4 follows the packed kernel's convention: q in 0..15 per weight, per (group, output channel)
a scale and a zero, w = (q - 8) * scale + zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelab_kernels import cpu_quant, cpu_quant_ref, int8_pack
from servelab_kernels.dispatch import use_triton

INT4_INNER_K_TILES = 2  # the CPU packer's tiling: K must be a multiple of 16 * this


# ---- INT8, symmetric, one scale per output channel ------------------------------------------


def quantize_int8(w: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales [N] fp32) with w ~ q * scale. `absmax`: each row's
    largest magnitude when `w` is a slice of wider rows (a tensor-parallel shard keeps their scale)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) if absmax is None else absmax.float()).clamp(min=1e-8) / 127.0
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def int8_matmul_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (x.float() @ dequantize_int8(q, scales).T).to(x.dtype)


def w8a8_matmul_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W8A8 (dynamic, per token): each row of x to INT8 with its own scale (absmax / 127), the
    integer products summed exactly, then both scales."""
    return cpu_quant_ref.q8_linear_ref(x, q, scales, cpu_quant.A8)


# Above this many rows aten's packed CPU kernel (a GEMV at heart: its time grows with the rows) loses
# to dequantizing the weight to bf16 and one GEMM; measured on a 2-core AVX-512 EPYC, 1536 x 576:
# 16 rows 0.21 vs 0.29 ms, 32 rows 0.40 vs 0.35 ms, 64 rows 0.78 vs 0.48 ms, 512 rows 6.3 vs 2.9 ms.
INT8_DEQUANT_ROWS = 24


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, a8: bool = False,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (q * scales).T: Triton on CUDA; on the CPU the C++ op (AMX tiles where the CPU has
    them, else the GEMV for few rows and a GEMM in x's precision over the weight dequantized on the fly
    for many), or aten's packed kernel and a bf16 GEMM where it did not build. a8: W8A8, the
    activations as INT8 per row (the C++ op's GEMV and one INT8 GEMM; its twin where it did not build).
    packed: q as servelab_kernels.int8_pack lays it out, for the C++ op's packed GEMM (VNNI or AVX2)."""
    if a8:
        if x.device.type == "cpu" and q.shape[1] % cpu_quant.GROUP == 0 and cpu_quant.available():
            return cpu_quant.q8_matmul(x, q, scales, cpu_quant.A8, packed)
        return w8a8_matmul_ref(x, q, scales)
    if use_triton(x):
        from servelab_kernels.triton_quant import int8_matmul as triton_int8_matmul

        return triton_int8_matmul(x, q, scales)
    if x.device.type == "cpu":
        # every path in one op: no branch on the rows in a compiled graph
        if q.shape[1] % cpu_quant.GROUP == 0 and cpu_quant.available():
            return cpu_quant.q8_matmul(x, q, scales, cpu_quant.Q16, packed)
        xb, sb = x.to(torch.bfloat16), scales.to(torch.bfloat16)
        if x.shape[0] > INT8_DEQUANT_ROWS:
            return F.linear(xb, q.to(torch.bfloat16) * sb[:, None]).to(x.dtype)
        return torch.ops.aten._weight_int8pack_mm(xb, q, sb).to(x.dtype)
    return int8_matmul_ref(x, q, scales)


# ---- INT4, asymmetric, group-wise along K -----------------------------------------------------


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (K a multiple of group_size) -> (q int32 [N, K] in 0..15, scales [K/g, N], zeros [K/g, N])."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8)
    zeros = lo + 8.0 * scales  # w = (q - 8) * scale + zero, so q = 0 is the group minimum
    q = torch.clamp(torch.round((wg - lo[..., None]) / scales[..., None]), 0, 15).to(torch.int32)
    return q.reshape(n, k), scales.T.contiguous(), zeros.T.contiguous()


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    s = scales.float().T.repeat_interleave(group_size, dim=1)
    z = zeros.float().T.repeat_interleave(group_size, dim=1)
    return (q.float() - 8.0) * s + z


def int4_matmul_ref(x, q, scales, zeros, group_size):
    return (x.float() @ dequantize_int4(q, scales, zeros, group_size).T).to(x.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INT4_INNER_K_TILES)


def int4_matmul(x, packed, scales_and_zeros, group_size):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group_size, scales_and_zeros)


# ---- modules ----------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """INT8 linear, weight-only (the activations as 14-bit integers in the CPU kernels: about bf16's
    precision) or, with a8=True, W8A8: the activations as INT8 with one scale a token (coarser, one
    INT8 GEMM where the other path runs two)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fast: bool = True,
                 a8: bool = False):
        super().__init__()
        self.a8 = a8
        self.register_buffer("weight_q", q)
        cpu_kernel = fast and not use_triton(q)  # the packed CPU kernel takes bf16 scales; Triton reads fp32
        if cpu_kernel and q.device.type == "cpu":
            cpu_quant.available()  # built (or found built) now: its first call inside a torch.compile trace cannot build
        # the weight laid out once for the build's packed GEMM, VNNI or AVX2's vpmaddwd (None where it
        # does not apply: AMX tiles take W8A16's many rows from the plain weight); not saved with the model
        pack = cpu_kernel and q.device.type == "cpu" and (a8 or not cpu_quant.amx_ready())
        self.packing = int8_pack.packing_on()  # made inside `packing(False)` (quant.pack=false): so are its fusions
        self.register_buffer("packed", int8_pack.pack(q) if pack else None, persistent=False)
        self.register_buffer("scales", scales.to(torch.bfloat16) if cpu_kernel else scales.float())
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.fast = fast
        self.in_features, self.out_features = q.shape[1], q.shape[0]

    @classmethod
    def from_linear(cls, lin: nn.Linear, fast: bool = True, a8: bool = False) -> Int8Linear:
        q, s = quantize_int8(lin.weight.data, getattr(lin, "row_absmax", None))
        return cls(q, s, None if lin.bias is None else lin.bias.data, fast, a8)

    @classmethod
    def concat(cls, mods: list[Int8Linear]) -> Int8Linear | None:
        """One layer whose outputs are the `mods`' side by side (core.model.fuse), or None."""
        if len({(m.in_features, m.fast, m.a8, m.scales.dtype) for m in mods}) != 1:
            return None
        bias = None if mods[0].bias is None else torch.cat([m.bias.data for m in mods])
        # the scales as stored: the constructor's cast to its storage dtype is then a no-op
        with int8_pack.packing(all(m.packing for m in mods)):
            return cls(torch.cat([m.weight_q for m in mods]), torch.cat([m.scales for m in mods]), bias, mods[0].fast,
                       mods[0].a8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fast:
            y = int8_matmul(x2, self.weight_q, self.scales, a8=self.a8, packed=self.packed)
        else:
            y = (w8a8_matmul_ref if self.a8 else int8_matmul_ref)(x2, self.weight_q, self.scales)
        y = y.reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int4Linear(nn.Module):
    """Weight-only INT4 linear, group-wise along the input. Input features are zero-padded to a
    multiple of the group size (and of the packer's tile) so odd shapes work; the optional
    `input_scale` holds AWQ-style per-input-channel scales the activations are divided by.

    Layouts by device: `cpu_packed` (the CPU kernel's tiles), `nibbles` (two weights a byte, for
    the Triton kernel on CUDA), `unpacked` (one weight a byte, the reference; fast=False)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 in_features: int, bias: torch.Tensor | None, input_scale: torch.Tensor | None = None,
                 fast: bool = True, device=None):
        super().__init__()
        device = torch.device(device) if device is not None else q.device
        q, scales, zeros = q.to(device), scales.to(device), zeros.to(device)
        self.group_size, self.in_features, self.out_features = group_size, in_features, q.shape[0]
        self.padded_in = q.shape[1]
        self.layout = "unpacked" if not fast else ("nibbles" if use_triton(q) else "cpu_packed")
        if self.layout == "cpu_packed" and group_size % cpu_quant.GROUP == 0 and cpu_quant.available():
            self.layout = "cpu_q4"
            q, d, m = cpu_quant.q4_1_groups(q, scales, zeros, group_size)
            self.padded_in = q.shape[1]
            nibbles, dm = cpu_quant.pack_q4(q, d, m)
            self.register_buffer("weight_packed", nibbles)
            self.register_buffer("dm", dm)
        elif self.layout == "cpu_packed":
            # the packer wants N a multiple of 16: pad with rows that dequantize to zero
            n_pad = -self.out_features % 16
            if n_pad:
                q = F.pad(q, (0, 0, 0, n_pad), value=8)
                scales, zeros = F.pad(scales, (0, n_pad)), F.pad(zeros, (0, n_pad))
            self.register_buffer("weight_packed", pack_int4(q))
            self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).to(torch.bfloat16))
        elif self.layout == "nibbles":
            from servelab_kernels.triton_quant import pack_int4_nibbles

            self.register_buffer("weight_packed", pack_int4_nibbles(q))
            self.register_buffer("scales", scales.float())
            self.register_buffer("zeros", zeros.float())
        else:
            self.register_buffer("weight_q", q.to(torch.uint8))
            self.register_buffer("scales", scales.float())
            self.register_buffer("zeros", zeros.float())
        self.bias = None if bias is None else nn.Parameter(bias.to(device), requires_grad=False)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.to(device))

    @staticmethod
    def padded_features(k: int, group_size: int) -> int:
        step = max(group_size, 16 * INT4_INNER_K_TILES)
        return -(-k // step) * step

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias, group_size: int, input_scale=None, fast: bool = True) -> Int4Linear:
        n, k = w.shape
        kp = cls.padded_features(k, group_size)
        scaled = w.float() * input_scale.float()[None, :] if input_scale is not None else w.float()
        if kp != k:
            scaled = F.pad(scaled, (0, kp - k))
        q, s, z = quantize_int4(scaled, group_size)
        return cls(q, s, z, group_size, k, bias, input_scale, fast)

    @classmethod
    def concat(cls, mods: list[Int4Linear]) -> Int4Linear | None:
        """One layer whose outputs are the `mods`' side by side (core.model.fuse), or None: only the
        C++ kernel's layout, whose rows are independent, concatenates."""
        first = mods[0]
        if any(m.layout != "cpu_q4" or m.input_scale is not None for m in mods) or len(
                {(m.group_size, m.in_features, m.padded_in) for m in mods}) != 1:
            return None
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.group_size, out.in_features, out.padded_in, out.layout = (first.group_size, first.in_features,
                                                                      first.padded_in, first.layout)
        out.out_features = sum(m.out_features for m in mods)
        out.register_buffer("weight_packed", torch.cat([m.weight_packed for m in mods]))
        out.register_buffer("dm", torch.cat([m.dm for m in mods]))
        out.bias = None if first.bias is None else nn.Parameter(torch.cat([m.bias.data for m in mods]),
                                                                requires_grad=False)
        out.register_buffer("input_scale", None)
        return out

    def _unpacked(self) -> torch.Tensor:
        if self.layout == "cpu_q4":
            return cpu_quant.unpack_q4(self.weight_packed, self.dm)[0].int()
        if self.layout == "unpacked":
            return self.weight_q.int()
        if self.layout == "nibbles":
            p = self.weight_packed.int()
            return torch.stack([p & 15, p >> 4], dim=-1).flatten(1)
        raise RuntimeError("the CPU kernel's packed layout is not unpacked; quantize with fast=False for the reference")

    def dequantized_weight(self) -> torch.Tensor:
        if self.layout == "cpu_q4":
            w = cpu_quant.dequantize_q4_ref(self.weight_packed, self.dm)[:, : self.in_features]
        else:
            w = dequantize_int4(self._unpacked(), self.scales, self.zeros, self.group_size)[:, : self.in_features]
        return w / self.input_scale.float()[None, :] if self.input_scale is not None else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.input_scale is not None:
            x2 = x2 / self.input_scale.to(x2.dtype)
        if self.padded_in != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in - self.in_features))
        if self.layout == "cpu_q4" and x2.device.type == "cpu":
            y = cpu_quant.q4_matmul(x2, self.weight_packed, self.dm).to(x.dtype)
        elif self.layout == "cpu_packed" and x2.device.type == "cpu":
            y = int4_matmul(x2, self.weight_packed, self.scales_and_zeros, self.group_size)[:, : self.out_features]
            y = y.to(x.dtype)
        elif self.layout == "nibbles":
            from servelab_kernels.triton_quant import int4_matmul as triton_int4_matmul

            y = triton_int4_matmul(x2.contiguous(), self.weight_packed, self.scales, self.zeros, self.group_size)
        else:
            y = int4_matmul_ref(x2, self.weight_q.int(), self.scales, self.zeros, self.group_size)
        y = y.reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y
