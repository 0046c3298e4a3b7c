"""The GPU check's kernel table and its report: each Triton kernel against its torch reference
(and SDPA where comparable), timed on the device, as a share of the measured peak.

`small=True` shrinks every case so the same code runs on the CPU (the Triton kernels interpreted):
the test of this module; the figures then mean nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from servelab_kernels import attention as ref
from servelab_kernels import norm, quant, rotary


def timed(fn, reps: int = 20) -> float:
    """Median seconds of `fn` (CUDA events on a GPU; two calls on the CPU, where it only smoke-tests)."""
    reps = reps if torch.cuda.is_available() else 2
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _paged(batch: int, ctx: int, kvh: int, d: int, dtype, device, block: int = 16):
    """A filled cache: `batch` sequences of `ctx` tokens in shuffled blocks."""
    nb = -(-ctx // block)
    perm = torch.randperm(batch * nb, device=device)
    tables = perm.view(batch, nb)
    shape = (batch * nb, kvh, block, d)
    if dtype == torch.int8:
        kc = torch.randint(-127, 128, shape, dtype=torch.int8, device=device)
        scales = (torch.rand(shape[:3], device=device).half() * 0.02, torch.rand(shape[:3], device=device).half() * 0.02)
        return kc, kc.clone(), scales, tables
    kc = torch.randn(shape, dtype=dtype, device=device)
    return kc, torch.randn_like(kc), (), tables


def _row(case, impl, seconds, work, unit, peak, err=None) -> dict:
    rate = work / seconds / (1e9 if unit == "GB/s" else 1e12)
    return {"case": case, "impl": impl, "ms": seconds * 1e3, "rate": rate, "unit": unit,
            "fraction": rate / peak if peak else None, "max_rel_err": err}


def _err(a, b) -> float:
    """Largest deviation from the reference, relative to the reference's largest magnitude."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()


def _decode_case(b: int, ctx: int, dtype, h: int, kvh: int, d: int, hbm: float, device) -> list[dict]:
    from servelab_kernels import triton_attention as tri

    kc, vc, scales, tables = _paged(b, ctx, kvh, d, dtype, device)
    q = torch.randn(b, h, d, dtype=torch.bfloat16, device=device)
    lens = torch.full((b,), ctx, device=device)
    name = f"decode attention {b} x {ctx}" + (" int8 KV" if dtype == torch.int8 else "")
    kv_bytes = 2 * b * ctx * kvh * (d * kc.element_size() + (2 if dtype == torch.int8 else 0))
    args = (q, kc, vc, tables, lens, 0.125, *scales)
    rows = [_row(name, "triton", timed(lambda: tri.decode_attention(*args)), kv_bytes, "GB/s", hbm,
                 _err(tri.decode_attention(*args), ref.decode_attention(*args))),
            _row(name, "torch reference", timed(lambda: ref.decode_attention(*args), 5), kv_bytes, "GB/s", hbm)]
    if dtype != torch.int8:  # SDPA over the same KV laid out densely: no paging at all
        kd = torch.randn(b, kvh, ctx, d, dtype=dtype, device=device)
        dense = (q[:, :, None, :], kd, torch.randn_like(kd))
        rows.append(_row(name, "SDPA (dense, unpaged)", timed(lambda: F.scaled_dot_product_attention(
            *dense, enable_gqa=True)), kv_bytes, "GB/s", hbm))
    return rows


def decode_cases(hbm: float, device, small: bool) -> list[dict]:
    h, kvh, d = (8, 2, 64) if small else (32, 8, 64)  # Llama-3.2-1B's attention geometry
    cases = [(2, 64, torch.bfloat16)] if small else [(128, 2048, torch.bfloat16), (1, 8192, torch.bfloat16),
                                                       (32, 1024, torch.bfloat16), (128, 2048, torch.int8)]
    return [row for b, ctx, dtype in cases for row in _decode_case(b, ctx, dtype, h, kvh, d, hbm, device)]


def prefill_cases(peak_tflops: float, device, small: bool) -> list[dict]:
    from servelab_kernels import triton_attention as tri

    h, kvh, d = (8, 2, 64) if small else (32, 8, 64)
    seqs, chunk, ctx = (2, 32, 48) if small else (8, 512, 2048)
    kc, vc, _, tables = _paged(seqs, ctx, kvh, d, torch.bfloat16, device)
    q = torch.randn(seqs * chunk, h, d, dtype=torch.bfloat16, device=device)
    lens = torch.full((seqs,), ctx, device=device)
    qsl = torch.arange(seqs + 1, device=device) * chunk
    pairs = seqs * chunk * (ctx - (chunk - 1) / 2)
    flops = 4 * d * h * pairs
    name = f"prefill attention {seqs} x {chunk} new after {ctx - chunk} cached"
    host = (qsl.tolist(), lens.tolist())
    want = ref.prefill_attention(q, kc, vc, tables, lens, qsl, 0.125, host=host)
    got = tri.prefill_attention(q, kc, vc, tables, lens, qsl, 0.125, host=host)
    rows = [_row(name, "triton", timed(lambda: tri.prefill_attention(q, kc, vc, tables, lens, qsl, 0.125, host=host)),
                 flops, "TFLOP/s", peak_tflops, _err(got, want)),
            _row(name, "torch reference", timed(lambda: ref.prefill_attention(q, kc, vc, tables, lens, qsl, 0.125,
                                                                              host=host), 5), flops, "TFLOP/s",
                 peak_tflops)]
    # SDPA on a fresh prompt of the same total context (flash, causal): the dense ceiling
    qd = torch.randn(seqs, h, ctx, d, dtype=torch.bfloat16, device=device)
    kd = torch.randn(seqs, kvh, ctx, d, dtype=torch.bfloat16, device=device)
    dense_flops = 4 * d * h * seqs * ctx * (ctx + 1) / 2
    rows.append(_row(f"prefill attention {seqs} x {ctx} fresh", "SDPA (dense, causal)", timed(
        lambda: F.scaled_dot_product_attention(qd, kd, kd, is_causal=True, enable_gqa=True)), dense_flops, "TFLOP/s",
        peak_tflops))
    return rows


def elementwise_cases(hbm: float, device, small: bool) -> list[dict]:
    from servelab_kernels import triton_attention as tri
    from servelab_kernels import triton_ops

    t, hidden, h, kvh, d = (64, 256, 8, 2, 64) if small else (8192, 2048, 32, 8, 64)
    x = torch.randn(t, hidden, dtype=torch.bfloat16, device=device)
    r = torch.randn_like(x)
    w = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    rows = [_row(f"rms_norm + residual {t} x {hidden}", impl, timed(fn), 5 * x.numel() * 2, "GB/s", hbm, err)
            for impl, fn, err in (("triton", lambda: triton_ops.rms_norm(x, w, 1e-5, r), _err(
                triton_ops.rms_norm(x, w, 1e-5, r)[0], norm.rms_norm_ref(x, w, 1e-5, r)[0])),
                ("torch reference", lambda: norm.rms_norm_ref(x, w, 1e-5, r), None))]
    q = torch.randn(t, h, d, dtype=torch.bfloat16, device=device)
    k = torch.randn(t, kvh, d, dtype=torch.bfloat16, device=device)
    pos = torch.arange(t, device=device)
    freqs = torch.outer(torch.arange(t, device=device).float(), torch.rand(d // 2, device=device))
    cos, sin = freqs.cos(), freqs.sin()
    moved = 2 * (q.numel() + k.numel()) * 2
    rows += [_row(f"rotary q+k {t} tokens", impl, timed(fn), moved, "GB/s", hbm, err)
             for impl, fn, err in (("triton", lambda: triton_ops.rotary(q, k, pos, cos, sin), _err(
                 triton_ops.rotary(q, k, pos, cos, sin)[0], rotary.rotary_ref(q, k, pos, cos, sin)[0])),
                 ("torch reference", lambda: rotary.rotary_ref(q, k, pos, cos, sin), None))]
    kc, vc, _, _ = _paged(t // 16, 16 * 16, kvh, d, torch.bfloat16, device)
    slots = torch.randperm(kc.shape[0] * 16, device=device)[:t]
    rows += [_row(f"store_kv {t} tokens", impl, timed(fn), 4 * k.numel() * 2, "GB/s", hbm)
             for impl, fn in (("triton", lambda: tri.write_kv(k, k, kc, vc, slots)),
                              ("torch reference", lambda: ref.write_kv(k, k, kc, vc, slots)))]
    return rows


def matmul_cases(hbm: float, device, small: bool) -> list[dict]:
    from servelab_kernels import triton_quant

    n, k = (256, 512) if small else (14336, 4096)  # Llama-3.1-8B's MLP up projection, at batch 1
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device)
    x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
    q8, s8 = quant.quantize_int8(w)
    q4, s4, z4 = quant.quantize_int4(w, 128)
    p4 = triton_quant.pack_int4_nibbles(q4)
    name = f"matmul 1 x {k} x {n}"
    return [
        _row(name + " bf16", "torch F.linear", timed(lambda: F.linear(x, w)), w.numel() * 2, "GB/s", hbm),
        _row(name + " int8 weights", "triton", timed(lambda: triton_quant.int8_matmul(x, q8, s8)), q8.numel(), "GB/s",
             hbm, _err(triton_quant.int8_matmul(x, q8, s8), quant.int8_matmul_ref(x, q8, s8))),
        _row(name + " int4 weights (g128)", "triton", timed(lambda: triton_quant.int4_matmul(x, p4, s4, z4, 128)),
             p4.numel(), "GB/s", hbm, _err(triton_quant.int4_matmul(x, p4, s4, z4, 128),
                                           quant.int4_matmul_ref(x, q4, s4, z4, 128))),
    ]


def kernel_table(rates: dict, log, small: bool = False) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hbm, peak = rates["mem_bandwidth_gbs"], rates["matmul_gflops"]["bf16"] / 1e3
    rows = []
    for name, fn in (("decode", lambda: decode_cases(hbm, device, small)),
                     ("prefill", lambda: prefill_cases(peak, device, small)),
                     ("elementwise", lambda: elementwise_cases(hbm, device, small)),
                     ("matmul", lambda: matmul_cases(hbm, device, small))):
        try:
            rows += fn()
        except Exception as e:  # a broken kernel is a row of the report, not the end of it
            rows.append({"case": name, "impl": "error", "error": f"{type(e).__name__}: {e}"})
        log(f"kernels: {name} done")
    return rows


def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def write_markdown(report: dict, out: Path) -> None:
    dev = report["device"]
    lines = [f"# servelab GPU check: {dev['device']}", "",
             f"- measured: HBM read {dev['mem_bandwidth_gbs']:,.0f} GB/s, bf16 matmul "
             f"{dev['matmul_gflops']['bf16'] / 1e3:,.0f} TFLOP/s; torch {dev['torch']}; {report['created']}; "
             f"whole check {report['wall_s']:.0f} s", "", "## Targets (issue 11)", "",
             "| target | wanted | measured | met |", "|---|---|---|---|"]
    lines += [f"| {t['target']} | {t['wanted']:,.0f} {t['unit']} | {_fmt(t['measured'])} | {'yes' if t['met'] else 'NO'} |"
              for t in report["targets"]]
    lines += ["", "## Kernels", "", "| case | implementation | ms | rate | share of the measured peak | max error vs reference (relative) |",
              "|---|---|---|---|---|---|"]
    for k in report["kernels"]:
        if "error" in k:
            lines.append(f"| {k['case']} | error | - | {k['error']} | - | - |")
            continue
        share = f"{k['fraction'] * 100:.1f} %" if k.get("fraction") else "-"
        err = f"{k['max_rel_err']:.1e}" if k.get("max_rel_err") is not None else "-"
        lines.append(f"| {k['case']} | {k['impl']} | {k['ms']:.3f} | {k['rate']:,.1f} {k['unit']} | {share} | {err} |")
    lines += ["", "## Runs (dummy weights at real shapes, forced output lengths)", "",
              "| run | system | requests | output tok/s | tok/s per stream (1 / TPOT p50) | TTFT p50 (ms) | TPOT p50 (ms) | "
              "% of roofline | wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if "output_tok_s" not in r:
            lines.append(f"| {r['label']} | - | - | {r.get('skipped') or r.get('error')} | - | - | - | - | - |")
            continue
        lines.append(f"| {r['label']} | {r['system']} | {r['requests']} | {_fmt(r['output_tok_s'])} | "
                     f"{_fmt(r['tok_s_per_stream'])} | {_fmt((r['ttft_p50_s'] or 0) * 1e3)} | "
                     f"{_fmt((r['tpot_p50_s'] or 0) * 1e3, 2)} | {r['fraction_of_roofline'] * 100:.1f} % | {r['wall_s']:.0f} |")
    lines += ["", "Rates are medians of CUDA-event timings; bandwidth counts the bytes a kernel must move (KV read for "
              "decode, weights for the batch-1 matmuls), FLOP/s the attention's multiply-adds.", ""]
    (out / "report.md").write_text("\n".join(lines))
    _plot(report, out)


def _plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [k for k in report["kernels"] if k.get("fraction")]
    if ks:
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(ks) + 1.5))
        ax.barh([f"{k['case']} [{k['impl']}]" for k in ks], [k["fraction"] * 100 for k in ks])
        ax.set_xlabel("% of the measured peak (HBM bandwidth or bf16 matmul)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(out / "kernels.png", dpi=90)
        plt.close(fig)
    rs = [r for r in report["runs"] if "output_tok_s" in r]
    if rs:
        fig, ax = plt.subplots(figsize=(9, 0.4 * len(rs) + 1.5))
        ax.barh([r["label"] for r in rs], [r["output_tok_s"] for r in rs])
        ax.set_xscale("log")
        ax.set_xlabel("output tok/s")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(out / "runs.png", dpi=90)
        plt.close(fig)
