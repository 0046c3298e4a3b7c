"""The native decode plan (core/model/decode_plan.py, servelab_kernels/csrc/cpu_decode.cpp) against the
eager forward it replaces: the same logits, bit for bit, at every decode step, for each kind of
layer it runs, with batches that shrink through the GEMV thresholds (16 rows for bf16, 12 for
INT4); and the configurations it does not serve, which stay eager or are refused by name."""

from __future__ import annotations

import logging

import pytest
import torch

from core.config.compose import compose
from core.engine.components import engine_config
from core.engine.engine import Engine
from core.engine.types import SamplingParams
from core.errors import ConfigError
from servelab_kernels import cpu_ops


def build(overrides: list[str]) -> Engine:
    return Engine(engine_config(compose(["cache.memory_gb=0.05", *overrides])))  # a small pool: quick to zero


def decode_logits(engine: Engine, prompts: list[list[int]]) -> tuple[list[torch.Tensor], int]:
    """Greedy generation with max_tokens 2..N+1 (the batch shrinks by one a step once all are
    decoding); returns the logits of every decode-only step and how many steps the plan ran."""
    seen, accept = [], engine.decoder.accept

    def keep(logits, sampling, proposals):
        if engine.last_step_was_decode:
            seen.append(logits.clone())
        return accept(logits, sampling, proposals)

    native, backend, ran = engine.backend.native_decode, engine.backend, [0]
    saved = (native and native.forward, backend.execute, accept)

    def counted(batch):
        ran[0] += 1
        return saved[0](batch)

    def execute_and_note(batch):
        engine.last_step_was_decode = batch.attn.max_query_len == 1
        return saved[1](batch)

    if native is not None:
        native.forward = counted
    backend.execute, engine.decoder.accept = execute_and_note, keep
    try:
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        if native is not None:
            native.forward = saved[0]
        backend.execute, engine.decoder.accept = saved[1], saved[2]
    return seen, ran[0]


def prompts(n: int, vocab: int = 250) -> list[list[int]]:
    return [[(7 * i + 3 * j) % vocab for j in range(3 + i % 5)] for i in range(n)]


CASES = {  # name: overrides on a tiny model (2 layers, hidden 64, 4 heads, 2 KV heads)
    "bf16": ["model.dtype=bf16"],
    "fp32": ["model.dtype=fp32"],
    "fp32-bf16-lines": ["model.dtype=fp32", "backend.fp32_linear_weights=bf16"],  # fp32 tiles over bf16 copies
    "int8": ["model.dtype=bf16", "quant=int8"],
    "int4": ["model.dtype=bf16", "quant=int4"],
    "int8-fp32": ["model.dtype=fp32", "quant=int8"],
    "int8-w8a8": ["model.dtype=bf16", "quant=int8", "quant.w8a8=true"],  # the INT8 activations' levels passed on
    "kv-int8": ["model.dtype=bf16", "cache.dtype=int8"],  # the cache quantized as the plan writes it
    "kv-bf16-fp32": ["model.dtype=fp32", "cache.dtype=bf16"],  # an fp32 model over a bf16 cache
}


@pytest.mark.parametrize("arch, case", [("llama", c) for c in sorted(CASES)] + [("qwen2", "bf16")])  # qwen2: q/k/v bias
def test_the_plan_gives_the_eager_forwards_logits_bit_for_bit(tiny_dirs, case, arch):
    base = [f"model.path={tiny_dirs[arch]}", "model.max_model_len=128", "scheduler.max_num_seqs=20",
            "scheduler.max_num_batched_tokens=512", "attention=cpu", *CASES[case]]
    work = prompts(20)  # 20 rows down to 1: both sides of every GEMV threshold
    native, ran = decode_logits(build(base + ["backend.native_decode=true"]), work)
    eager, none = decode_logits(build(base + ["backend.native_decode=false"]), work)
    assert ran == len(native) >= 19 and none == 0
    assert len(native) == len(eager)
    for step, (a, b) in enumerate(zip(native, eager)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item()}"


@pytest.mark.real_model
def test_the_embedded_model_decodes_the_same_through_the_plan(default_gguf):
    """SmolLM2's own file (30 layers of Q4_1 blocks, an INT8 head), 18 rows down to 1."""
    base = ["quant=gguf", "model.dtype=bf16", "model.max_model_len=256", "scheduler.max_num_seqs=18"]
    work = prompts(18, vocab=49152)
    native, ran = decode_logits(build(base + ["backend.native_decode=true"]), work)
    eager, _ = decode_logits(build(base + ["backend.native_decode=false"]), work)
    assert ran == len(native) == len(eager) >= 17
    assert all(torch.equal(a, b) for a, b in zip(native, eager))


def test_the_plan_steps_aside_while_the_cpp_ops_are_off_and_comes_back(tiny_dirs):
    """A switch the plan bakes in (here the C++ elementwise ops, which benchmarks turn off for A/B
    runs) sends decode steps back to the eager forward while it is off, with the same tokens."""
    e = build([f"model.path={tiny_dirs['llama']}", "model.dtype=bf16", "attention=cpu"])
    work = prompts(3)
    with cpu_ops.disabled():
        off, ran_off = decode_logits(e, work)
    on, ran_on = decode_logits(e, work)
    assert ran_off == 0 and ran_on == len(on) > 0
    assert [t.argmax(-1).tolist() for t in off] == [t.argmax(-1).tolist() for t in on]


def test_configurations_it_cannot_run_stay_eager_and_say_why(tiny_dirs, caplog):
    base = [f"model.path={tiny_dirs['llama']}", "model.dtype=bf16"]
    with caplog.at_level(logging.INFO, logger="servelab"):  # `auto` (the default) says why it stayed eager
        e = build(base + ["attention=torch"])
    assert e.backend.native_decode is None
    assert "decode steps run eagerly: attention backend TorchAttention has no write-and-decode op" in caplog.text
    mixed = build(base + ["attention=cpu", "quant=int8", "quant.keep=[model.layers.1.self_attn.k_proj]"])
    assert mixed.backend.native_decode is None


@pytest.mark.parametrize("extra, reason", [
    (["attention=torch"], "attention backend TorchAttention has no write-and-decode op for this cache"),
    (["attention=cpu", "quant=int8", "quant.keep=[model.layers.1.self_attn.k_proj]"],
     "layer 1: its q/k/v projections are not fused"),
])
def test_native_decode_true_refuses_what_it_cannot_run_by_name(tiny_dirs, extra, reason):
    with pytest.raises(ConfigError, match=f"backend.native_decode=true, but {reason}"):
        build([f"model.path={tiny_dirs['llama']}", "model.dtype=bf16", "backend.native_decode=true", *extra])


def test_a_plan_is_refused_a_linear_kind_it_does_not_know():
    from servelab_kernels import cpu_decode

    plan = cpu_decode.new_plan(torch.zeros(8, 4), torch.zeros(8, 4), torch.ones(16), 2, 1, 8, 32, 1e-5, 0.35,
                               "servelab_cpu_attention::write_and_decode")
    with pytest.raises(RuntimeError, match="add a layer first"):
        plan.add_linear(0, False, torch.zeros(24, 16), None, None, None)
    int8 = torch.zeros(1, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="an INT8 cache comes with its k_scale and v_scale"):
        plan.add_layer(torch.ones(16), torch.ones(16), int8, int8, None, None)
    with pytest.raises(RuntimeError, match="and only an INT8 cache"):
        plan.add_layer(torch.ones(16), torch.ones(16), torch.zeros(1), torch.zeros(1), torch.ones(1), torch.ones(1))
    plan.add_layer(torch.ones(16), torch.ones(16), torch.zeros(1), torch.zeros(1), None, None)
    with pytest.raises(RuntimeError, match="needs its op and its second tensor"):
        plan.add_linear(1, False, torch.zeros(24, 8, dtype=torch.uint8), None, None, None)
    for kind in (cpu_decode.TILES, cpu_decode.DOT, cpu_decode.FP32):
        with pytest.raises(RuntimeError, match="a TILES / DOT / FP32 layer amx_linear / dot_linear / fp32_linear and "
                                               "its packed weight"):
            plan.add_linear(kind, False, torch.zeros(24, 16), None, None, None)
    with pytest.raises(RuntimeError, match="incomplete layers"):
        plan.forward(torch.zeros(1, 16), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long))


def _layouts(engine: Engine) -> set[str]:
    """The packed layouts made for the linears whose shapes fit the tiles (the tiny head's 250 rows do not)."""
    fit = [m for m in engine.model.modules() if getattr(m, "_packed", None) and m.out_features % 16 == 0]
    assert len(fit) >= 8  # both layers' four linears
    return {layout for m in fit for layout, c in m._packed[3].items() if c is not None}


@pytest.mark.amx_bf16
def test_backend_amx_linear_false_keeps_onednn_for_its_own_engine(tiny_dirs):
    """`backend.amx_linear=false` multiplies by oneDNN's packed weights in that engine's steps only:
    the process-wide switch is set around each step, so an engine beside it keeps the tiles."""
    from servelab_kernels import amx_linear

    base = [f"model.path={tiny_dirs['llama']}", "model.dtype=bf16", "attention=cpu"]
    off, on = build(base + ["backend.amx_linear=false"]), build(base)
    a, _ = decode_logits(off, prompts(8))
    b, _ = decode_logits(on, prompts(8))
    assert _layouts(off) == {"onednn"} and _layouts(on) == {"tiles"} and amx_linear.switch.on
    for x, y in zip(a, b):  # the same sums in another order: the same greedy tokens on this tiny model
        torch.testing.assert_close(x, y, rtol=0.02, atol=0.02)


def test_backend_amx_linear_true_refuses_a_cpu_without_tiles(tiny_dirs, monkeypatch):
    import plugins.backends.torch_backend as tb

    monkeypatch.setattr(tb.amx_linear, "ready", lambda: False)
    with pytest.raises(ConfigError, match="backend.amx_linear=true multiplies bf16 on AMX tiles, and this CPU"):
        build([f"model.path={tiny_dirs['llama']}", "backend.amx_linear=true"])


def test_backend_dot_linear_false_keeps_onednn_for_its_own_engine(tiny_dirs, monkeypatch):
    """`backend.dot_linear=false` multiplies by oneDNN's packed weights in that engine's steps only,
    an engine beside it keeps the dot-product layout (in its native decode plan too)."""
    from servelab_kernels import amx_linear, cpu_ops, dot_linear

    built = bool(cpu_ops.load().dot_linear_ready())  # the build has AVX512-BF16 tiles
    monkeypatch.setattr(amx_linear, "_READY", False)  # the rule on any CPU: tiles first where they serve
    monkeypatch.setattr(dot_linear, "_READY", built)
    base = [f"model.path={tiny_dirs['llama']}", "model.dtype=bf16", "attention=cpu"]
    if not built:
        with pytest.raises(ConfigError, match="backend.dot_linear=true multiplies bf16 on AVX512-BF16 dot products"):
            build(base + ["backend.dot_linear=true"])
        return
    off, on = build(base + ["backend.dot_linear=false"]), build(base + ["backend.dot_linear=true"])
    a, _ = decode_logits(off, prompts(20))  # 20 rows: past the GEMV's 16
    b, ran = decode_logits(on, prompts(20))
    assert _layouts(off) == {"onednn"} and _layouts(on) == {"dot"} and dot_linear.switch.on
    assert ran > 0  # the plan's DOT layers ran decode steps
    for x, y in zip(a, b):  # the same sums in another order, bf16 roundings apart in every layer and step
        assert torch.equal(x.argmax(-1), y.argmax(-1))  # the same greedy tokens on this tiny model
        torch.testing.assert_close(x, y, rtol=0.02, atol=0.05)


def test_backend_dot_linear_true_refuses_a_cpu_it_does_not_serve(tiny_dirs, monkeypatch):
    import plugins.backends.torch_backend as tb

    monkeypatch.setattr(tb.dot_linear, "ready", lambda: False)
    with pytest.raises(ConfigError, match="backend.dot_linear=true multiplies bf16 on AVX512-BF16 dot products"):
        build([f"model.path={tiny_dirs['llama']}", "backend.dot_linear=true"])
