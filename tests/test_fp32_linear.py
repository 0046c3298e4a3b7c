"""fp32 linears on AVX2 FMA tiles over a weight packed once (servelab_kernels.fp32_linear,
csrc/cpu_gemm_fp32.cpp): the layout, the kernel against the fp64 product within fp32's summation
bound, the bias, strided rows, the dispatch of Linear, the native decode plan, the refusals; and
cpu_quant's fp32 panels, the same tiles over INT8 / INT4 weights."""

import pytest
import torch
import torch.nn.functional as F

from core.errors import ConfigError
from servelab_kernels import cpu_ops, cpu_quant, fp32_linear
from servelab_kernels import linear as lin
from tests.test_cpu_decode import _layouts, build, decode_logits, prompts

GEN = torch.Generator().manual_seed(11)


def built() -> bool:
    """Whether this machine's build has the tiles (AVX2 + FMA, no AVX-512): without, the op refuses."""
    return bool(cpu_ops.load().fp32_linear_ready())


def _randn(*shape, scale=1.0):
    return torch.randn(*shape, generator=GEN) * scale


def _assert_fp32_sum(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None):
    """got = x . w (+ b) within the fp32 summation bound: (K + 1) * 2^-24 * (sum |x||w| + |b|) of the fp64
    product, and within 1e-5 of the twin."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if b is not None else 0)
    assert ((got.double() - exact).abs() <= (x.shape[1] + 1) * 2.0**-24 * mag + 1e-30).all()
    torch.testing.assert_close(got, fp32_linear.linear_ref(x, w, b), rtol=1e-5, atol=1e-5)


def test_the_layout_by_its_own_words():
    w = _randn(48, 36)
    p = fp32_linear.pack(w)
    assert p.shape == (3, 36, 16) and p.is_contiguous()
    assert p[2, 7, 5] == w[2 * 16 + 5, 7]  # panel 2, input 7, output 5 of the panel
    assert torch.equal(p.transpose(1, 2).reshape(48, 36), w)
    assert fp32_linear.fits(w) and not fp32_linear.fits(_randn(40, 36))


def test_the_bf16_layout_by_its_own_words():
    """A bf16 line holds outputs 0-3, 8-11, 4-7, 12-15 (the order the tiles' unpacks undo), rounded to nearest."""
    w = _randn(48, 36)
    p = fp32_linear.pack(w, torch.bfloat16)
    assert p.shape == (3, 36, 16) and p.is_contiguous() and p.dtype == torch.bfloat16
    assert p[2, 7, 4] == w[2 * 16 + 8, 7].bfloat16() and p[2, 7, 9] == w[2 * 16 + 5, 7].bfloat16()
    order = torch.tensor(fp32_linear.BF16_LINE)
    assert torch.equal(p.transpose(1, 2)[:, order.argsort()].reshape(48, 36), w.bfloat16())
    with pytest.raises(ValueError, match="fp32 or bf16 lines, not torch.float16"):
        fp32_linear.pack(w, torch.float16)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 64])  # a tile of 6 rows, remainders of 1 and 5, many tiles
@pytest.mark.parametrize("n, k", [(16, 64), (48, 37), (960, 576), (576, 1536)])  # an odd K, SmolLM2's shapes
@pytest.mark.parametrize("lines", [torch.float32, torch.bfloat16])
def test_fp32_linear_is_the_fp32_sum(m, n, k, lines):
    """Over bf16 lines: the fp32 sum of the products with the weights rounded to bf16 (exact in fp32)."""
    x, w = _randn(m, k), _randn(n, k, scale=k**-0.5)
    if not built():
        with pytest.raises(RuntimeError, match="this build has no AVX2 FMA tiles"):
            fp32_linear.linear(x, fp32_linear.pack(w, lines), None)
        return
    got = fp32_linear.linear(x, fp32_linear.pack(w, lines), None)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    _assert_fp32_sum(got, x, w.to(lines).float())


def test_fp32_linear_reads_strided_rows_and_adds_the_bias():
    wide, w, b = _randn(40, 700), _randn(96, 576, scale=0.05), _randn(96)
    x = wide[:, 50:626]  # rows 700 apart, columns contiguous
    packed = fp32_linear.pack(w)
    if not built():  # strided rows and a bias meet the same refusal
        with pytest.raises(RuntimeError, match="this build has no AVX2 FMA tiles"):
            fp32_linear.linear(x, packed, b)
        return
    plain = fp32_linear.linear(x.contiguous(), packed, None)
    torch.testing.assert_close(fp32_linear.linear(x, packed, None), plain, rtol=0, atol=0)
    _assert_fp32_sum(fp32_linear.linear(x, packed, b), x, w, b)
    assert fp32_linear.linear(_randn(2, 5, 576), packed, None).shape == (2, 5, 96)  # leading dimensions kept
    assert fp32_linear.linear(_randn(0, 576), packed, None).shape == (0, 96)


def test_fp32_linear_refuses_what_it_cannot_compute():
    packed = fp32_linear.pack(_randn(32, 64))
    op = torch.ops.servelab_cpu_ops.fp32_linear
    with pytest.raises(RuntimeError, match="fp32_linear.pack of a weight \\[N, K\\] with x's K \\(fp32 or bf16 lines\\)"):
        op(_randn(4, 96), packed, None)
    with pytest.raises(RuntimeError, match="fp32 or bf16 lines"):
        op(_randn(4, 64), packed.half(), None)
    with pytest.raises(RuntimeError, match="bias \\[N\\]"):
        op(_randn(4, 64), packed, _randn(31))
    with pytest.raises(RuntimeError, match="x fp32"):
        op(_randn(4, 64).bfloat16(), packed, None)


def test_a_linear_takes_the_fp32_copy_where_it_serves_and_f_linear_when_turned_off():
    layer = lin.Linear(64, 48, bias=True).requires_grad_(False)
    layer.weight.data, layer.bias.data = _randn(48, 64, scale=0.1), _randn(48)
    x = _randn(1, 64)  # one row too
    out = layer(x)
    if built():
        assert layer.packed_copy().shape == (3, 64, 16)  # the fp32 layout was made and taken
        assert torch.equal(out, fp32_linear.linear(x, layer.packed_copy(), layer.bias))
    else:
        assert layer.packed_copy() is None and torch.equal(out, F.linear(x, layer.weight, layer.bias))
    with fp32_linear.enabled(False):
        assert not lin.use_packed(x, layer.weight)
        off = layer(x)
    assert torch.equal(off, F.linear(x, layer.weight, layer.bias))
    _assert_fp32_sum(out, x, layer.weight, layer.bias)
    odd = lin.Linear(64, 40, bias=False).requires_grad_(False)  # 40 outputs: not panels of 16
    assert torch.equal(odd(x), F.linear(x, odd.weight)) and odd.packed_copy() is None


def test_backend_fp32_linear_false_keeps_f_linear_for_its_own_engine(tiny_dirs):
    """`backend.fp32_linear=false` multiplies by the plain weights (F.linear) in that engine's steps only;
    an engine beside it keeps the tiles, in its native decode plan too."""
    base = [f"model.path={tiny_dirs['llama']}", "model.dtype=fp32", "attention=cpu"]
    if not built():
        with pytest.raises(ConfigError, match="backend.fp32_linear=true multiplies fp32 on AVX2 FMA tiles"):
            build(base + ["backend.fp32_linear=true"])
        return
    off, on = build(base + ["backend.fp32_linear=false"]), build(base + ["backend.fp32_linear=true"])
    a, _ = decode_logits(off, prompts(8))
    b, ran = decode_logits(on, prompts(8))
    assert not any(getattr(m, "_packed", None) for m in off.model.modules())  # no copy was made there
    assert _layouts(on) == {"fp32"} and fp32_linear.switch.on
    assert ran > 0  # the plan's FP32 layers ran decode steps
    for x, y in zip(a, b):  # the same products summed in another order
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_backend_fp32_linear_true_refuses_a_cpu_it_does_not_serve(tiny_dirs, monkeypatch):
    import plugins.backends.torch_backend as tb

    monkeypatch.setattr(tb.fp32_linear, "ready", lambda: False)
    with pytest.raises(ConfigError, match="backend.fp32_linear=true multiplies fp32 on AVX2 FMA tiles where the CPU "
                                          "has no AVX-512, and this CPU"):
        build([f"model.path={tiny_dirs['llama']}", "backend.fp32_linear=true"])


@pytest.mark.parametrize("n", [96, 4097])  # panels of 16 outputs; a count that is not takes the dequantized GEMM
@pytest.mark.parametrize("rows", [17, 40, 65])  # past the GEMVs' rows; whole 6-row tiles and 1-5 left over
def test_int8_and_int4_weights_times_many_fp32_rows_are_their_dequantized_product(n, rows):
    """On AVX2 builds fp32 rows multiply INT8 / INT4 weights dequantized a panel at a time (cpu_quant's
    fp32 panels, the same tiles): the same products as the dequantized weight's, summed in fp32."""
    ops, x = cpu_quant.ops(), _randn(rows, 128)
    w = torch.randint(-127, 128, (n, 128), generator=GEN, dtype=torch.int8)
    scales = (torch.rand(n, generator=GEN) * 0.01).to(torch.bfloat16)
    _assert_fp32_sum(ops.q8_matmul(x, w, scales, 16, True), x, w.float() * scales.float()[:, None])
    q = torch.randint(0, 16, (n, 128), generator=GEN)
    nibbles, dm = cpu_quant.pack_q4(q, torch.rand(n, 4, generator=GEN) * 0.02, -torch.rand(n, 4, generator=GEN) * 0.1)
    _assert_fp32_sum(ops.q4_matmul(x, nibbles, dm, 12, True), x, cpu_quant.dequantize_q4_ref(nibbles, dm).float())


def test_an_int8_weight_whose_inputs_are_not_whole_lanes_keeps_the_dequantized_gemm():
    """The panels transpose 8 inputs at a time: K = 36 takes the dequantized GEMM (it once wrote past
    the panel and corrupted the heap)."""
    x, w = _randn(20, 36), torch.randint(-127, 128, (32, 36), generator=GEN, dtype=torch.int8)
    scales = (torch.rand(32, generator=GEN) * 0.01).to(torch.bfloat16)
    _assert_fp32_sum(cpu_quant.ops().q8_matmul(x, w, scales, 16, True), x, w.float() * scales.float()[:, None])


def _rounded_weights(engine):
    """The engine with the weights its tiles take rounded to bf16 in place (their fp32 copies are made
    again: a copy follows its weight's version)."""
    with torch.no_grad():
        for m in engine.model.modules():
            if isinstance(m, lin.Linear) and fp32_linear.fits(m.weight):
                m.weight.copy_(m.weight.bfloat16().float())
    return engine


def test_backend_fp32_linear_weights_bf16_packs_half_the_bytes_and_rounds_only_the_weights(tiny_dirs):
    """`backend.fp32_linear_weights=bf16`: the linears' copies are bf16 lines (eager steps and the native
    plan alike), and the logits are those of the same fp32 model with its linear weights rounded to bf16."""
    base = [f"model.path={tiny_dirs['llama']}", "model.dtype=fp32", "attention=cpu"]
    half = build(base + ["backend.fp32_linear_weights=bf16"])
    if not built():  # the layout is never taken where the tiles did not build
        assert not any(getattr(m, "_packed", None) for m in half.model.modules())
        return
    a, ran = decode_logits(half, prompts(8))
    assert ran > 0 and _layouts(half) == {"fp32-bf16"}
    copies = [m._packed[3]["fp32-bf16"] for m in half.model.modules() if getattr(m, "_packed", None)]
    assert len(copies) >= 8 and all(c.dtype == torch.bfloat16 for c in copies if c is not None)
    rounded = _rounded_weights(build(base + ["backend.fp32_linear_weights=fp32"]))
    b, _ = decode_logits(rounded, prompts(8))
    assert _layouts(rounded) == {"fp32"}
    for x, y in zip(a, b):  # the same products (bf16 values in fp32), summed in the same order
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_backend_fp32_linear_weights_refuses_another_dtype(tiny_dirs):
    with pytest.raises(ConfigError, match="backend.fp32_linear_weights must be auto, fp32 or bf16, not 'fp16'"):
        build([f"model.path={tiny_dirs['llama']}", "backend.fp32_linear_weights=fp16"])


def test_the_evals_teacher_forced_logits_take_the_engines_weights(tiny_dirs):
    """The eval scores a variant with a forward outside the engine's steps: it must multiply by the
    copies the steps take (bf16 lines here), else `bf16-weights` would score the fp32 model."""
    from core.bench.evaluate import _kv_forward

    base = [f"model.path={tiny_dirs['llama']}", "model.dtype=fp32", "attention=cpu"]
    ids = prompts(1)[0] * 4
    plain = _kv_forward(build(base + ["backend.fp32_linear_weights=fp32"]), ids)
    half = build(base + ["backend.fp32_linear_weights=bf16"])
    got = _kv_forward(half, ids)
    if not built():
        assert torch.equal(got, plain)
        return
    assert _layouts(half) == {"fp32-bf16"} and not fp32_linear.bf16_lines.on  # the switch is back off
    rounded = _rounded_weights(build(base + ["backend.fp32_linear_weights=fp32"]))
    torch.testing.assert_close(got, _kv_forward(rounded, ids), rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-4  # and the rounding shows: the test can tell the two apart
