"""The bf16 GEMV of few-row linears on the CPU (servelab_kernels.linear, csrc/cpu_gemv.cpp) against its
twin, and when the model's linears take it."""

import pytest
import torch
import torch.nn.functional as F

from servelab_kernels import amx_linear, cpu_ops, dot_linear, fp32_linear
from servelab_kernels import linear as lin

GEN = torch.Generator().manual_seed(0)


def _randn(*shape, scale=1.0):
    return (torch.randn(*shape, generator=GEN) * scale).bfloat16()


def _assert_rounded_fp32_sum(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """got = bf16(fp32 sum of x . w): within the fp32 summation bound (K * 2^-24 * sum |x||w|) plus
    bf16's rounding (half a unit in the last place: 2^-8 relative, 8 significant bits) of the exact product in fp64,
    and bit-equal to the twin (torch's fp32 matmul, rounded once) wherever the two sums round alike."""
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    err = (got.double() - exact).abs()
    assert (err <= exact.abs() * 2.0**-8 * (1 + 2.0**-8) + bound * (1 + 2.0**-8) + 1e-30).all()
    assert (got == lin.linear_ref(x, w)).double().mean().item() >= 0.99


@pytest.mark.parametrize("m", [1, 3, 8, 11, 16])  # 11 and 16: more rows than one pass holds
@pytest.mark.parametrize("n, k", [(576, 576), (9, 100), (1000, 1536)])  # odd rows, a K tail, a long K
def test_the_gemv_is_the_rounded_fp32_sum(m, n, k):
    x, w = _randn(m, k), _randn(n, k, scale=k**-0.5)
    got = lin.gemv(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _assert_rounded_fp32_sum(got, x, w)


def test_the_gemv_reads_strided_rows():
    wide, w = _randn(4, 700), _randn(64, 576)
    x = wide[:, 50:626]  # rows 700 apart, columns contiguous
    torch.testing.assert_close(lin.gemv(x, w), lin.gemv(x.contiguous(), w),
                               rtol=0, atol=0)


def test_the_gemv_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and w \\[N, K\\]"):
        lin.gemv(_randn(2, 64), _randn(8, 32))
    with pytest.raises(RuntimeError, match="bf16 only"):
        lin.gemv(torch.randn(2, 64), torch.randn(8, 64))


def test_the_model_linear_takes_the_gemv_for_few_bf16_rows(monkeypatch):
    monkeypatch.setattr(lin, "_NATIVE", True)  # the dispatch rule, on any CPU kind
    monkeypatch.setattr(lin, "_AMX", False)  # (AMX CPUs: the tests at the end)
    monkeypatch.setattr(amx_linear, "_READY", False)
    monkeypatch.setattr(dot_linear, "_READY", False)  # (where it serves it takes every row: tests/test_dot_linear.py)
    calls, original = [], lin.gemv
    monkeypatch.setattr(lin, "gemv", lambda x, w: calls.append(tuple(x.shape)) or original(x, w))
    layer = lin.Linear(64, 32, bias=False).bfloat16().requires_grad_(False)
    few, many = _randn(2, 3, 64), _randn(lin.GEMV_ROWS + 1, 64)
    out = layer(few)
    assert out.shape == (2, 3, 32) and calls == [(6, 64)]
    _assert_rounded_fp32_sum(out.reshape(6, 32), few.reshape(6, 64), layer.weight)
    with lin.packing(False):
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight), rtol=0, atol=0)  # past the rows: oneDNN
    _assert_rounded_fp32_sum(layer(many), many, layer.weight)  # and its packed weight, by default
    layer.float()(few.float())  # fp32: oneDNN
    with cpu_ops.disabled():
        layer.bfloat16()(few)
    biased = lin.Linear(64, 32).bfloat16().requires_grad_(False)
    biased(few)
    trained = lin.Linear(64, 32, bias=False).bfloat16()
    with torch.enable_grad():
        assert trained(few).requires_grad  # autograd keeps F.linear
    assert calls == [(6, 64)]


def test_the_model_is_built_of_these_linears():
    from core.model.fuse import fuse_projections
    from core.model.llama import LlamaForCausalLM, ModelArgs

    args = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=16)
    model = LlamaForCausalLM(args)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 8 and all(type(m) is lin.Linear for m in linears)
    fuse_projections(model)
    layer = model.model.layers[0]
    assert type(layer.self_attn.qkv_proj.inner) is lin.Linear and type(layer.mlp.gate_up_proj.inner) is lin.Linear


def test_the_graph_op_makes_the_same_choice_by_rows():
    """`bf16_matmul`, the op a torch.compile graph calls: the GEMV up to gemv_rows rows, else the GEMM."""
    assert cpu_ops.load() is not None  # the build registers the op
    w = _randn(96, 64, scale=0.1)
    for m in (1, 5, lin.GEMV_ROWS, lin.GEMV_ROWS + 1, 40):
        x = _randn(m, 64)
        got = torch.ops.servelab_cpu_ops.bf16_matmul(x, w, lin.GEMV_ROWS)
        want = lin.gemv(x, w) if m <= lin.GEMV_ROWS and lin._native() else F.linear(x, w)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        strided = torch.cat([x, x], dim=1)[:, :64]
        torch.testing.assert_close(torch.ops.servelab_cpu_ops.bf16_matmul(strided, w, lin.GEMV_ROWS), want,
                                   rtol=0, atol=0)


def test_a_compiled_graph_calls_the_op_for_every_step_size(monkeypatch):
    """One dynamic graph serves every number of rows (no guard on them), its bf16 linears through the
    op, with eager's results."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    layer = lin.Linear(64, 48, bias=False).bfloat16().requires_grad_(False)
    compiled = torch.compile(lambda x: layer(x) * 2, backend=capture, dynamic=True, fullgraph=True)
    for m in (1, 5, 9, lin.GEMV_ROWS, 40):
        x = _randn(m, 64)
        torch.testing.assert_close(compiled(x), lin.linear(x, layer.weight) * 2, rtol=0, atol=0)
    assert len(graphs) == 2  # batch 1 (torch specializes size 1), then one graph for every other size
    ready = lin.compiled_gemv_ready()
    assert all(("servelab_cpu_ops.bf16_matmul" in g) == ready for g in graphs)
    torch._dynamo.reset()
    monkeypatch.setattr(lin, "_native", lambda: False)  # a CPU without the bf16 dot: the graph keeps F.linear
    monkeypatch.setattr(lin, "compiled_gemv_ready", torch.compiler.assume_constant_result(
        lambda: lin._enabled_for_graphs and lin._native()))
    graphs.clear()
    compiled = torch.compile(lambda x: layer(x) * 2, backend=capture, dynamic=True, fullgraph=True)
    compiled(_randn(5, 64))
    assert not any("servelab_cpu_ops" in t for t in graphs[0]) and any("linear" in t for t in graphs[0])
    torch._dynamo.reset()


def _packed_layer(n, k, bias, dtype=torch.bfloat16):
    layer = lin.Linear(k, n, bias=bias).requires_grad_(False)
    layer.weight.data = _randn(n, k, scale=0.05).to(dtype)
    if bias:
        layer.bias.data = _randn(n).to(dtype)
    return layer


def _packing_dtype() -> torch.dtype | None:
    """The dtype whose Linears take a packed copy on this CPU: bf16 where oneDNN has bf16 (AVX-512, AMX),
    fp32 where fp32_linear serves (AVX2 without AVX-512), None on others."""
    if lin._mkldnn_bf16():
        return torch.bfloat16
    return torch.float32 if fp32_linear.ready() else None


def _assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """bf16: the rounded fp32 sum; fp32: the fp64 product within fp32's summation bound."""
    if got.dtype == torch.bfloat16:
        return _assert_rounded_fp32_sum(got, x, w)
    exact = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(17, 64), (64, 576), (3, 100, 576)])  # past the GEMV's rows; a 3-D input
def test_the_packed_weight_gives_f_linears_bits(shape, bias):
    layer = _packed_layer(300, shape[-1], bias)
    x = _randn(*shape)
    out = layer(x)
    if not lin._mkldnn_bf16():  # oneDNN packs no bf16 weight on this CPU (AVX2 only): F.linear itself
        assert layer.packed_copy() is None and torch.equal(out, F.linear(x, layer.weight, layer.bias))
        return
    assert layer.packed_copy() is not None  # this call took the packed copy
    with lin.packing(False):
        want = layer(x)
    assert out.shape == want.shape
    # the same fp32 sums rounded once to bf16 (bit-identical on the AMX Xeon measured; the order of
    # a sum may differ with oneDNN's kernel elsewhere)
    if not bias:
        _assert_rounded_fp32_sum(out.reshape(-1, 300), x.reshape(-1, shape[-1]), layer.weight)
    torch.testing.assert_close(out, want, rtol=2**-7, atol=1e-3)
    assert (out == want).double().mean().item() >= 0.99


def test_a_replaced_weight_is_packed_again_and_autograd_keeps_f_linear():
    dtype = _packing_dtype() or torch.bfloat16
    layer = _packed_layer(96, 64, False, dtype)
    x = _randn(32, 64).to(dtype)
    layer(x)
    first = layer.packed_copy()
    assert (first is not None) == (_packing_dtype() is not None)
    layer.weight.data = layer.weight.data * 2  # a new tensor (as loading and sharding assign)
    _assert_product(layer(x), x, layer.weight)
    assert layer.packed_copy() is not first or first is None
    with torch.no_grad():
        layer.weight.mul_(0.5)  # in place, through the parameter: its version moves
    _assert_product(layer(x), x, layer.weight)
    trained = lin.Linear(64, 96, bias=False).to(dtype)
    with torch.enable_grad():
        assert trained(x).requires_grad and trained._packed is None
    with fp32_linear.enabled(False):
        assert not lin.use_packed(x.float(), layer.weight.float())  # fp32 without its tiles: F.linear


def test_packed_copies_stop_at_their_memory_share_and_give_their_bytes_back(monkeypatch):
    import gc

    gc.collect()  # copies earlier tests left to the collector give their bytes back now, not mid-count
    monkeypatch.setattr(lin, "_packed_bytes", 0)
    dtype = _packing_dtype()
    assert dtype is not None, "this CPU packs neither bf16 (oneDNN) nor fp32 (fp32_linear) weights"
    size = dtype.itemsize
    layer = _packed_layer(128, 64, False, dtype)
    x = _randn(32, 64).to(dtype)
    layer(x)
    assert lin._packed_bytes == 128 * 64 * size
    monkeypatch.setattr(lin, "PACK_MEMORY_SHARE", 0.0)  # no room: the next layer keeps its plain weight
    other = _packed_layer(128, 64, False, dtype)
    assert torch.equal(other(x), F.linear(x, other.weight)) and other.packed_copy() is None  # F.linear itself
    assert lin._packed_bytes == 128 * 64 * size
    del layer
    gc.collect()
    assert lin._packed_bytes == 0


def test_on_amx_the_gemv_keeps_three_rows_and_the_packed_gemm_takes_four(monkeypatch):
    monkeypatch.setattr(lin, "_NATIVE", True)
    monkeypatch.setattr(lin, "_AMX", True)
    monkeypatch.setattr(amx_linear, "_READY", False)  # oneDNN's packed weights (a build without amx_linear)
    monkeypatch.setattr(dot_linear, "_READY", False)
    calls, original = [], lin.gemv
    monkeypatch.setattr(lin, "gemv", lambda x, w: calls.append(tuple(x.shape)) or original(x, w))
    layer = _packed_layer(96, 64, False)
    three, four = _randn(3, 64), _randn(4, 64)
    _assert_rounded_fp32_sum(layer(three), three, layer.weight)
    assert calls == [(3, 64)] and layer._packed is None
    if not lin._mkldnn_bf16():  # no oneDNN bf16 here (AVX2 only; _AMX forced above): nothing to pack, F.linear
        assert torch.equal(layer(four), F.linear(four, layer.weight)) and layer.packed_copy() is None
        assert calls == [(3, 64)]
        return
    _assert_rounded_fp32_sum(layer(four), four, layer.weight)
    assert calls == [(3, 64)] and layer.packed_copy() is not None
    with lin.packing(False):  # plain weights: the GEMV serves its 16 rows again
        assert lin.gemv_rows() == lin.GEMV_ROWS
        layer(four)
    assert calls == [(3, 64), (4, 64)]


def test_a_switch_is_set_for_its_block_only_and_restored_on_an_error():
    from servelab_kernels.dispatch import Switch

    switch = Switch()
    with switch.set(False):
        assert switch.on is False
        with switch.set(True):
            assert switch.on is True
        assert switch.on is False
    assert switch.on is True
    with pytest.raises(RuntimeError), switch.set(False):
        raise RuntimeError("inside")
    assert switch.on is True
    with lin.packing(False):  # the module switches are such switches
        assert not lin._pack_weights.on and lin.gemv_rows() == lin.GEMV_ROWS
    assert lin._pack_weights.on


# ---- the bf16 GEMM on AMX tiles (csrc/cpu_gemm_amx.cpp) ----------------------------------------------


@pytest.mark.parametrize("n, k", [(64, 32), (48, 576), (960, 576), (576, 1536)])  # a last block of 16 columns
def test_the_tiles_layout_is_its_twins(n, k):
    w = _randn(n, k)
    packed = amx_linear.pack(w)
    assert packed.shape == (n * k,) and torch.equal(packed, amx_linear.pack_ref(w))
    # one element by the layout's own words: block 1, step 2, half 1, pair 5, column 7, second of the pair
    if n >= 64 and k >= 96:
        assert packed[32 * k + 2 * 32 * 32 + 512 + 5 * 32 + 7 * 2 + 1] == w[32 + 16 + 7, 2 * 32 + 2 * 5 + 1]


@pytest.mark.amx_bf16
@pytest.mark.parametrize("m", [3, 16, 17, 33, 64, 200])  # one tile, a pair, a tail of 1, an odd tile count
@pytest.mark.parametrize("n, k", [(48, 64), (960, 576), (576, 1536)])
def test_amx_linear_is_the_rounded_fp32_sum(m, n, k):
    x, w = _randn(m, k), _randn(n, k, scale=k**-0.5)
    got = amx_linear.linear(x, amx_linear.pack(w), n, None)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _assert_rounded_fp32_sum(got, x, w)


@pytest.mark.amx_bf16
def test_amx_linear_reads_strided_rows_and_adds_the_bias_before_rounding():
    wide, w, b = _randn(40, 700), _randn(96, 576, scale=0.05), _randn(96)
    x = wide[:, 50:626]  # rows 700 apart, columns contiguous: read in place
    packed = amx_linear.pack(w)
    plain = torch.ops.servelab_cpu_ops.amx_linear(x.contiguous(), packed, 96, None)
    torch.testing.assert_close(torch.ops.servelab_cpu_ops.amx_linear(x, packed, 96, None), plain, rtol=0, atol=0)
    biased = amx_linear.linear(x, packed, 96, b)
    want = (x.float() @ w.float().T + b.float()).bfloat16()  # one rounding of the fp32 sum with the bias
    torch.testing.assert_close(biased, want, rtol=2**-7, atol=1e-3)
    assert (biased == want).double().mean().item() >= 0.99
    empty = amx_linear.linear(_randn(0, 576), packed, 96, None)
    assert empty.shape == (0, 96)


def test_amx_linear_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="N a multiple of 16 and K of 32, got \\[40, 64\\]"):
        amx_linear.pack(_randn(40, 64))
    with pytest.raises(RuntimeError, match="a bf16 weight"):
        amx_linear.pack(torch.randn(32, 64))
    packed = amx_linear.pack(_randn(32, 64))
    with pytest.raises(RuntimeError, match="amx_pack of a bf16 weight \\[N, K\\] with x's K"):
        torch.ops.servelab_cpu_ops.amx_linear(_randn(4, 96), packed, 32, None)
    with pytest.raises(RuntimeError, match="bias \\[N\\]"):
        torch.ops.servelab_cpu_ops.amx_linear(_randn(4, 64), packed, 32, _randn(31))
    with pytest.raises(RuntimeError, match="x bf16"):
        torch.ops.servelab_cpu_ops.amx_linear(torch.randn(4, 64), packed, 32, None)


@pytest.mark.amx_bf16
def test_on_amx_tiles_the_gemv_keeps_two_rows_the_tiles_the_rest_up_to_tile_rows(monkeypatch):
    assert amx_linear.ready()  # an AMX-BF16 CPU's build has the op
    monkeypatch.setattr(lin, "_NATIVE", True)
    calls = []
    for module, name in ((lin, "gemv"), (amx_linear, "linear")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name: calls.append((_n, a[0].shape[0])) or _o(*a))
    layer = _packed_layer(96, 64, False)
    for m in (lin.GEMV_ROWS_TILES, lin.GEMV_ROWS_TILES + 1, 40, lin.TILE_ROWS, lin.TILE_ROWS + 1):
        x = _randn(m, 64)
        _assert_rounded_fp32_sum(layer(x), x, layer.weight)
    assert calls == [("gemv", 2), ("linear", 3), ("linear", 40), ("linear", lin.TILE_ROWS)]
    tiles = layer.packed_copy()
    assert torch.equal(tiles, amx_linear.pack_ref(layer.weight))  # the copy is laid out for the tiles
    with amx_linear.enabled(False):  # oneDNN's packed copy instead, made beside it; the GEMV back to its AMX rows
        assert lin.gemv_rows() == lin.GEMV_ROWS_AMX
        x = _randn(8, 64)
        _assert_rounded_fp32_sum(layer(x), x, layer.weight)
        assert layer.packed_copy() is not tiles and layer.packed_copy().shape != (96 * 64,)
    assert len(calls) == 4
    layer(_randn(8, 64))
    assert layer.packed_copy() is tiles and len(calls) == 5  # flipped back: the tiles' copy, not packed again
    odd = _packed_layer(40, 64, True)  # 40 output columns: no tiles, oneDNN's packed copy
    x = _randn(8, 64)
    torch.testing.assert_close(odd(x), F.linear(x, odd.weight, odd.bias), rtol=2**-7, atol=1e-3)
    assert len(calls) == 5 and not amx_linear.use(odd.weight)
