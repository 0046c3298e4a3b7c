"""bf16 linears on bf16 dot products over a weight packed once (servelab_kernels.dot_linear,
csrc/cpu_gemm_dot.cpp with the register tiles of csrc/cpu_bf16_tile.cpp): the layout, the kernel
against the rounded fp32 sum, the bias, strided rows, the dispatch of Linear, the refusals."""

import pytest
import torch
import torch.nn.functional as F

from servelab_kernels import amx_linear, cpu_ops, dot_linear
from servelab_kernels import linear as lin
from tests.test_linear import _assert_rounded_fp32_sum, _randn


def built() -> bool:
    """Whether this machine's build has the tiles (AVX512-BF16): without, the op refuses (tested below)."""
    return bool(cpu_ops.load().dot_linear_ready())


def test_the_layout_by_its_own_words():
    w = _randn(48, 36)
    p = dot_linear.pack(w)
    assert p.shape == (3, 18, 16, 2) and p.is_contiguous()
    assert p[2, 7, 5, 1] == w[2 * 16 + 5, 2 * 7 + 1]  # block 2, line 7, output 5 of the block, second of the pair
    assert torch.equal(p.permute(0, 2, 1, 3).reshape(48, 36), w)


@pytest.mark.parametrize("m", [1, 7, 8, 17, 64, 203])  # a tile of 8 rows, every remainder, many tiles
@pytest.mark.parametrize("n, k", [(16, 64), (32, 36), (48, 576), (960, 576), (576, 1536), (80, 100)])
def test_dot_linear_is_the_rounded_fp32_sum(m, n, k):  # panels of 3 blocks and tails of 1 and 2
    x, w = _randn(m, k), _randn(n, k, scale=k**-0.5)
    if not built():
        with pytest.raises(RuntimeError, match="this build has no AVX512-BF16"):
            dot_linear.linear(x, dot_linear.pack(w), None)
        return
    got = dot_linear.linear(x, dot_linear.pack(w), None)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _assert_rounded_fp32_sum(got, x, w)


def test_dot_linear_reads_strided_rows_and_adds_the_bias_before_rounding():
    if not built():
        return  # the refusal is tested above
    wide, w, b = _randn(40, 700), _randn(96, 576, scale=0.05), _randn(96)
    x = wide[:, 50:626]  # rows 700 apart, columns contiguous
    packed = dot_linear.pack(w)
    plain = dot_linear.linear(x.contiguous(), packed, None)
    torch.testing.assert_close(dot_linear.linear(x, packed, None), plain, rtol=0, atol=0)
    biased = dot_linear.linear(x, packed, b)
    want = (x.float() @ w.float().T + b.float()).bfloat16()  # one rounding of the fp32 sum with the bias
    torch.testing.assert_close(biased, want, rtol=2**-7, atol=1e-3)
    assert (biased == want).double().mean().item() >= 0.99
    three = dot_linear.linear(_randn(2, 5, 576), packed, None)  # leading dimensions kept
    assert three.shape == (2, 5, 96)
    assert dot_linear.linear(_randn(0, 576), packed, None).shape == (0, 96)


def test_dot_linear_refuses_what_it_cannot_compute():
    packed = dot_linear.pack(_randn(32, 64))
    op = torch.ops.servelab_cpu_ops.dot_linear
    with pytest.raises(RuntimeError, match="dot_linear.pack of a bf16 weight \\[N, K\\] with x's K"):
        op(_randn(4, 96), packed, None)
    with pytest.raises(RuntimeError, match="bias \\[N\\]"):
        op(_randn(4, 64), packed, _randn(31))
    with pytest.raises(RuntimeError, match="x bf16"):
        op(torch.randn(4, 64), packed, None)
    assert not dot_linear.fits(_randn(40, 64)) and not dot_linear.fits(_randn(32, 63))


def test_a_linear_takes_the_dot_copy_where_it_serves_and_onednns_when_turned_off(monkeypatch):
    monkeypatch.setattr(amx_linear, "_READY", False)
    monkeypatch.setattr(dot_linear, "_READY", built())  # on an AMX CPU too: the rule, where the build has it
    layer = lin.Linear(64, 48, bias=True).requires_grad_(False)
    layer.weight.data, layer.bias.data = _randn(48, 64, scale=0.1), _randn(48)
    x = _randn(lin.GEMV_ROWS + 9, 64)
    out = layer(x)
    if built():
        assert layer.packed_copy().shape == (3, 32, 16, 2)  # the dot layout was made and taken
        assert torch.equal(out, dot_linear.linear(x, layer.packed_copy(), layer.bias))
    with dot_linear.enabled(False):
        assert lin._layout(layer.weight) == "onednn"
        off = layer(x)
    torch.testing.assert_close(out, off, rtol=2**-7, atol=1e-2)  # the same sums, another order
    torch.testing.assert_close(off, F.linear(x, layer.weight, layer.bias), rtol=2**-7, atol=1e-2)
    odd = lin.Linear(64, 40, bias=False).bfloat16().requires_grad_(False)  # 40 outputs: not blocks of 16
    odd(x)
    assert lin._layout(odd.weight) == "onednn"


def test_where_it_serves_it_takes_one_row_too_and_the_gemv_keeps_the_weights_it_has_no_copy_of(monkeypatch):
    if not built():
        return  # nothing to take: the GEMV's rules hold (tests/test_linear.py)
    monkeypatch.setattr(amx_linear, "_READY", False)
    monkeypatch.setattr(dot_linear, "_READY", True)
    monkeypatch.setattr(lin, "_NATIVE", True)
    calls, original = [], lin.gemv
    monkeypatch.setattr(lin, "gemv", lambda x, w: calls.append(x.shape[0]) or original(x, w))
    layer = lin.Linear(64, 32, bias=False).requires_grad_(False)
    layer.weight.data = _randn(32, 64, scale=0.1)
    x = _randn(1, 64)
    assert torch.equal(layer(x), dot_linear.linear(x, layer.packed_copy(), None)) and calls == []
    monkeypatch.setattr(lin, "_packed_bytes", 0)
    monkeypatch.setattr(lin, "PACK_MEMORY_SHARE", 0.0)  # no room for a copy: the GEMV, as before
    other = lin.Linear(64, 32, bias=False).requires_grad_(False)
    other.weight.data = _randn(32, 64, scale=0.1)
    other(x)
    assert calls == [1] and other.packed_copy() is None
