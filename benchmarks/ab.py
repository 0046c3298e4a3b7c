"""What the side-by-side step benchmarks (eager_ops, quant_steps) share: a step's mean time over a
round, and their report files (report.md for people, report.json for machines, printed too)."""

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


def write_report(out: str | Path, md: str, data: dict) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps(data, indent=2))
    print(md)
