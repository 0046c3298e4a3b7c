"""Decode attention on this machine against its KV-read floor, and the C++ prefill beside SDPA:
`python -m benchmarks.decode_attention`.

Each implementation (the torch reference, the C++ vector kernel (AVX-512, or the AVX2 two-pass kernel
on CPUs without AVX-512), the portable C++ loop every CPU builds, the one-pass predecessor where the
two-pass kernel is AVX512-BF16 code, the AMX tile kernel where the CPU has AMX-BF16) over paged bf16,
INT8 and fp32 caches of SmolLM2's geometry (9 query heads, 3 KV heads, head_dim 64, blocks of 16 or
`--block-size`, scattered over a pool): bytes of K and V read per call as a share of two floors.

Read cold, as an engine reads them: a 30-layer model's caches are far past the last-level cache, so
every call here reads blocks no recent call touched (the calls cycle through tables drawn from a
pool at least twice the LLC). A benchmark that re-reads one small cache measures the LLC instead
(this report did so before 2026-12-03, and on a CPU with a 480 MB LLC it read "90 % of the
bandwidth" for a kernel that reads cold KV at half that).

The two floors: the read bandwidth (a sum over a buffer far past the LLC, taken in every round:
this machine's bandwidth moves by 1.5x within minutes on shared hosts) and `read_blocks`, the same
scattered rows read by the same threads with no arithmetic (the access pattern's own ceiling).
Each case alternates rounds of the kernel with rounds of the probe and reports the median of the
per-round ratios; the resident column is the kernel re-reading one cache (its compute ceiling).
Writes reports/decode-attention/report.{md,json}; `--block-sizes` instead times the default kernel
and the floor at blocks of 16 to 128 tokens (`cache.block_size`), `--out` naming the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from servelab_kernels import attention as ref
from servelab_kernels import cpu_attention, huge_pages
from servelab_kernels.cpp_build import cpu_features

CASES = [(1, 2048, torch.bfloat16), (16, 512, torch.bfloat16), (64, 256, torch.bfloat16), (64, 640, torch.bfloat16),
         (64, 1024, torch.bfloat16), (128, 640, torch.bfloat16), (64, 1024, torch.int8), (64, 512, torch.float32),
         (64, 1024, torch.float32)]
KV_NAMES = {torch.bfloat16: "bf16", torch.int8: "int8", torch.float32: "fp32"}


ROUNDS, CALLS = 7, 5


def median_seconds(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def llc_bytes() -> int:
    """The last-level cache's size (Linux's sysfs), 64 MB where it cannot be read."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    best = 0
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * unit)
    return best or 64 << 20


class ColdCaches:
    """`sets` disjoint block tables for `b` sequences of `ctx` tokens, drawn at random from one pool
    of K and V blocks, together at least `span` bytes; each call takes the next set."""

    def __init__(self, b: int, ctx: int, dtype, span: int, bs: int = 16, kvh: int = 3, d: int = 64,
                 huge: bool = True):
        g = torch.Generator().manual_seed(0)
        self.bs = bs
        nb = -(-ctx // bs)
        block_bytes = 2 * kvh * bs * d * torch.empty((), dtype=dtype).element_size()
        self.sets = max(2, -(-span // (b * nb * block_bytes)))
        pool = self.sets * b * nb
        if dtype == torch.int8:
            self.kc = torch.randint(-127, 128, (pool, kvh, bs, d), dtype=torch.int8, generator=g)
            self.scales = tuple(torch.rand(pool, kvh, bs, generator=g).half() / 50 for _ in range(2))
        else:
            self.kc, self.scales = torch.randn(pool, kvh, bs, d, generator=g).to(dtype), ()
        self.vc = torch.randn(pool, kvh, bs, d, generator=g).to(dtype) if dtype != torch.int8 else self.kc.flip(0)
        with huge_pages.enabled(huge):  # on 2 MB pages where the engine's caches are (attention.huge_pages)
            self.kc, self.vc = (huge_pages.zeros(t.shape, t.dtype).copy_(t) for t in (self.kc, self.vc))
        self.tables = list(torch.randperm(pool, generator=g).view(self.sets, b, nb))
        self.lens = torch.full((b,), ctx)
        self.q = torch.randn(b, 9, d, generator=g).to(torch.float32 if dtype == torch.float32 else torch.bfloat16)
        self.kv_bytes = 2 * b * ctx * kvh * (d * self.kc.element_size() + (2 if dtype == torch.int8 else 0))
        self.next, self.resident = 0, False

    def take(self) -> torch.Tensor:
        """The next set's block table (the first, over and over, when `resident`)."""
        if self.resident:
            return self.tables[0]
        table = self.tables[self.next]
        self.next = (self.next + 1) % self.sets
        return table


def side_by_side(call, kv_bytes: int, probe: torch.Tensor, calls: int) -> dict:
    """Median seconds a call, the probe's median GB/s and the median per-round share of it."""
    call()
    secs, bws, shares = [], [], []
    for _ in range(ROUNDS):
        bw = probe.numel() * probe.element_size() / median_seconds(probe.sum, 3) / 1e9
        t = median_seconds(call, calls)
        secs.append(t)
        bws.append(bw)
        shares.append(kv_bytes / t / 1e9 / bw)
    return {"ms": statistics.median(secs) * 1e3, "probe_gbs": statistics.median(bws),
            "share_of_probe": statistics.median(shares)}


def implementations(c: ColdCaches) -> dict:
    """name -> a call over the next cold set; a falsy entry where the implementation does not run here."""
    q, lens, s = c.q, c.lens, c.scales
    packs = {id(table): ref.pack_decode_blocks(table, lens, c.bs) for table in c.tables}  # outside the timed calls

    def reference():
        table = c.take()
        ref.decode_attention(q, c.kc, c.vc, table, lens, 0.125, *s, packed=packs[id(table)])

    def vector():
        with cpu_attention.amx_decode(False):
            cpu_attention.decode_attention(q, c.kc, c.vc, c.take(), lens, 0.125, *s)

    def one_pass():
        with cpu_attention.amx_decode(False), cpu_attention.two_pass_decode(False):
            cpu_attention.decode_attention(q, c.kc, c.vc, c.take(), lens, 0.125, *s)

    def tiles():
        cpu_attention.decode_attention(q, c.kc, c.vc, c.take(), lens, 0.125, *s)

    def portable():
        cpu_attention.decode_attention(q, c.kc, c.vc, c.take(), lens, 0.125, *s, portable=True)

    amx = cpu_attention.amx_decode_ready() and c.kc.dtype == torch.bfloat16
    # the one-pass switch exists where the two-pass kernel is AVX512-BF16 code, for bf16 and INT8 caches
    one = "avx512_bf16" in cpu_features() and c.kc.dtype != torch.float32
    return {"torch reference": reference, vector_name(): vector,
            "C++ portable loop (attention.decode=portable)": portable,
            "C++ vector in one pass (a running max: the kernel before 2026-12-06)": one_pass if one else None,
            "C++ AMX tiles (attention=cpu, the default here)": tiles if amx else None,
            "read floor (read_blocks: the same reads, no arithmetic)":
                lambda: cpu_attention.read_blocks(c.kc, c.vc, c.take(), lens)}


def vector_name() -> str:
    """The vector kernel's row: AVX-512 code, or the AVX2 two-pass kernel on CPUs without AVX-512."""
    return f"C++ {'AVX2 two-pass' if cpu_attention.avx2_decode_built() else 'vector'} (attention=cpu)"


def case(b: int, ctx: int, dtype, probe: torch.Tensor, span: int, bs: int) -> list[dict]:
    c = ColdCaches(b, ctx, dtype, span, bs=bs)
    rows, floor_ms = [], None
    for name, call in implementations(c).items():
        if not call:
            continue
        calls = max(CALLS, min(c.sets, 64))
        cold = side_by_side(call, c.kv_bytes, probe, calls)
        c.resident = True
        resident = side_by_side(call, c.kv_bytes, probe, CALLS)["ms"]
        c.resident = False
        if name.startswith("read floor"):
            floor_ms = cold["ms"]
        rows.append({"sequences": b, "context": ctx, "kv": KV_NAMES[dtype],
                     "implementation": name, "cold_sets": c.sets, **cold, "gbs": c.kv_bytes / cold["ms"] / 1e6,
                     "resident_gbs": c.kv_bytes / resident / 1e6})
    default = "C++ AMX tiles (attention=cpu, the default here)" if any(r["implementation"].startswith("C++ AMX")
                                                                      for r in rows) else vector_name()
    rows.append(plain_pages(b, ctx, dtype, probe, span, default, bs))
    for row in rows:
        row["share_of_floor"] = floor_ms / row["ms"] if floor_ms else None
    return rows


def plain_pages(b: int, ctx: int, dtype, probe: torch.Tensor, span: int, name: str, bs: int) -> dict:
    """The default kernel over caches on 4 KB pages (`attention.huge_pages=false`)."""
    c = ColdCaches(b, ctx, dtype, span, bs=bs, huge=False)
    amx = name.startswith("C++ AMX")
    call = implementations(c)[name]
    with cpu_attention.amx_decode(amx):
        cold = side_by_side(call, c.kv_bytes, probe, max(CALLS, min(c.sets, 64)))
    return {"sequences": b, "context": ctx, "kv": KV_NAMES[dtype],
            "implementation": name.split(" (")[0] + " on 4 KB pages (attention.huge_pages=false)", "cold_sets": c.sets,
            **cold, "gbs": c.kv_bytes / cold["ms"] / 1e6, "resident_gbs": None}


PREFILL_CASES = [(0, 512), (800, 224), (1024, 512), (0, 2048)]  # (cached prefix, chunk) of one sequence


def prefill_kind(k_cache) -> str:
    """Which path of the C++ prefill serves this cache here."""
    if cpu_attention.prefill_on_tiles(k_cache):
        return "tiles"
    if not cpu_attention.prefill_fast(k_cache):
        return "loop"
    return "AVX2" if cpu_attention.avx2_decode_built() else "vector"


def prefill_case(prefix: int, chunk: int, dtype=torch.bfloat16) -> str:
    """The C++ paged prefill (its AMX tile kernel where the CPU has the tiles, and its vector kernel:
    AVX512-BF16, or AVX2 + FMA on CPUs without AVX-512) against the reference's padded SDPA call
    (PyTorch's CPU flash attention), one chunk over its cached prefix, rounds alternating between them."""
    bs, ctx = 16, prefix + chunk
    nb = -(-ctx // bs)
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(nb, 3, bs, 64, generator=g).to(dtype) for _ in range(2))
    tables, lens = torch.randperm(nb, generator=g)[None], torch.tensor([ctx])
    starts, q = torch.tensor([0, chunk]), torch.randn(chunk, 9, 64, generator=g).to(dtype)
    groups = ref.plan_prefill(tables, [0, chunk], [ctx], bs)
    sdpa = lambda: ref.prefill_attention(q, kc, vc, tables, lens, starts, 0.125, groups=groups)  # noqa: E731
    cpp = lambda: cpu_attention.prefill_attention(q, kc, vc, tables, lens, starts, 0.125)  # noqa: E731

    def vector():
        with cpu_attention.amx_prefill(False):
            return cpp()

    tiles = cpu_attention.prefill_on_tiles(kc)
    sdpa(), cpp(), vector()
    times = [(median_seconds(sdpa, CALLS), median_seconds(cpp, CALLS),
              median_seconds(vector, CALLS) if tiles else float("nan")) for _ in range(ROUNDS)]
    t_sdpa, t_cpp, t_vec = (statistics.median(t[i] for t in times) for i in (0, 1, 2))
    flops = 4 * 9 * 64 * (chunk * prefix + chunk * (chunk + 1) / 2)
    ratios = sorted(t[0] / t[1] for t in times)
    vec = f"{t_vec * 1e3:.2f}" if tiles else "(the C++ kernel)"
    return (f"| {KV_NAMES[dtype]} | {prefix} | {chunk} | {t_sdpa * 1e3:.2f} | {prefill_kind(kc)} {t_cpp * 1e3:.2f} | {vec} | "
            f"{flops / t_cpp / 1e9:.0f} | {t_sdpa / t_cpp:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")


def prefill_dtypes() -> list:
    """bf16 caches, and fp32 ones where the C++ kernel has a fast path for them (the AVX2 kernel: CPUs
    without AVX-512 run `model.dtype=auto` in fp32)."""
    return [torch.bfloat16] + ([torch.float32] if cpu_attention.prefill_fast(torch.zeros(1, 3, 16, 64)) else [])


def prefill_section() -> tuple[list[str], list[str]]:
    """The prefill table's lines, and its rows alone (for the JSON)."""
    rows = []
    for dtype in prefill_dtypes():
        for prefix, chunk in PREFILL_CASES:
            rows.append(prefill_case(prefix, chunk, dtype))
            print(rows[-1], flush=True)
    return ["\n## Prefill: the C++ kernel beside PyTorch's CPU flash attention (SDPA)\n",
            f"Median of {ROUNDS} rounds, each the median of {CALLS} calls of each; the ratio's range is over the "
            "rounds. The C++ kernel runs on AMX tiles where the CPU has them (`cpu_attention.amx_prefill`), its "
            "vector kernel beside it; GFLOP/s count the causal products only (4 x 9 heads x 64 a query-key pair).\n",
            "| cache | cached prefix | chunk | SDPA ms | C++ ms | C++ vector ms | C++ GFLOP/s | SDPA / C++ |",
            "|---|---|---|---|---|---|---|---|"] + rows, rows


BLOCK_SIZES, BLOCK_CASES = (16, 32, 64, 128), [(64, 256), (64, 640), (16, 512)]


def block_size_section(probe: torch.Tensor, span: int) -> tuple[list[str], list[dict]]:
    """The default kernel and the read floor over cold bf16 caches of each block size: a block is
    kv_heads runs of block_size x head_dim contiguous values (2 KB at 16 for SmolLM2), and a decode
    step reads every run of every block its sequences hold. The block sizes alternate within each
    round, so their ratio to blocks of 16 is taken side by side (the probe moves by 1.5x within
    minutes on shared hosts)."""
    rows, out = [], []
    for b, ctx in BLOCK_CASES:
        caches = {bs: ColdCaches(b, ctx, torch.bfloat16, span, bs=bs) for bs in BLOCK_SIZES}
        calls = {bs: implementations(c) for bs, c in caches.items()}
        name = next(n for n in ("C++ AMX tiles (attention=cpu, the default here)", vector_name())
                    if calls[16].get(n))
        floor_name = "read floor (read_blocks: the same reads, no arithmetic)"
        n = {bs: max(CALLS, min(c.sets, 64)) for bs, c in caches.items()}
        for bs in BLOCK_SIZES:
            calls[bs][name](), calls[bs][floor_name]()
        times = {bs: {"kernel": [], "floor": []} for bs in BLOCK_SIZES}
        bws = []
        for _ in range(ROUNDS):
            bws.append(probe.numel() * probe.element_size() / median_seconds(probe.sum, 3) / 1e9)
            for bs in BLOCK_SIZES:
                times[bs]["kernel"].append(median_seconds(calls[bs][name], n[bs]))
                times[bs]["floor"].append(median_seconds(calls[bs][floor_name], n[bs]))
        bw = statistics.median(bws)
        for bs in BLOCK_SIZES:
            kv = caches[bs].kv_bytes
            ratios = sorted(a / t for a, t in zip(times[16]["kernel"], times[bs]["kernel"]))
            ms, floor_ms = (statistics.median(times[bs][k]) for k in ("kernel", "floor"))
            r = {"sequences": b, "context": ctx, "block_size": bs, "implementation": name, "ms": ms * 1e3,
                 "gbs": kv / ms / 1e9, "floor_ms": floor_ms * 1e3, "floor_gbs": kv / floor_ms / 1e9, "probe_gbs": bw,
                 "speedup_vs_16": statistics.median(ratios), "speedup_range": [ratios[0], ratios[-1]]}
            out.append(r)
            rows.append(f"| {b} x {ctx} | {bs} | {name.split(' (')[0]} {r['ms']:.2f} | {r['gbs']:.1f} | "
                        f"{r['floor_ms']:.2f} | {r['floor_gbs']:.1f} | {bw:.1f} | {r['speedup_vs_16']:.2f}x "
                        f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |")
            print(rows[-1], flush=True)
    return ["\n## Block size (`cache.block_size`)\n",
            "The default kernel and the read floor over cold bf16 caches of each block size; a block holds each "
            f"KV head's block_size x 64 values contiguous, so larger blocks read longer runs. {ROUNDS} rounds, the "
            "block sizes alternating within each; medians over the rounds, the ratio to blocks of 16 taken round "
            "by round (its range in brackets).\n",
            "| sequences x context | block size | kernel ms | kernel GB/s | read floor ms | floor GB/s | probe GB/s "
            "| kernel vs blocks of 16 |", "|---|---|---|---|---|---|---|---|"] + rows, out


def main(argv=None) -> int:
    from core.bench.roofline import machine_rates

    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_attention")
    ap.add_argument("--out", default="reports/decode-attention")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill table (a minute)")
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens per KV block in the main table (the engine's CPU default is 64; 16 kept the "
                         "earlier reports comparable)")
    ap.add_argument("--block-sizes", action="store_true",
                    help="only the block-size table (decode at blocks of 16 to 128; a few minutes)")
    args = ap.parse_args(argv)
    rates = machine_rates()
    out = Path(args.out)
    if args.prefill_only:
        section, prefill = prefill_section()
        lines = [f"# Prefill attention\n\n- machine: {rates['cpu']}, {rates['cores']} cores, torch {rates['torch']}; "
                 "SmolLM2 geometry (9 heads, 3 KV heads, head_dim 64), blocks of 16 scattered\n"
                 "- made by `python -m benchmarks.decode_attention --prefill-only`"] + section
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text("\n".join(lines) + "\n")
        (out / "report.json").write_text(json.dumps({"machine": rates, "prefill": prefill}, indent=2))
        print("\n".join(lines))
        return 0
    llc = llc_bytes()
    span = max(2 * llc, 256 << 20)
    probe = torch.ones(max(2 * llc, 512 << 20) // 4)
    if args.block_sizes:
        section, rows = block_size_section(probe, span)
        lines = [f"# Decode attention by KV block size\n\n- machine: {rates['cpu']}, {rates['cores']} cores, torch "
                 f"{rates['torch']}, last-level cache {llc / 2**20:.0f} MB; SmolLM2 geometry, caches on 2 MB pages "
                 f"({huge_pages.mode()} THP), read cold as in reports/decode-attention; {ROUNDS} rounds a row beside the "
                 "probe\n- made by `python -m benchmarks.decode_attention --block-sizes`"] + section
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.md").write_text("\n".join(lines) + "\n")
        (out / "report.json").write_text(json.dumps({"machine": rates, "llc_bytes": llc, "cold_span_bytes": span,
                                                     "block_sizes": rows}, indent=2))
        print("\n".join(lines))
        return 0
    lines = [f"# Decode attention against the KV-read floor\n\n- machine: {rates['cpu']}, {rates['cores']} cores, "
             f"torch {rates['torch']}, last-level cache {llc / 2**20:.0f} MB; SmolLM2 geometry (9 heads, 3 KV heads, "
             f"head_dim 64), blocks of {args.block_size} scattered over a pool, on 2 MB pages where Linux gives them (as the engine's "
             f"caches, `attention.huge_pages`: here {huge_pages.mode()} THP), the default kernel once more on 4 KB pages\n"
             f"- cold: each call reads blocks no recent call read (the calls cycle through block tables over a pool of "
             f"{span / 2**20:.0f} MB, twice the LLC), as a model's 30 layers of caches are read; resident: one cache "
             "re-read (the kernel's compute ceiling, not a figure an engine sees)\n"
             f"- {ROUNDS} rounds per row, each the median of its calls, beside a read-bandwidth probe (a sum over "
             f"{probe.numel() * 4 / 2**20:.0f} MB) taken just before it; the shares are medians of the rounds' ratios\n"
             f"- made by `python -m benchmarks.decode_attention{' --block-size ' + str(args.block_size) if args.block_size != 16 else ''}`\n",
             "| sequences x context | implementation | ms (cold) | GB/s of K+V read (cold) | probe GB/s | "
             "share of the probe | share of the read floor | GB/s resident |",
             "|---|---|---|---|---|---|---|---|"]
    results = []
    for b, ctx, dtype in CASES:
        rows = case(b, ctx, dtype, probe, span, args.block_size)
        results += rows
        for r in rows:
            floor = f"{r['share_of_floor'] * 100:.0f} %" if r["share_of_floor"] else "-"
            resident = "-" if r["resident_gbs"] is None else f"{r['resident_gbs']:.1f}"
            lines.append(f"| {b} x {ctx} {r['kv']} | {r['implementation']} | {r['ms']:.2f} | {r['gbs']:.1f} | "
                         f"{r['probe_gbs']:.1f} | {r['share_of_probe'] * 100:.0f} % | {floor} | {resident} |")
        print("\n".join(lines[-len(rows):]), flush=True)
    section, prefill = prefill_section()
    lines += section
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps({"machine": rates, "llc_bytes": llc, "cold_span_bytes": span,
                                                 "decode": results, "prefill": prefill}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
