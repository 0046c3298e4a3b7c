"""The bf16 GEMV of few-row linears on the CPU (kernels.linear, csrc/cpu_gemv.cpp) against its
twin, and when the model's linears take it."""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels import linear as lin

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
    calls, original = [], lin.gemv
    monkeypatch.setattr(lin, "gemv", lambda x, w: calls.append(tuple(x.shape)) or original(x, w))
    layer = lin.Linear(64, 32, bias=False).bfloat16().requires_grad_(False)
    few, many = _randn(2, 3, 64), _randn(lin.GEMV_ROWS + 1, 64)
    out = layer(few)
    assert out.shape == (2, 3, 32) and calls == [(6, 64)]
    _assert_rounded_fp32_sum(out.reshape(6, 32), few.reshape(6, 64), layer.weight)
    torch.testing.assert_close(layer(many), F.linear(many, layer.weight), rtol=0, atol=0)  # past the rows: oneDNN
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
