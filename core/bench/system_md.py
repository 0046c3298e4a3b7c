"""What a run ran on, for the reports: simulated hardware, tensor-parallel ranks."""

from __future__ import annotations


def simulated_md(sim: dict) -> str:
    share = ", ".join(f"{k} {v * 100:.0f} %" for k, v in sim["share_by_part"].items() if v >= 0.005)
    hw = sim["hardware"]
    return (f"- **simulated** (backend=simulator): no model ran; every step's time is the roofline model's on "
            f"{sim['describe']} ({hw['source'] or 'profile'}); simulated time by part: {share}")


def parallel_md(s: dict) -> str:
    p = s.get("parallel")
    return (f"\n- tensor parallel: {p['tensor_parallel_size']} ranks; rank 0 spent {p['collective_share'] * 100:.1f} % "
            f"of step time in collectives ({p['collective_calls']:,} all-reduces and all-gathers, waits for the "
            f"other ranks included)") if p else ""
