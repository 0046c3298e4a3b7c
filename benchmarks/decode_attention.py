"""Decode attention on this machine against its KV-read floor: `python -m benchmarks.decode_attention`.

Each implementation (the torch reference, the C++ kernel) over paged caches of SmolLM2's geometry
(9 query heads, 3 KV heads, head_dim 64, blocks of 16, scattered): bytes of K and V read per call
over the median time, as a share of the read bandwidth the roofline probe measures. Writes
reports/decode-attention/report.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.gpu_kernels import timed
from kernels import attention as ref
from kernels import cpu_attention

CASES = [(1, 2048, torch.bfloat16), (16, 512, torch.bfloat16), (64, 256, torch.bfloat16), (64, 1024, torch.bfloat16),
         (128, 640, torch.bfloat16), (64, 1024, torch.int8)]


def case(b: int, ctx: int, dtype, bandwidth: float) -> list[str]:
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
        t = timed(fn, 20)
        gbs = kv_bytes / t / 1e9
        rows.append(f"| {b} x {ctx} {'int8' if dtype == torch.int8 else 'bf16'} | {name} | {t * 1e3:.2f} | "
                    f"{gbs:.1f} | {gbs / bandwidth * 100:.0f} % |")
    return rows


def main(argv=None) -> int:
    from core.bench.roofline import machine_rates

    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention")
    ap.add_argument("--out", default="reports/decode-attention")
    args = ap.parse_args(argv)
    rates = machine_rates(remeasure=True)
    bw = rates["mem_bandwidth_gbs"]
    lines = [f"# Decode attention against the KV-read floor\n\n- machine: {rates['cpu']}, {rates['cores']} cores, "
             f"torch {rates['torch']}; read bandwidth {bw:.1f} GB/s (measured now); SmolLM2 geometry (9 heads, 3 KV "
             "heads, head_dim 64), blocks of 16, scattered; median of 20 calls\n",
             "| sequences x context | implementation | ms | GB/s of K+V read | share of the read bandwidth |",
             "|---|---|---|---|---|"]
    for b, ctx, dtype in CASES:
        lines += case(b, ctx, dtype, bw)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
