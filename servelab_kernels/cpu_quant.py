"""INT4 and INT8 weight-only matmuls for steps of few rows on the CPU, in C++ (csrc/cpu_quant.cpp).

A decode step multiplies a handful of activation rows by every weight once, so its speed is how
fast the weights stream in. PyTorch's packed CPU kernels (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`) reach 4-16 GB/s there. These turn the activations into integers so that
the inner loop is integer dot products (AVX512-VNNI), scaled once per group or per row:

- INT4 (`q4_linear`): as llama.cpp's Q4_1 x Q8_1, the activations go to int8 per group of 32
  inputs (scale = absmax / 127) and each group's dot product is four u8 x s8 products a lane
  (`vpdpbusd`). That rounding, about 0.4 % of a group's largest input, is small beside the 4-bit
  weights' own.
- INT8 (`q8_linear`): int8 activations per group would double an INT8 weight's error, and an
  outlier group costs more (0.3 logits on SmolLM2's head), so the activations go to 14-bit
  integers with one scale a row (finer than bf16 for the large values) and the products are
  s16 x s16 pairs (`vpdpwssd`), exact in int32 over blocks of 2,048 inputs.
- INT8 on AMX tiles (`q8_gemm_amx`, CPUs with AMX-INT8): the same 14-bit activations, each split
  as hi * 128 + lo into two INT8 parts, times the INT8 weights as they are stored, on the tiles
  (`tdpbssd`): the GEMV's integer sums exactly, at the tiles' rate, for any number of rows. A
  step of many rows no longer dequantizes the weight to bf16 (which on an AMX CPU lost to bf16's
  packed GEMM: a 64-row decode step 0.75x bf16's, now 1.1x).
- INT4 times many rows (`q4_gemm_int`, AVX512-VNNI builds): prefill chunks and batched decodes
  without dequantizing the weight. The activations go to 14-bit integers per group of 32 (finer
  than the GEMV's int8: at every row of a prefill those cost the embedded GGUF model 9x its KL
  against fp32), each split as hi * 128 + lo into two INT8 parts, so a group's sum is exact in
  int32. Register-blocked: 32 output rows of the packed weight are transposed by dwords once per
  call so that each lane of a `vpdpbusd` is an output row and each activation dword is broadcast to
  all of them; a tile of 3 rows x 32 outputs keeps its sums in registers (no horizontal sums).
  Twin: `q4_gemm_ref`. Figures in Q4_INT_GEMV_ROWS's comment and reports/quant-steps-int4-zen4.
- INT8 through oneDNN's INT8 GEMM (`q8_gemm_int`, AVX512-VNNI builds without AMX): the same split,
  the M rows' hi and lo parts stacked as 2M INT8 rows, times the INT8 weights as stored in one
  s8 x s8 -> s32 GEMM (`torch._int_mm`), recombined exactly: the GEMV's sums again, so on these
  CPUs too a step's numbers do not depend on how many rows it has. On a 2-core Zen 4 that GEMM of
  2M rows costs 0.95-1.05x bf16's packed GEMM of M rows, where dequantizing the weight for each
  call cost 1.1-1.5x.
- INT8 over a copy packed once for VNNI (`q8_gemm_vnni`, servelab_kernels.int8_pack): oneDNN re-lays
  out the weight at every call, which out of cache costs more than the products at decode sizes;
  Int8Linear keeps the weight also as `vpdpbusd` wants it and q8_matmul multiplies by it from 4
  rows up to 256 part rows (a row is 2 parts with 14-bit activations, 1 with INT8): the same sums.
- From BF16_DOT_ROWS rows the packed copy is widened to bf16 a panel at a time (exact) and the rows
  multiply by it on bf16 dot products (`q8_gemm_bf16`): two INT8 part rows a row lose to bf16's GEMM where
  INT8 products run under 2x bf16's rate (Zen 4: about 1.5x). Twin: `q8_bf16_ref`.

- INT8 over a copy packed once for `vpmaddwd` (`q8_gemm_madd`, AVX2 builds without AVX-512: AMD
  Zen 2 / 3): 16 int16 products an instruction where fp32 FMAs do 8; the 14-bit activations (INT8 with
  W8A8) times the weight widened to int16 in 6 x 16 register tiles, exact in int32 (int64 over blocks
  past 2,048 inputs): the GEMV's sums, bit for bit, from 3 rows (the GEMV below). On a 2-core Zen 3,
  SmolLM2's shapes: 1.2-1.7x the fp32 tiles' speed at 64-512 rows, 1.3-1.7x the same layers without
  the copy at 64 (reports/int8-gemm-zen3).
- fp32 rows on AVX2 FMA CPUs without the packed copy (no AVX-512, where model.dtype=auto runs fp32): above the GEMV's rows,
  each thread dequantizes 16 weight rows at a time into a panel of K lines of 16 outputs that stays in
  cache and multiplies every row by it in fp32_linear's 6 x 16 register tiles (csrc/cpu_fp32_tile.cpp),
  instead of dequantizing the whole weight for at::linear. Same products as the dequantized GEMM; on a
  2-core Zen 3, 1.0-1.9x its speed from 17 to 256 rows, and about fp32_linear's own over fp32 weights.

`q4_linear_ref`, `q8_linear_ref` and the others in servelab_kernels.cpu_quant_ref are the torch twins
with the same rounding (the tests hold the kernels to them within float summation order); the plain
dequantize-and-multiply stays the reference for accuracy.

INT4 layout (`pack_q4`): per output row, the input groups of 32 as 16 bytes each (low nibbles =
inputs 0..15 of the group, high nibbles = inputs 16..31), so one 64-byte load holds 4 groups whose
halves line up with the activations' two int8 halves; per 4 groups 8 float16: the 4 scales d then
the 4 offsets m, w = q * d + m (GGUF's Q4_1 as stored; the symmetric-around-8 convention of
servelab_kernels.quant is w = (q - 8) * s + z, so d = s, m = z - 8 s). Rows of many tokens run `q4_gemm_int`,
or, without AVX512-VNNI (and for fp32 activations), dequantize the weights and use the GEMM
(`q4_dequantize`).

Built once per machine (see servelab_kernels.cpp_build); without AVX512-VNNI a portable loop computes the
same sums, and without a compiler `available()` is false and callers keep the aten kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab_kernels.cpp_build import build
from servelab_kernels.dispatch import Switch

GROUP = 32
Q16 = 8191  # the INT8 kernel's activations: 14-bit integers, one scale a row
BF16_DOT_ROWS = 64  # csrc's: from this many bf16 rows, W8A16 layers with a packed copy take q8_gemm_bf16
A8 = 127  # W8A8 (quant.w8a8): 8-bit activations, one scale a row (token), one INT8 GEMM instead of two


def ops(portable: bool = False):
    """The torch.ops namespace of the build (None if it did not build), its ops' shapes known to
    torch.compile's tracing."""
    ns = build("cpu_quant", portable, fast_math=False, prelude=("cpu_amx", "cpu_bf16_tile", "cpu_fp32_tile"))  # x rounds to int8 exactly as its twin does
    if ns is None:
        return None
    if ns not in _faked:
        _faked.add(ns)
        torch.library.register_fake(f"{ns}::q4_linear")(lambda x, w, dm: x.new_empty(x.shape[0], w.shape[0]))
        torch.library.register_fake(f"{ns}::q8_linear")(lambda x, w, s, levels=Q16: x.new_empty(x.shape[0], w.shape[0]))
        torch.library.register_fake(f"{ns}::q4_dequantize")(
            lambda w, dm, dtype: w.new_empty(w.shape[0], w.shape[1] * 2, dtype=dtype))
        torch.library.register_fake(f"{ns}::q8_dequantize")(
            lambda w, s: w.new_empty(w.shape, dtype=torch.bfloat16))
        for gemm in ("q8_gemm_amx", "q4_gemm_int"):
            if hasattr(getattr(torch.ops, ns), gemm):
                torch.library.register_fake(f"{ns}::{gemm}")(lambda x, w, s: x.new_empty(x.shape[0], w.shape[0]))
        if hasattr(getattr(torch.ops, ns), "q8_gemm_int"):
            torch.library.register_fake(f"{ns}::q8_gemm_int")(
                lambda x, w, s, levels=Q16: x.new_empty(x.shape[0], w.shape[0]))
        if hasattr(getattr(torch.ops, ns), "q8_gemm_bf16"):
            torch.library.register_fake(f"{ns}::q8_gemm_bf16")(lambda x, p, s: x.new_empty(x.shape[0], p.shape[0] * 16))
        if hasattr(getattr(torch.ops, ns), "q8_gemm_vnni"):
            torch.library.register_fake(f"{ns}::q8_gemm_vnni")(
                lambda x, p, s, levels=Q16: x.new_empty(x.shape[0], p.shape[0] * 16))
            torch.library.register_fake(f"{ns}::q8_pack_vnni")(
                lambda w: w.new_empty(w.shape[0] // 16, w.shape[1] // 4, 16, 4, dtype=torch.uint8))
        if hasattr(getattr(torch.ops, ns), "q8_gemm_madd"):
            torch.library.register_fake(f"{ns}::q8_gemm_madd")(
                lambda x, p, s, levels=Q16: x.new_empty(x.shape[0], p.shape[0] * 16))
            torch.library.register_fake(f"{ns}::q8_pack_madd")(
                lambda w: w.new_empty(w.shape[0] // 16, w.shape[1] // 2, 16, 2))
        torch.library.register_fake(f"{ns}::q4_matmul")(
            lambda x, w, dm, rows, int_gemm: x.new_empty(x.shape[0], w.shape[0]))
        torch.library.register_fake(f"{ns}::q8_matmul")(
            lambda x, w, s, rows, int_gemm, levels=Q16, packed=None, bf16_dot=True: x.new_empty(x.shape[0], w.shape[0]))
    return getattr(torch.ops, ns)


def available() -> bool:
    return ops() is not None


_faked: set[str] = set()


# ---- packing ----------------------------------------------------------------------------------


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15 (K a multiple of 64), d and m [N, K/32] (w = q * d + m) ->
    (nibbles uint8 [N, K/2], dm float16 [N, ceil(K/128), 8])."""
    n, k = q.shape
    if k % 64:
        raise ValueError(f"the INT4 layout wants K a multiple of 64, got {k}")
    halves = q.to(torch.uint8).reshape(n, k // GROUP, 2, 16)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    g = k // GROUP
    c = -(-g // 4)
    pad = c * 4 - g
    d4 = F.pad(d.float(), (0, pad)).reshape(n, c, 4)
    m4 = F.pad(m.float(), (0, pad)).reshape(n, c, 4)
    return nibbles, torch.cat([d4, m4], dim=-1).to(torch.float16).contiguous()


def unpack_q4(nibbles: torch.Tensor, dm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_q4 (d and m as the float16 they are stored in)."""
    n, kh = nibbles.shape
    g = kh // 16
    b = nibbles.reshape(n, g, 16)
    q = torch.stack([b & 15, b >> 4], dim=2).reshape(n, g * GROUP)
    return q, dm[..., :4].reshape(n, -1)[:, :g].float(), dm[..., 4:].reshape(n, -1)[:, :g].float()


def dequantize_q4_ref(nibbles: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The weights of pack_q4's layout in fp32, w = q * d + m: the twin of the `q4_dequantize` op."""
    q, d, m = unpack_q4(nibbles, dm)
    return q.float() * d.repeat_interleave(GROUP, 1) + m.repeat_interleave(GROUP, 1)


# ---- the matmul Int4Linear calls ----------------------------------------------------------------

# Up to this many rows the C++ INT4 GEMV serves, above it a GEMM over the
# weight dequantized to bf16 (measured on a 2-core AVX-512 EPYC, 3072 x 576: 8 rows 0.19 vs
# 0.26 ms, 16 rows 0.34 vs 0.31 ms, 512 rows 4.5 ms, where the aten INT4 kernel took 11 ms).
Q4_GEMV_ROWS = 12
# Where the INT4 integer GEMM serves (q4_gemm_int), it takes over from 8 rows: on a 2-core Zen 4,
# over one SmolLM2 layer's four weights 0.91x the GEMV's speed at 7 rows, 1.10x at 8, 1.23x at 12,
# 1.48x at 16 (the dequantized GEMM 0.5-0.8x there); over the head 0.99x at 7, 1.23x at 8. Over a
# layer and the head against bf16's GEMM: 1.4-2.1x at 8-64 rows, 1.0x at 128, 0.94x at 256.
Q4_INT_GEMV_ROWS = 7
# The same for the INT8 GEMV (3072 x 576: 16 rows 0.26 vs 0.31 ms; 24 rows 0.66 vs 0.35 ms, where
# its 14-bit activations outgrow L1). The dequantized GEMM costs about 1.1x bf16's from there on.
Q8_GEMV_ROWS = 16
# Where oneDNN's INT8 GEMM serves (q8_gemm_int), it takes over from 9 rows: over one SmolLM2 layer's
# four weights on a 2-core Zen 4, 1.00x the GEMV's speed at 6 and 8 rows, 1.28x at 10, 1.18x at 16.
Q8_INT_GEMV_ROWS = 8


_INT_GEMM_BUILT: bool | None = None


def int_gemm_built() -> bool:
    """Whether this machine's build has the VNNI integer GEMMs `q8_gemm_int` and `q4_gemm_int`
    (AVX512-VNNI builds have both), looked up once: the matmuls ask on every call."""
    global _INT_GEMM_BUILT
    if _INT_GEMM_BUILT is None:
        fast = ops()
        _INT_GEMM_BUILT = fast is not None and hasattr(fast, "q8_gemm_int") and hasattr(fast, "q4_gemm_int")
    return _INT_GEMM_BUILT


def q8_gemv_rows() -> int:
    """Up to how many rows q8_matmul takes the INT8 GEMV: fewer where the integer GEMM takes over."""
    return Q8_INT_GEMV_ROWS if _int_gemm.on and int_gemm_built() else Q8_GEMV_ROWS


def q4_gemv_rows() -> int:
    """Up to how many rows q4_matmul takes the INT4 GEMV: fewer where the integer GEMM takes over."""
    return Q4_INT_GEMV_ROWS if _int_gemm.on and int_gemm_built() else Q4_GEMV_ROWS


_AMX_READY: bool | None = None


def amx_ready() -> bool:
    """Whether q8_matmul may run the INT8 GEMV's integer sums on AMX tiles here (`q8_gemm_amx`; the
    CPU has AMX-INT8, the build has the op, Linux granted the tile state). Where it does they serve
    bf16 steps of any number of rows with K a multiple of 64 and N of 16: faster than the GEMV from
    one row on (a 2-core Xeon, the head: 0.63 against 0.68 ms at 1 row, 0.93 against 5.0 at 16) and
    than the GEMM over the dequantized weight above it (2.9 against 25 at 64 rows)."""
    global _AMX_READY
    if _AMX_READY is None:
        fast = ops()
        _AMX_READY = bool(fast is not None and fast.amx_ready())
    return _AMX_READY


def int_gemm_ready() -> bool:
    """Whether many-row bf16 INT8 matmuls here run an integer GEMM of the GEMV's sums: AMX tiles
    (`amx_ready()`) or oneDNN's INT8 GEMM (`q8_gemm_int`, in AVX512-VNNI builds)."""
    return amx_ready() or int_gemm_built()


_int_gemm = Switch()


def int_gemm(on: bool):
    """`with int_gemm(False):` INT8 and INT4 matmuls take the GEMV and, above Q8_GEMV_ROWS /
    Q4_GEMV_ROWS rows, the GEMM over the weight dequantized to bf16 (fp32 for fp32 rows) for each
    call, as CPUs without AMX or VNNI did (no fp32 panels on AVX2 either; benchmarks.quant_steps, for
    A/B runs)."""
    return _int_gemm.set(on)


_bf16_dot = Switch()


def bf16_dot(on: bool):
    """`with bf16_dot(False):` W8A16 rows keep the 14-bit integer GEMMs at any number of rows (A/B runs)."""
    return _bf16_dot.set(on)


def q8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, levels: int = Q16,
              packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (q * scales).T: AMX tiles where amx_ready(), else the GEMV for up to q8_gemv_rows()
    rows and above it oneDNN's INT8 GEMM of the split activations (bf16 rows, VNNI builds), the fp32
    panels (fp32 rows, AVX2 builds) or a GEMM over the weight dequantized for this call
    (`int_gemm(False)` turns the first two off); one
    op either way, so a compiled graph does not branch (and recompile) on the number of rows.
    levels=A8 (W8A8): the activations as INT8, the GEMV and one INT8 GEMM of M rows; no float GEMM.
    packed: q laid out by servelab_kernels.int8_pack, for the VNNI GEMM up to a few hundred rows, and
    for 14-bit activations from BF16_DOT_ROWS rows the bf16 dot GEMM over it (`bf16_dot(False)`: not);
    on AVX2 builds for the vpmaddwd GEMM (q8_gemm_madd) above 2 rows, unless int_gemm(False)."""
    return ops().q8_matmul(x, q, scales, q8_gemv_rows(), _int_gemm.on, levels, packed, _bf16_dot.on)


def q4_1_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """servelab_kernels.quant's INT4 (q, scales [K/g, N], zeros [K/g, N]) as pack_q4 wants them: per group of
    32 a d and an m with w = q * d + m, K zero-padded to a multiple of 64."""
    rep = group_size // GROUP
    d = scales.float().T.repeat_interleave(rep, dim=1)
    m = (zeros.float() - 8.0 * scales.float()).T.repeat_interleave(rep, dim=1)
    pad = -q.shape[1] % 64
    if pad:
        q, d, m = F.pad(q, (0, pad)), F.pad(d, (0, pad // GROUP)), F.pad(m, (0, pad // GROUP))
    return q, d, m


def q4_matmul(x: torch.Tensor, nibbles: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T for this INT4 layout: the GEMV for up to q4_gemv_rows() rows; above, for bf16
    rows, the integer GEMM of the GEMV's sums where it is built, for fp32 rows on AVX2 the fp32
    panels (`int_gemm(False)` turns both off); else a GEMM in x's precision (bf16 unless x is fp32) over the weight dequantized for this call;
    one op for all, so a compiled graph does not branch (and recompile) on the number of rows."""
    return ops().q4_matmul(x, nibbles, dm, q4_gemv_rows(), _int_gemm.on)
