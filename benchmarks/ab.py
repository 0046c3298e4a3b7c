"""What the side-by-side step benchmarks (eager_ops, packed_linear, quant_steps) share: a step's mean
time over a round, rounds alternating with a baseline, and their report files (report.md for
people, report.json for machines, printed too)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def mean_seconds(step, n: int) -> float:
    """Mean wall time of `n` calls of `step` (one round)."""
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def alternating_rounds(step, n: int, rounds: int, baseline) -> dict:
    """`rounds` rounds of `n` calls of `step` as it is, each followed by a round inside the
    `baseline()` context, so the machine's drift falls on both (both warmed first): each side's
    round times and the per-round ratios baseline / as-is."""
    step()
    with baseline():
        step()
    mine, base = [], []
    for _ in range(rounds):
        mine.append(mean_seconds(step, n))
        with baseline():
            base.append(mean_seconds(step, n))
    return {"mine": mine, "baseline": base, "ratios": [b / a for a, b in zip(mine, base)]}


def write_report(out: str | Path, md: str, data: dict) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps(data, indent=2))
    print(md)
