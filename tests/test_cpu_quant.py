"""The C++ INT4 / INT8 matmuls (servelab_kernels.cpu_quant) against their torch twins, the activation
rounding they add against its bound, the Int4Linear paths, the C++ KV write, and fused projections."""

import pytest
import torch
from torch import nn

from servelab_kernels import attention as ref_attention
from servelab_kernels import cpu_attention, cpu_quant
from servelab_kernels.cpu_quant import dequantize_q4_ref, pack_q4, unpack_q4
from servelab_kernels.cpu_quant_ref import q4_gemm_ref, q4_linear_ref, q8_linear_ref, quantize_rows_ref
from servelab_kernels.quant import Int4Linear, Int8Linear

g = torch.Generator().manual_seed(0)
BUILDS = pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])


def q4_case(n: int, k: int):
    q = torch.randint(0, 16, (n, k), generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    return q, d, m


def test_the_kernels_build_here():
    assert cpu_quant.available()


def test_pack_round_trips_and_rejects_an_odd_width():
    q, d, m = q4_case(24, 192)  # 6 groups: a whole chunk of 4 and a half one
    nibbles, dm = pack_q4(q, d, m)
    assert nibbles.shape == (24, 96) and dm.shape == (24, 2, 8)
    q2, d2, m2 = unpack_q4(nibbles, dm)
    assert torch.equal(q2.long(), q)
    torch.testing.assert_close(d2, d.half().float(), atol=0, rtol=0)
    torch.testing.assert_close(m2, m.half().float(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_q4(q[:, :96], d[:, :3], m[:, :3])


@BUILDS
@pytest.mark.parametrize("n, k, rows", [(40, 64, 1), (96, 576, 3), (200, 192, 5), (64, 1536, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_linear_matches_its_twin(n, k, rows, dtype, portable):
    nibbles, dm = pack_q4(*q4_case(n, k))
    x = torch.randn(rows, k, generator=g).to(dtype)
    got = cpu_quant.ops(portable).q4_linear(x, nibbles, dm)
    want = q4_linear_ref(x, nibbles, dm)
    assert got.dtype == dtype
    # fp32: the sums' order only; bf16: one rounding of the output
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@BUILDS
@pytest.mark.parametrize("n, k, rows", [(40, 64, 1), (96, 576, 6), (33, 96, 2), (16, 4160, 3)])  # 4160: two int32 blocks and a tail
def test_q8_linear_matches_its_twin(n, k, rows, portable):
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01
    x = torch.randn(rows, k, generator=g)
    got = cpu_quant.ops(portable).q8_linear(x, w, scales)
    # an activation at a rounding tie may land one 14-bit step apart: |w| * step * scale <= 1e-3 here
    torch.testing.assert_close(got, q8_linear_ref(x, w, scales), atol=1e-3, rtol=1e-5)


def test_the_activation_rounding_stays_within_half_a_step_per_input():
    n, k = 64, 576
    q, d, m = q4_case(n, k)
    nibbles, dm = pack_q4(q, d, m)
    x = torch.randn(4, k, generator=g) * torch.linspace(0.1, 5, k)  # groups of very different ranges
    w = dequantize_q4_ref(nibbles, dm)
    exact = x @ w.T
    _, dx, _ = quantize_rows_ref(x)
    bound = (w.abs()[None] * (dx.repeat_interleave(32, 1) / 2)[:, None, :]).sum(-1)  # sum_k |w| * step_k / 2
    err = (cpu_quant.ops().q4_linear(x, nibbles, dm) - exact).abs()
    assert (err <= bound + 1e-4).all()
    assert err.max() > 0  # the rounding is there: the twin, not the exact product, is what matches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_dequantize_is_the_unpacked_formula(dtype):
    q, d, m = q4_case(48, 320)
    nibbles, dm = pack_q4(q, d, m)
    want = dequantize_q4_ref(nibbles, dm).to(dtype)
    got = cpu_quant.ops().q4_dequantize(nibbles, dm, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@BUILDS
def test_q8_dequantize_is_torchs_bf16_product(portable):
    w = torch.randint(-127, 128, (37, 200), generator=g, dtype=torch.int8)  # 200: a tail past the 16-wide loop
    scales = (torch.rand(37, generator=g) * 0.01).to(torch.bfloat16)
    got = cpu_quant.ops(portable).q8_dequantize(w, scales)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, w.to(torch.bfloat16) * scales[:, None], atol=0, rtol=0)


@pytest.mark.parametrize("n", [300, 4097, 6000])  # one dequantized weight; past 2 slabs of 2048 rows, with a part slab
def test_q8_matmul_many_rows_is_the_bf16_product(n):
    w = torch.randint(-127, 128, (n, 64), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.01).to(torch.bfloat16)
    x = torch.randn(30, 64, generator=g).to(torch.bfloat16)
    got = cpu_quant.ops().q8_matmul(x, w, scales, 24, False)
    want = (x.float() @ (w.to(torch.bfloat16) * scales[:, None]).float().T).to(torch.bfloat16)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=8e-3)  # bf16 output, the sums' order


def test_amx_is_ready_exactly_where_the_cpu_has_amx_int8():
    import os
    import platform
    import re

    from servelab_kernels.cpp_build import cpu_features

    flags = cpu_features()
    has = "amx_int8" in flags and "avx512_bf16" in flags and "avx512_vnni" in flags
    assert not cpu_quant.amx_ready() or has
    release = tuple(int(p) for p in re.findall(r"\d+", platform.release())[:2])
    # (a build for another CPU may lack the op; Linux grants the tile state from 5.16 on)
    if os.environ.get("SERVELAB_CPP_MARCH", "native") in ("", "native") and release >= (5, 16):
        assert cpu_quant.amx_ready() == has


@pytest.mark.amx
@pytest.mark.parametrize("n, k", [(48, 64), (960, 576), (576, 1536)])  # 48: a last block of 16 weight rows
@pytest.mark.parametrize("rows", [1, 15, 17, 40])  # part tiles of 16 activation rows
def test_q8_gemm_amx_gives_the_gemvs_integer_sums(n, k, rows):
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    x[0, 5] = 40.0  # an outlier sets its row's scale
    ops = cpu_quant.ops()
    got32 = ops.q8_gemm_amx(x, w, scales)
    # exact integer sums: only the last float products' order differs from the twin's
    torch.testing.assert_close(got32, q8_linear_ref(x, w, scales), atol=0, rtol=1e-5)
    xb = x.bfloat16()
    got = ops.q8_gemm_amx(xb, w, scales)
    want = q8_linear_ref(xb, w, scales)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=8e-3)  # at most a bf16 step apart
    assert (got != want).float().mean() < 0.02
    torch.testing.assert_close(got, ops.q8_linear(xb, w, scales), atol=0, rtol=8e-3)  # and the GEMV's


@pytest.mark.amx
def test_q8_matmul_takes_the_amx_gemm_for_bf16_rows_unless_told_not_to():
    w = torch.randint(-127, 128, (96, 128), generator=g, dtype=torch.int8)
    scales = (torch.rand(96, generator=g) * 0.01).to(torch.bfloat16)
    ops = cpu_quant.ops()
    for rows in (1, 64):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        amx = ops.q8_gemm_amx(x, w, scales)
        assert torch.equal(ops.q8_matmul(x, w, scales, 16, True), amx)
        assert torch.equal(cpu_quant.q8_matmul(x, w, scales), amx)
        with cpu_quant.int_gemm(False):
            off = cpu_quant.q8_matmul(x, w, scales)
        assert torch.equal(off, ops.q8_linear(x, w, scales) if rows <= cpu_quant.Q8_GEMV_ROWS
                           else ops.q8_matmul(x, w, scales, 16, False))
    x = torch.randn(40, 128, generator=g)  # fp32 rows keep the fp32 GEMM over the dequantized weight
    assert torch.equal(ops.q8_matmul(x, w, scales, 16, True), ops.q8_matmul(x, w, scales, 16, False))
    odd = torch.randint(-127, 128, (96, 96), generator=g, dtype=torch.int8)  # K not a multiple of 64
    xo = torch.randn(40, 96, generator=g).bfloat16()
    # not the tiles' shape: oneDNN's INT8 GEMM where the build has it, else the dequantized GEMM
    other = ops.q8_gemm_int(xo, odd, scales) if cpu_quant.int_gemm_built() else ops.q8_matmul(xo, odd, scales, 16, False)
    assert torch.equal(ops.q8_matmul(xo, odd, scales, 16, True), other)


@pytest.mark.vnni
@pytest.mark.parametrize("n, k", [(48, 64), (960, 576), (576, 1536), (40, 3000), (70, 72)])  # 3000: sums past int32
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_q8_gemm_int_gives_the_gemvs_integer_sums(n, k, rows):
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    x[0, 5] = 40.0  # an outlier sets its row's scale
    x[-1, -1] = -30.0  # and one in the tail past the 16-wide loop
    ops = cpu_quant.ops()
    # exact integer sums recombined as the twin does, multiplied in its order: equal, not close
    torch.testing.assert_close(ops.q8_gemm_int(x, w, scales), q8_linear_ref(x, w, scales), atol=0, rtol=0)
    xb = x.bfloat16()
    got = ops.q8_gemm_int(xb, w, scales)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, q8_linear_ref(xb, w, scales), atol=0, rtol=0)
    if k % 32 == 0:  # the GEMV's numbers, at any number of rows
        torch.testing.assert_close(got, ops.q8_linear(xb, w, scales), atol=0, rtol=8e-3)


@BUILDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_gemv_gives_its_twins_int8_sums(dtype, portable):
    """levels=127: the activations as INT8 per row, through the same GEMV (the sums stay exact)."""
    w = torch.randint(-127, 128, (96, 576), generator=g, dtype=torch.int8)
    scales = (torch.rand(96, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    x = torch.randn(5, 576, generator=g).to(dtype)
    x[1, 7] = 25.0
    got = cpu_quant.ops(portable).q8_linear(x, w, scales, cpu_quant.A8)
    want = q8_linear_ref(x, w, scales, cpu_quant.A8)
    assert got.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=8e-3)  # bf16: one rounding
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # and not the 14-bit path's numbers: the coarser rounding shows
    assert not torch.allclose(got.float(), q8_linear_ref(x, w, scales).float(), atol=1e-3, rtol=1e-3)


@pytest.mark.vnni
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (70, 72)])
def test_w8a8_matmul_is_the_same_int8_sums_at_any_number_of_rows(n, k):
    """The GEMV (up to q8_gemv_rows) and the single INT8 GEMM above it give the twin's numbers, so a
    W8A8 step's result does not depend on how many rows it has; no float GEMM under int_gemm(False)."""
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    x = torch.randn(40, k, generator=g).bfloat16()
    x[3, 2] = -30.0
    want = q8_linear_ref(x, w, scales, cpu_quant.A8)
    ops = cpu_quant.ops()
    torch.testing.assert_close(ops.q8_gemm_int(x, w, scales, cpu_quant.A8), want, atol=0, rtol=0)
    if k % 32:  # the GEMV wants K a multiple of 32 (Int8Linear keeps other widths on the twin)
        return
    for rows in (1, cpu_quant.q8_gemv_rows(), cpu_quant.q8_gemv_rows() + 1, 40):
        # the GEMV sums in float per block, the GEMM in int32: one bf16 rounding apart at most
        torch.testing.assert_close(cpu_quant.q8_matmul(x[:rows], w, scales, cpu_quant.A8), want[:rows], atol=0, rtol=8e-3)
        with cpu_quant.int_gemm(False):  # the GEMV at any rows, never a float GEMM
            torch.testing.assert_close(cpu_quant.q8_matmul(x[:rows], w, scales, cpu_quant.A8), want[:rows], atol=0,
                                       rtol=8e-3)
    with pytest.raises(RuntimeError, match="levels"):
        ops.q8_gemm_int(x, w, scales, 200)


def test_w8a8_error_is_within_half_an_activation_step():
    """The twin against the exact product of the INT8 weights: each activation moves at most half of
    its row's step (absmax / 127), so |error| <= step / 2 * sum_k |q w|."""
    w = torch.randint(-127, 128, (64, 256), generator=g, dtype=torch.int8)
    scales = torch.rand(64, generator=g) * 0.01 + 1e-4
    x = torch.randn(6, 256, generator=g)
    x[2, 9] = 12.0
    exact = (x.double() @ (w.double() * scales.double()[:, None]).T)
    got = q8_linear_ref(x, w, scales, cpu_quant.A8).double()
    step = x.abs().amax(-1, keepdim=True).double() / 127
    bound = step / 2 * (w.double().abs() * scales.double()[:, None]).sum(-1)[None] * (1 + 1e-5) + 1e-6
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).abs().max() > 10 * (q8_linear_ref(x, w, scales).double() - exact).abs().max()


@pytest.mark.vnni
def test_q8_gemm_int_splits_a_wide_output_into_calls_without_changing_it():
    """A vocabulary-wide head at many rows runs in column slices (at most 16 MB of sums a call)."""
    w = torch.randint(-127, 128, (20000, 64), generator=g, dtype=torch.int8)
    scales = torch.rand(20000, generator=g) * 0.01
    x = torch.randn(300, 64, generator=g).bfloat16()  # 600 rows of sums: 6,976 columns a call, a part slice last
    torch.testing.assert_close(cpu_quant.ops().q8_gemm_int(x, w, scales), q8_linear_ref(x, w, scales), atol=0, rtol=0)


def check_int_gemm_dispatch(matmul, gemv, gemm, op, gemv_rows, int_rows: int, plain_rows: int):
    """`matmul(x)` (cpu_quant's dispatch, K = 128) is `gemv(x)` up to `int_rows` bf16 rows and the
    integer `gemm(x)` above; under int_gemm(False) the GEMV up to `plain_rows`, else the op's
    dequantized GEMM (`op(x, int_gemm)`), which fp32 rows take whatever the switch says."""
    assert gemv_rows() == int_rows
    for rows in (int_rows, int_rows + 1, 64):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        assert torch.equal(matmul(x), gemv(x) if rows <= int_rows else gemm(x))
        with cpu_quant.int_gemm(False):
            assert gemv_rows() == plain_rows
            off = matmul(x)
        assert torch.equal(off, gemv(x) if rows <= plain_rows else op(x, False))
    x = torch.randn(40, 128, generator=g)  # fp32 rows keep the fp32 GEMM over the dequantized weight
    assert torch.equal(op(x, True), op(x, False))


@pytest.mark.vnni
def test_q8_matmul_takes_the_int8_gemm_above_its_gemv_rows_unless_told_not_to():
    w = torch.randint(-127, 128, (96, 128), generator=g, dtype=torch.int8)
    scales = (torch.rand(96, generator=g) * 0.01).to(torch.bfloat16)
    ops = cpu_quant.ops()
    if cpu_quant.amx_ready():  # the tiles come first there (the test above)
        with cpu_quant.int_gemm(False):
            assert cpu_quant.q8_gemv_rows() == cpu_quant.Q8_GEMV_ROWS
        return
    check_int_gemm_dispatch(lambda x: cpu_quant.q8_matmul(x, w, scales), lambda x: ops.q8_linear(x, w, scales),
                            lambda x: ops.q8_gemm_int(x, w, scales), lambda x, on: ops.q8_matmul(x, w, scales, 16, on),
                            cpu_quant.q8_gemv_rows, cpu_quant.Q8_INT_GEMV_ROWS, cpu_quant.Q8_GEMV_ROWS)


@pytest.mark.parametrize("n", [300, 4097])
def test_q8_matmul_many_fp32_rows_stays_in_fp32(n):
    """fp32 activations get an fp32 GEMM (an AVX2-only CPU runs bf16 GEMMs 8x slower), not a bf16 one."""
    w = torch.randint(-127, 128, (n, 64), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.01).to(torch.bfloat16)
    x = torch.randn(30, 64, generator=g)
    got = cpu_quant.ops().q8_matmul(x, w, scales, 24, False)
    assert got.dtype == torch.float32
    # fp32 sums: far inside bf16's rounding (4e-3 relative), which the old path added
    torch.testing.assert_close(got, x @ (w.float() * scales.float()[:, None]).T, atol=1e-5, rtol=1e-5)


@pytest.mark.vnni
@pytest.mark.parametrize("n, k", [(32, 64), (960, 576), (576, 1536), (70, 192), (3, 128)])  # part blocks of 32 rows
@pytest.mark.parametrize("rows", [1, 7, 13, 40])  # whole tiles of 3 rows and 1-2 left over
def test_q4_gemm_int_is_its_twin(n, k, rows):
    q, d, m = q4_case(n, k)
    nibbles, dm = pack_q4(q, d, m)
    x = torch.randn(rows, k, generator=g)
    x[0, 5] = 40.0  # an outlier sets its group's scale
    ops = cpu_quant.ops()
    # exact integer group sums, scaled and added in another order than the twin's: fp32 rounding only
    torch.testing.assert_close(ops.q4_gemm_int(x, nibbles, dm), q4_gemm_ref(x, nibbles, dm), atol=2e-5, rtol=1e-5)
    xb = x.bfloat16()
    got = ops.q4_gemm_int(xb, nibbles, dm)
    assert got.dtype == torch.bfloat16
    exact = q4_gemm_ref(xb.float(), nibbles, dm)  # the twin's sums before the output's rounding
    torch.testing.assert_close(got.float(), exact, atol=1e-4, rtol=4e-3)  # one bf16 rounding (2^-8) of them
    assert (got != exact.bfloat16()).float().mean() < 0.05  # and mostly the same rounding


@pytest.mark.vnni
def test_q4_gemm_int_rounds_activations_far_less_than_the_gemv():
    """14-bit activations per group against the GEMV's int8: both against the exact product with the
    INT4 weight, on rows with an outlier (a group's other inputs lose the most)."""
    nibbles, dm = pack_q4(*q4_case(256, 576))
    x = torch.randn(24, 576, generator=g)
    x[:, 7] = 30.0
    exact = x.double() @ dequantize_q4_ref(nibbles, dm).double().T
    ops = cpu_quant.ops()
    gemm_err = (ops.q4_gemm_int(x, nibbles, dm).double() - exact).abs().mean()
    gemv_err = (ops.q4_linear(x, nibbles, dm).double() - exact).abs().mean()
    assert gemm_err < gemv_err / 30  # 64x finer steps


@pytest.mark.vnni
def test_q4_matmul_takes_the_int4_gemm_above_its_gemv_rows_unless_told_not_to():
    nibbles, dm = pack_q4(*q4_case(96, 128))
    ops = cpu_quant.ops()
    check_int_gemm_dispatch(lambda x: cpu_quant.q4_matmul(x, nibbles, dm), lambda x: ops.q4_linear(x, nibbles, dm),
                            lambda x: ops.q4_gemm_int(x, nibbles, dm), lambda x, on: ops.q4_matmul(x, nibbles, dm, 12, on),
                            cpu_quant.q4_gemv_rows, cpu_quant.Q4_INT_GEMV_ROWS, cpu_quant.Q4_GEMV_ROWS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [300, 4097, 6000])  # one dequantized weight; past 2 slabs of 2048 rows, with a part slab
def test_q4_matmul_many_rows_is_the_product_in_the_activations_dtype(n, dtype):
    q, d, m = q4_case(n, 128)
    nibbles, dm = pack_q4(q, d, m)
    x = torch.randn(20, 128, generator=g).to(dtype)
    got = cpu_quant.ops().q4_matmul(x, nibbles, dm, 12, False)  # the dequantized GEMM
    assert got.dtype == dtype
    w = dequantize_q4_ref(nibbles, dm).to(dtype).float()
    want = (x.float() @ w.T).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=8e-3)  # the sums' order
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("rows", [1, 5, 12, 13, 40])  # the GEMV up to q4_gemv_rows(), then the dequantized GEMM (fp32)
@pytest.mark.parametrize("group", [32, 128])
def test_int4_module_on_both_paths(rows, group):
    w, bias = torch.randn(80, 256, generator=g), torch.randn(80, generator=g)
    fast = Int4Linear.from_weight(w, bias, group, fast=True)
    ref = Int4Linear.from_weight(w, bias, group, fast=False)
    assert fast.layout == "cpu_q4"
    x = torch.randn(rows, 256, generator=g)
    # the scale and offset stored as float16: half an ulp of each (offsets reach about 4 here)
    torch.testing.assert_close(fast.dequantized_weight(), ref.dequantized_weight(), atol=5e-3, rtol=1e-3)
    want = x @ fast.dequantized_weight().T + bias  # its float16 scales and offsets
    if rows <= cpu_quant.q4_gemv_rows():  # the GEMV's own rounding of x
        want = q4_linear_ref(x, fast.weight_packed, fast.dm) + bias
    torch.testing.assert_close(fast(x), want, atol=1e-4, rtol=1e-4)


def test_the_cpp_kv_write_is_the_reference():
    kc = torch.zeros(6, 2, 4, 16, dtype=torch.bfloat16)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    k, v = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    slots = torch.tensor([3, 4, 21, 9, 0])  # across blocks, out of order
    ref_attention.write_kv(k, v, kc, vc, slots)
    cpu_attention.write_kv(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and kc.abs().sum() > 0


def test_the_cpp_kv_write_reads_views_of_one_qkv_row_in_place():
    # the decode plan hands k and v narrowed from one [tokens, q + k + v] output: rows strided, D contiguous
    qkv = torch.randn(5, 6 * 16, generator=g).bfloat16()
    k, v = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:96].view(5, 2, 16)
    assert not k.is_contiguous() and not v.is_contiguous()
    kc = torch.zeros(6, 2, 4, 16, dtype=torch.bfloat16)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    slots = torch.tensor([3, 4, 21, 9, 0])
    ref_attention.write_kv(k.contiguous(), v.contiguous(), kc, vc, slots)
    cpu_attention.write_kv(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and not torch.equal(kc, vc)


def test_concatenated_layers_compute_the_same_outputs():
    from core.model.fuse import concat_rows

    x = torch.randn(3, 128, generator=g)
    for make in (lambda n: Int4Linear.from_weight(torch.randn(n, 128, generator=g), None, 32),
                 lambda n: Int8Linear.from_linear(nn.Linear(128, n)),
                 lambda n: nn.Linear(128, n)):
        parts = [make(n) for n in (64, 32, 32)]
        fused = concat_rows(parts)
        want = torch.cat([p(x) for p in parts], dim=-1)
        torch.testing.assert_close(fused(x), want, atol=1e-5, rtol=1e-5)
    mixed = [nn.Linear(128, 8), Int8Linear.from_linear(nn.Linear(128, 8))]
    assert concat_rows(mixed) is None  # a kept float layer beside a quantized one stays apart


def test_a_fused_model_gives_the_same_logits(tiny_dirs):
    from core.model.fuse import fuse_projections
    from core.model.loader import load_model

    loaded = load_model(tiny_dirs["llama"], dtype="fp32")
    ids, pos = torch.tensor([5, 6, 7, 8, 9]), torch.arange(5)
    with torch.inference_mode():
        before = loaded.model.compute_logits(loaded.model(ids, pos))
        fuse_projections(loaded.model)
        after = loaded.model.compute_logits(loaded.model(ids, pos))
    assert loaded.model.fused_projections == 2 * loaded.model.args.num_layers
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


def test_the_ops_trace_under_compile():
    nibbles, dm = pack_q4(*q4_case(32, 64))
    x = torch.randn(2, 64, generator=g)
    for op, args in ((cpu_quant.ops().q4_linear, (x, nibbles, dm)),
                     (cpu_quant.ops().q8_linear, (x, torch.ones(16, 64, dtype=torch.int8), torch.ones(16))),
                     (cpu_quant.ops().q4_dequantize, (nibbles, dm, torch.bfloat16)),
                     (cpu_quant.ops().q8_dequantize, (torch.ones(16, 64, dtype=torch.int8), torch.ones(16))),
                     (cpu_quant.ops().q8_matmul, (x.bfloat16(), torch.ones(16, 64, dtype=torch.int8), torch.ones(16),
                                                  16, True)),
                     (cpu_quant.ops().q4_matmul, (x.bfloat16(), nibbles, dm, 1, True))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    if cpu_quant.amx_ready():
        torch.library.opcheck(cpu_quant.ops().q8_gemm_amx, (x, torch.ones(16, 64, dtype=torch.int8), torch.ones(16)),
                              test_utils=("test_schema", "test_faketensor"))
    if cpu_quant.int_gemm_built():
        torch.library.opcheck(cpu_quant.ops().q8_gemm_int, (x, torch.ones(16, 64, dtype=torch.int8), torch.ones(16)),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(cpu_quant.ops().q4_gemm_int, (x.bfloat16(), nibbles, dm),
                              test_utils=("test_schema", "test_faketensor"))
