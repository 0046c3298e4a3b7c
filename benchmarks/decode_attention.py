"""Decode attention on this machine against its KV-read floor, and the C++ prefill beside SDPA:
`python -m benchmarks.decode_attention`.

Each implementation (the torch reference, the C++ kernel) over paged caches of SmolLM2's geometry
(9 query heads, 3 KV heads, head_dim 64, blocks of 16, scattered): bytes of K and V read per call
as a share of the read bandwidth. This machine's bandwidth moves by 1.5x within minutes (shared
hosts), so each case alternates rounds of the kernel with rounds of the bandwidth probe (a sum over
a buffer far past the last-level cache) and reports the median of the per-round ratios. Writes
reports/decode-attention/report.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kernels import attention as ref
from kernels import cpu_attention

CASES = [(1, 2048, torch.bfloat16), (16, 512, torch.bfloat16), (64, 256, torch.bfloat16), (64, 1024, torch.bfloat16),
         (128, 640, torch.bfloat16), (64, 1024, torch.int8)]


ROUNDS, CALLS = 7, 5


def median_seconds(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def side_by_side(fn, kv_bytes: int, probe: torch.Tensor) -> tuple[float, float, float]:
    """(median seconds a call, median read bandwidth GB/s, median per-round share of it)."""
    fn()
    calls, bws, shares = [], [], []
    for _ in range(ROUNDS):
        bw = probe.numel() * probe.element_size() / median_seconds(probe.sum, 3) / 1e9
        t = median_seconds(fn, CALLS)
        calls.append(t)
        bws.append(bw)
        shares.append(kv_bytes / t / 1e9 / bw)
    return statistics.median(calls), statistics.median(bws), statistics.median(shares)


def case(b: int, ctx: int, dtype, probe: torch.Tensor) -> list[str]:
    bs, kvh, d = 16, 3, 64
    nb = -(-ctx // bs)
    g = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        kc = torch.randint(-127, 128, (b * nb, kvh, bs, d), dtype=torch.int8, generator=g)
        scales = (torch.rand(b * nb, kvh, bs, generator=g).half() / 50, torch.rand(b * nb, kvh, bs, generator=g).half() / 50)
    else:
        kc, scales = torch.randn(b * nb, kvh, bs, d, generator=g).to(dtype), ()
    vc = kc.clone()
    tables = torch.randperm(b * nb, generator=g).view(b, nb)
    lens = torch.full((b,), ctx)
    q = torch.randn(b, 9, d, generator=g).bfloat16()
    kv_bytes = 2 * b * ctx * kvh * (d * kc.element_size() + (2 if dtype == torch.int8 else 0))
    packed = ref.pack_decode_blocks(tables, lens, bs)
    rows = []
    for name, fn in (("torch reference", lambda: ref.decode_attention(q, kc, vc, tables, lens, 0.125, *scales,
                                                                       packed=packed)),
                     ("C++ (attention=cpu)", lambda: cpu_attention.decode_attention(q, kc, vc, tables, lens, 0.125,
                                                                                    *scales))):
        t, bw, share = side_by_side(fn, kv_bytes, probe)
        rows.append(f"| {b} x {ctx} {'int8' if dtype == torch.int8 else 'bf16'} | {name} | {t * 1e3:.2f} | "
                    f"{kv_bytes / t / 1e9:.1f} | {bw:.1f} | {share * 100:.0f} % |")
    return rows


PREFILL_CASES = [(0, 512), (1024, 512), (0, 2048)]  # (cached prefix, chunk) of one sequence


def prefill_case(prefix: int, chunk: int) -> str:
    """The C++ paged prefill against the reference's padded SDPA call (PyTorch's CPU flash
    attention), one bf16 chunk over its cached prefix, rounds alternating between the two."""
    bs, ctx = 16, prefix + chunk
    nb = -(-ctx // bs)
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(nb, 3, bs, 64, generator=g).bfloat16() for _ in range(2))
    tables, lens = torch.randperm(nb, generator=g)[None], torch.tensor([ctx])
    starts, q = torch.tensor([0, chunk]), torch.randn(chunk, 9, 64, generator=g).bfloat16()
    groups = ref.plan_prefill(tables, [0, chunk], [ctx], bs)
    sdpa = lambda: ref.prefill_attention(q, kc, vc, tables, lens, starts, 0.125, groups=groups)  # noqa: E731
    cpp = lambda: cpu_attention.prefill_attention(q, kc, vc, tables, lens, starts, 0.125)  # noqa: E731
    sdpa(), cpp()
    times = [(median_seconds(sdpa, CALLS), median_seconds(cpp, CALLS)) for _ in range(ROUNDS)]
    t_sdpa, t_cpp = (statistics.median(t[i] for t in times) for i in (0, 1))
    flops = 4 * 9 * 64 * (chunk * prefix + chunk * (chunk + 1) / 2)
    ratios = sorted(a / b for a, b in times)
    return (f"| {prefix} | {chunk} | {t_sdpa * 1e3:.2f} | {t_cpp * 1e3:.2f} | {flops / t_cpp / 1e9:.0f} | "
            f"{t_sdpa / t_cpp:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")


def main(argv=None) -> int:
    from core.bench.roofline import machine_rates

    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention")
    ap.add_argument("--out", default="reports/decode-attention")
    args = ap.parse_args(argv)
    rates = machine_rates()
    probe = torch.ones(1 << 27)  # 512 MB
    lines = [f"# Decode attention against the KV-read floor\n\n- machine: {rates['cpu']}, {rates['cores']} cores, "
             f"torch {rates['torch']}; SmolLM2 geometry (9 heads, 3 KV heads, head_dim 64), blocks of 16, "
             f"scattered\n- {ROUNDS} rounds per row, each the median of {CALLS} calls beside a read-bandwidth probe "
             "(a sum over 512 MB) taken just before it; the share is the median of the rounds' ratios\n",
             "| sequences x context | implementation | ms | GB/s of K+V read | read bandwidth GB/s (probe) | share of it |",
             "|---|---|---|---|---|---|"]
    for b, ctx, dtype in CASES:
        lines += case(b, ctx, dtype, probe)
    lines += ["\n## Prefill: the C++ kernel beside PyTorch's CPU flash attention (SDPA), bf16\n",
              f"Median of {ROUNDS} rounds, each the median of {CALLS} calls of either; the ratio's range is over the rounds.\n",
              "| cached prefix | chunk | SDPA ms | C++ ms | C++ GFLOP/s | SDPA / C++ |", "|---|---|---|---|---|---|"]
    lines += [prefill_case(prefix, chunk) for prefix, chunk in PREFILL_CASES]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
