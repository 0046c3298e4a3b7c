"""INT8 weights laid out once for the build's packed GEMM (servelab_kernels.int8_pack: csrc q8_gemm_vnni
on AVX512-VNNI, q8_gemm_madd on AVX2): the layouts' twins, the GEMMs' integer sums against oneDNN's and
the exact twin, the dispatch, the module."""

import pytest
import torch
from torch import nn

from servelab_kernels import cpu_quant, int8_pack, linear
from servelab_kernels.cpu_quant import A8, BF16_DOT_ROWS, Q16
from servelab_kernels.cpu_quant_ref import q8_bf16_ref, q8_linear_ref
from servelab_kernels.quant import Int8Linear

g = torch.Generator().manual_seed(3)


def case(n: int, k: int, rows: int):
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = (torch.rand(n, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g)
    x[0, 5] = 40.0  # an outlier sets its row's scale
    x[-1, -1] = -30.0  # and one in the tail past the 16-wide loops
    return w, scales, x


@pytest.mark.vnni
def test_the_layout_is_its_twin():
    w = torch.randint(-127, 128, (64, 36), generator=g, dtype=torch.int8)
    p = int8_pack.pack_vnni(w)
    assert p.shape == (4, 9, 16, 4) and p.dtype == torch.uint8
    assert p[1, 2, 3, 1].item() == w[16 + 3, 2 * 4 + 1].item() + 128
    assert torch.equal(int8_pack.unpack_vnni(p), w)


@pytest.mark.vnni
@pytest.mark.parametrize("levels", [Q16, A8])
@pytest.mark.parametrize("n, k", [(64, 36), (960, 576), (576, 1536), (32, 3000)])  # 3000: sums past int32
@pytest.mark.parametrize("rows", [1, 7, 13, 100, 300])  # register tiles of 6, sweeps of 96 part rows
def test_the_packed_gemm_gives_the_gemvs_integer_sums(n, k, rows, levels):
    w, scales, x = case(n, k, rows)
    ops = cpu_quant.ops()
    xb, got = x.bfloat16(), assert_the_twins_sums(ops.q8_gemm_vnni, int8_pack.pack_vnni(w), w, scales, x, levels)
    assert torch.equal(got, ops.q8_gemm_int(xb, w, scales, levels))  # oneDNN's GEMM over the plain weight


def assert_the_twins_sums(gemm, p, w, scales, x, levels) -> torch.Tensor:
    """A packed GEMM's exact integer sums, multiplied as the twin does: equal to it, not close. Returns
    its output for x in bf16 (bf16 out)."""
    torch.testing.assert_close(gemm(x, p, scales, levels), q8_linear_ref(x, w, scales, levels), atol=0, rtol=0)
    got = gemm(x.bfloat16(), p, scales, levels)
    assert got.dtype == torch.bfloat16
    return got


def bf16_dot_built() -> bool:
    return hasattr(cpu_quant.ops(), "q8_gemm_bf16")


@pytest.mark.vnni
@pytest.mark.parametrize("n, k", [(64, 36), (96, 576), (576, 1536), (32, 3000)])  # panels of 3 blocks, tails of 1, 2
@pytest.mark.parametrize("rows", [1, 7, 8, 13, 100])  # register tiles of 8 rows and every remainder
def test_the_bf16_dot_gemm_is_its_twin(n, k, rows):
    if not bf16_dot_built():  # AVX512-VNNI without AVX512-BF16 (Ice Lake): the op is not built, nothing calls it
        assert not hasattr(cpu_quant.ops(), "q8_gemm_bf16")
        return
    w, scales, x = case(n, k, rows)
    xb = x.bfloat16()
    got = cpu_quant.ops().q8_gemm_bf16(xb, int8_pack.pack_vnni(w), scales)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # the twin sums the same exact products in another order, in fp32: its result within one bf16
    # rounding, plus fp32's summation error where the products cancel
    want = q8_bf16_ref(xb, w, scales)
    scale = (xb.float().abs() @ w.float().abs().T * scales.float()).amax()
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5 * scale.item())
    # finer than the 14-bit sums: closer to the exact product than the GEMV is
    exact = (xb.double() @ w.double().T) * scales.double()
    assert (got.double() - exact).abs().mean() <= (q8_linear_ref(xb, w, scales).double() - exact).abs().mean()


@pytest.mark.vnni
@pytest.mark.parametrize("levels", [Q16, A8])
def test_q8_matmul_takes_the_packed_gemm_up_to_its_rows(levels):
    w, scales, _ = case(96, 128, 1)
    other = int8_pack.pack_vnni(torch.randint(-127, 128, (96, 128), generator=g, dtype=torch.int8))
    ops = cpu_quant.ops()
    for rows in (12, BF16_DOT_ROWS - 1, BF16_DOT_ROWS, 100, 200, 300):  # 200 rows of 14-bit activations: 400 part rows
        x = torch.randn(rows, 128, generator=g).bfloat16()
        parts = 2 * rows if levels == Q16 else rows
        # handed another weight's copy, the op shows which GEMM ran
        got = cpu_quant.q8_matmul(x, w, scales, levels, other)
        if levels == Q16 and rows >= BF16_DOT_ROWS and bf16_dot_built():
            want = ops.q8_gemm_bf16(x, other, scales)
        elif parts <= 256:
            want = ops.q8_gemm_vnni(x, other, scales, levels)
        else:
            want = ops.q8_gemm_int(x, w, scales, levels)
        assert torch.equal(got, want), rows
    x = torch.randn(100, 128, generator=g).bfloat16()
    with cpu_quant.bf16_dot(False):  # off: the 14-bit GEMM of 200 part rows over the copy
        assert torch.equal(cpu_quant.q8_matmul(x, w, scales, levels, other), ops.q8_gemm_vnni(x, other, scales, levels))
    with cpu_quant.int_gemm(False):  # off: no integer GEMM at all, packed or not
        x = torch.randn(40, 128, generator=g).bfloat16()
        assert not torch.equal(cpu_quant.q8_matmul(x, w, scales, levels, other), ops.q8_gemm_vnni(x, other, scales, levels))


def test_a_packed_copy_is_made_only_where_it_applies(monkeypatch):
    lin = nn.Linear(64, 96, bias=False)
    with int8_pack.packing(False):
        assert Int8Linear.from_linear(lin).packed is None
    assert Int8Linear.from_linear(nn.Linear(64, 72)).packed is None  # 72 outputs: not panels of 16 (nor 32)
    # 80 outputs: panels of 16 (the AVX2 layout), not of 32 (VNNI's)
    assert (Int8Linear.from_linear(nn.Linear(64, 80)).packed is not None) == (int8_pack.layout() == "madd")
    assert Int8Linear.from_linear(lin, fast=False).packed is None
    monkeypatch.setattr(linear, "PACK_MEMORY_SHARE", 0.0)  # no room left under the packed copies' share
    assert Int8Linear.from_linear(lin).packed is None
    monkeypatch.undo()
    m = Int8Linear.from_linear(lin)
    assert (m.packed is not None) == (int8_pack.layout() is not None)
    assert int8_pack.layout() == ("vnni" if cpu_quant.int_gemm_built() else "madd" if _madd_built() else None)
    assert "packed" not in m.state_dict()


@pytest.mark.parametrize("a8", [False, True])
def test_an_int8_layer_gives_the_same_outputs_with_and_without_its_packed_copy(a8):
    lin = nn.Linear(576, 960, bias=True)
    packed = Int8Linear.from_linear(lin, a8=a8)
    with int8_pack.packing(False):
        plain = Int8Linear.from_linear(lin, a8=a8)
    # from BF16_DOT_ROWS rows of 14-bit activations the packed copy multiplies exact bf16 activations
    # (q8_gemm_bf16), where the plain weight keeps the 14-bit sums: there the packed side is its twin
    finer = not a8 and packed.packed is not None and bf16_dot_built()
    # the AVX2 copy takes every row count with the GEMV's integer sums, where the plain weight's many
    # rows take a float GEMM over it dequantized: there the packed side is the exact twin
    madd = int8_pack.layout() == "madd" and packed.packed is not None
    for rows in (1, 2, 3, 9, 63, 64, 200):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        if madd and rows <= 2:  # the GEMV over the plain weight, either way
            assert torch.equal(packed(x), plain(x)), rows
        elif madd:
            levels = A8 if a8 else Q16
            assert torch.equal(packed(x), q8_linear_ref(x, packed.weight_q, packed.scales, levels) + packed.bias)
            torch.testing.assert_close(packed(x), plain(x), rtol=0.03, atol=0.02 if a8 else 0.01)
        elif finer and rows >= BF16_DOT_ROWS:
            want = q8_bf16_ref(x, packed.weight_q, packed.scales) + packed.bias
            torch.testing.assert_close(packed(x), want, rtol=8e-3, atol=2e-3)
            torch.testing.assert_close(packed(x), plain(x), rtol=0.03, atol=0.02)  # 14-bit vs bf16 activations
        else:
            assert torch.equal(packed(x), plain(x)), rows
    fused = Int8Linear.concat([packed, packed])
    assert (fused.packed is not None) == (packed.packed is not None)
    x = torch.randn(32, 576, generator=g).bfloat16()
    if not madd:
        assert torch.equal(fused(x), torch.cat([plain(x), plain(x)], dim=-1))
    if finer or madd:  # the fused copy is both copies' rows
        x = torch.randn(64, 576, generator=g).bfloat16()
        assert torch.equal(fused(x), torch.cat([packed(x), packed(x)], dim=-1))


@pytest.mark.vnni
def test_the_packed_ops_trace_under_compile():
    w, scales, x = case(32, 64, 2)
    p = int8_pack.pack_vnni(w)
    ops = cpu_quant.ops()
    for op, args in ((ops.q8_matmul, (x.bfloat16(), w, scales, 1, True, Q16, p)),
                     (ops.q8_gemm_vnni, (x.bfloat16(), p, scales, A8)), (ops.q8_pack_vnni, (w,)),
                     *([(ops.q8_gemm_bf16, (x.bfloat16(), p, scales))] if bf16_dot_built() else [])):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# ---- the AVX2 layout and its vpmaddwd GEMM (CPUs without AVX512-VNNI) ---------------------------


def _madd_built() -> bool:
    return hasattr(cpu_quant.ops(), "q8_gemm_madd")


@pytest.mark.madd
def test_the_madd_layout_is_its_twin():
    w = torch.randint(-127, 128, (48, 40), generator=g, dtype=torch.int8)
    p = int8_pack.pack_madd(w)
    assert p.shape == (3, 20, 16, 2) and p.dtype == torch.int8
    assert p[1, 2, 3, 1].item() == w[16 + 3, 2 * 2 + 1].item()
    assert torch.equal(int8_pack.unpack_madd(p), w)
    assert int8_pack.pack_madd(w[:40]) is None  # 40 outputs: not panels of 16
    assert int8_pack.pack_madd(torch.zeros(32, 36, dtype=torch.int8)) is None  # inputs not in lines of 8
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        cpu_quant.ops().q8_pack_madd(w[:40])


@pytest.mark.madd
@pytest.mark.parametrize("levels", [Q16, A8])
@pytest.mark.parametrize("n, k", [(48, 40), (960, 576), (576, 1536), (32, 3008)])  # 3008: sums past int32
@pytest.mark.parametrize("rows", [1, 5, 13, 100])  # register tiles of 6 and remainders, sweeps of 48 rows
def test_the_madd_gemm_gives_the_twins_integer_sums(n, k, rows, levels):
    w, scales, x = case(n, k, rows)
    p, ops = int8_pack.pack_madd(w), cpu_quant.ops()
    xb, got = x.bfloat16(), assert_the_twins_sums(ops.q8_gemm_madd, p, w, scales, x, levels)
    assert torch.equal(got, q8_linear_ref(xb, w, scales, levels))  # in bf16 too
    # the GEMV's sums too: it adds them as floats by lane, so within fp32 rounding of its sum
    if k % 32 == 0:  # (the GEMV takes whole groups of 32 inputs)
        torch.testing.assert_close(got.float(), ops.q8_linear(xb, w, scales, levels).float(), rtol=8e-3, atol=1e-6)
    zero = ops.q8_gemm_madd(torch.zeros(2, k), p, scales, levels)  # a row of zeros: scale 0, output 0
    assert torch.equal(zero, torch.zeros(2, n))


@pytest.mark.madd
def test_the_madd_gemm_refuses_a_weight_it_was_not_given():
    w, scales, x = case(48, 40, 3)
    ops = cpu_quant.ops()
    with pytest.raises(RuntimeError, match="packed as q8_pack_madd lays it out"):
        ops.q8_gemm_madd(x, w, scales, Q16)  # the plain weight
    with pytest.raises(RuntimeError, match="one scale an output"):
        ops.q8_gemm_madd(x, int8_pack.pack_madd(w), scales[:32], Q16)


@pytest.mark.madd
@pytest.mark.parametrize("levels", [Q16, A8])
def test_q8_matmul_takes_the_madd_gemm_from_three_rows(levels):
    w, scales, _ = case(96, 128, 1)
    other = int8_pack.pack_madd(torch.randint(-127, 128, (96, 128), generator=g, dtype=torch.int8))
    ops = cpu_quant.ops()
    for rows in (1, 2, 3, 4, 17, 64, 300):
        x = torch.randn(rows, 128, generator=g)
        # handed another weight's copy, the op shows which GEMM ran: the GEMV over the plain weight up to 2 rows
        got = cpu_quant.q8_matmul(x, w, scales, levels, other)
        if rows <= 2:
            assert torch.equal(got, ops.q8_linear(x, w, scales, levels)), rows
        else:
            assert torch.equal(got, ops.q8_gemm_madd(x, other, scales, levels)), rows
    with cpu_quant.int_gemm(False):  # off: the GEMV and the dequantized GEMM over the plain weight
        x = torch.randn(40, 128, generator=g)
        assert not torch.equal(cpu_quant.q8_matmul(x, w, scales, levels, other), ops.q8_gemm_madd(x, other, scales, levels))


@pytest.mark.madd
def test_the_madd_ops_trace_under_compile():
    w, scales, x = case(32, 64, 2)
    p = int8_pack.pack_madd(w)
    ops = cpu_quant.ops()
    for op, args in ((ops.q8_matmul, (x, w, scales, 1, True, Q16, p)), (ops.q8_gemm_madd, (x, p, scales, A8)),
                     (ops.q8_pack_madd, (w,))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
