"""The C++ elementwise ops of the eager CPU forward (servelab_kernels.cpu_ops) against their torch twins."""

import pytest
import torch

from servelab_kernels import activation, cpu_ops, norm, rotary

GEN = torch.Generator().manual_seed(0)


def _randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=GEN) * scale).to(dtype)


def _close_to_the_bit(got, want, exact_share):
    """Within two units in the last place of the dtype (a last-bit difference in an intermediate
    the twin also rounds, then the final rounding), and bit-equal for `exact_share` of the elements
    (what a different summation order or exp's last bit can change)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    two_ulp = 2**-6 if got.dtype == torch.bfloat16 else 2**-21
    torch.testing.assert_close(got.float(), want.float(), rtol=two_ulp, atol=1e-30)
    assert (got == want).float().mean().item() >= exact_share


def test_the_ops_build_here():
    assert cpu_ops.load() is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, n", [(1, 576), (64, 576), (300, 576), (5, 37)])  # 300 rows: split over threads
def test_rms_norm_matches_the_reference(rows, n, dtype):
    x, res, w = _randn(rows, n, dtype=dtype, scale=3.0), _randn(rows, n, dtype=dtype), _randn(n, dtype=dtype)
    got, got_res = cpu_ops.rms_norm(x, w, 1e-5, res)
    want, want_res = norm.rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(got_res, want_res)  # the add rounds once, as torch's does
    _close_to_the_bit(got, want, 0.97 if dtype == torch.bfloat16 else 0.0)
    alone, none = cpu_ops.rms_norm(x, w, 1e-5)
    assert none is None
    _close_to_the_bit(alone, norm.rms_norm_ref(x, w, 1e-5)[0], 0.97 if dtype == torch.bfloat16 else 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 70])
def test_rotary_matches_the_reference_exactly(tokens, dtype):
    heads, kv_heads, d = 9, 3, 64
    qkv = _randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype)  # q and k are strided views of one matmul
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d: (heads + kv_heads) * d].view(tokens, kv_heads, d)
    freqs = torch.outer(torch.arange(2048.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 2048, (tokens,), generator=GEN)
    got_q, got_k = cpu_ops.rotary(q, k, positions, cos, sin)
    want_q, want_k = rotary.rotary_ref(q, k, positions, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_rotary_refuses_a_position_past_its_table():
    q, k = _randn(2, 1, 8), _randn(2, 1, 8)
    cos = sin = torch.ones(16, 4)
    with pytest.raises(RuntimeError, match="position 16 is outside the rotary table"):
        cpu_ops.rotary(q, k, torch.tensor([3, 16]), cos, sin)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, width", [(1, 1536), (64, 1536), (130, 1536), (3, 100)])  # 100: lanes and a tail
def test_silu_mul_matches_the_reference(rows, width, dtype):
    gate_up = _randn(rows, 2 * width, dtype=dtype, scale=4.0)
    gate, up = gate_up.split(width, dim=-1)  # strided halves of the fused gate-up output
    gate[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0], dtype=dtype)  # exp's clamps and zero
    _close_to_the_bit(cpu_ops.silu_mul(gate, up), activation.silu_mul_ref(gate, up),
                      0.99 if dtype == torch.bfloat16 else 0.3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_the_first_maximum_of_each_row(dtype):
    logits = _randn(70, 2 * 49152, dtype=dtype, scale=4.0)[:, 3:49155]  # strided rows, as a view may be
    logits[1, 7] = logits[1, 9000] = 50.0  # a tie: the first
    logits[2] = float("-inf")  # every token masked: index 0
    logits[3, 100] = float("nan")  # NaN counts as the largest, as in torch's max
    logits[3, 2000] = 60.0
    logits[4, -1] = 70.0  # the last column
    logits[5, 10], logits[5, 30000] = 80.0, float("nan")  # a NaN after the largest number
    logits[6, 300] = logits[6, 400] = 90.0  # a tie inside one of the kernel's chunks of 256
    got = cpu_ops.argmax(logits)
    want = logits.max(dim=-1).indices
    assert got.dtype == torch.int64
    assert torch.equal(got, want), (got != want).nonzero()
    assert got[:7].tolist() == [int(want[0]), 7, 0, 100, 49151, 30000, 300]


def test_greedy_sampling_takes_the_cpp_argmax(monkeypatch):
    from plugins.decoders import sampling

    logits = _randn(3, 1000, dtype=torch.bfloat16, scale=4.0)
    calls = []
    real = cpu_ops.argmax
    monkeypatch.setattr(cpu_ops, "argmax", lambda x: calls.append(x.shape) or real(x))
    assert torch.equal(sampling.greedy_tokens(logits), logits.max(dim=-1).indices)
    assert calls == [(3, 1000)]


def test_the_model_ops_dispatch_here_and_not_under_autograd(monkeypatch):
    calls = []
    for name in ("rms_norm", "rotary", "silu_mul"):
        original = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    x, w = _randn(4, 64), _randn(64)
    q = _randn(4, 2, 64)
    cos = sin = torch.ones(8, 32)
    norm.rms_norm(x, w, 1e-5, x)
    rotary.rotary(q, q, torch.arange(4), cos, sin)
    activation.silu_mul(x, x)
    assert calls == ["rms_norm", "rotary", "silu_mul"]
    trained = w.float().requires_grad_()
    out, _ = norm.rms_norm(x.float(), trained, 1e-5)
    assert calls == ["rms_norm", "rotary", "silu_mul"] and out.requires_grad  # autograd keeps the twin
    with cpu_ops.disabled():  # what benchmarks.eager_ops measures against
        norm.rms_norm(x, w, 1e-5)
    norm.rms_norm(x, w, 1e-5)
    assert calls == ["rms_norm", "rotary", "silu_mul", "rms_norm"]
