"""PNG plots of one run or several overlaid: latency CDFs, percentiles, timelines, and a rate sweep's SLO-capacity curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.bench import capacity
from core.bench.capacity import offered_rate


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values, label):
    v = np.sort(np.asarray([x for x in values if x is not None], dtype=float))
    if v.size:
        ax.step(v * 1000, np.arange(1, v.size + 1) / v.size, where="post", label=label)


def latency_cdfs(results: list[dict], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in results:
        reqs = r["requests"]
        _cdf(axes[0], [q["ttft_s"] for q in reqs], r["label"])
        _cdf(axes[1], [q["tpot_s"] for q in reqs], r["label"])
        _cdf(axes[2], [q["e2e_s"] for q in reqs], r["label"])
    slo = results[0]["summary"]["slo"]
    for ax, title, line in zip(axes, ("TTFT", "TPOT", "end-to-end latency"), (slo["ttft_s"], slo["tpot_s"], None)):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if line:
            ax.axvline(line * 1000, color="red", ls="--", lw=1, label="SLO")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def latency_percentiles(results: list[dict], path: Path) -> None:
    plt = _plt()
    metrics = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"))
    pcts = ("p50", "p90", "p95", "p99")
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    width = 0.8 / len(results)
    for ax, (title, key) in zip(axes, metrics):
        for i, r in enumerate(results):
            s = r["summary"].get(key, {})
            vals = [(s.get(p) or 0) * 1000 for p in pcts]
            ax.bar(np.arange(4) + i * width, vals, width, label=r["label"])
        ax.set_xticks(np.arange(4) + width * (len(results) - 1) / 2, pcts)
        ax.set_title(f"{title} percentiles")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _throughput_series(result: dict, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    times = np.asarray([t for q in result["requests"] for t in q.get("token_times_s", [])])
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0, times.max() + bin_s, bin_s)
    counts, _ = np.histogram(times, edges)
    return edges[:-1] + bin_s / 2, counts / bin_s


def timeline(results: list[dict], path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    longest = max((r["summary"]["duration_s"] for r in results), default=1.0)
    bin_s = max(longest / 60, 0.25)
    for r in results:
        x, y = _throughput_series(r, bin_s)
        axes[0].plot(x, y, label=r["label"])
        steps = r.get("steps", [])
        t = [s["time_s"] for s in steps]
        usage = [s["kv_usage"] for s in steps]
        if steps and usage[0] is not None:
            # a step's stats are taken at its end and hold during it: draw them over the step
            axes[1].plot(t, np.asarray(usage) * 100, drawstyle="steps-pre", label=r["label"])
        axes[2].plot(t, [s["num_waiting"] for s in steps], drawstyle="steps-pre", label=f"{r['label']} waiting")
        axes[2].plot(t, [s["num_running"] for s in steps], drawstyle="steps-pre", ls="--",
                     label=f"{r['label']} running")
    axes[0].set_ylabel(f"output tok/s ({bin_s:.2g} s bins)")
    axes[1].set_ylabel("KV cache usage %")
    axes[2].set_ylabel("requests")
    axes[2].set_xlabel("time since start (s)")
    for ax, title in zip(axes, ("throughput over time", "KV-cache usage over time", "queue length over time")):
        drawn = bool(ax.get_legend_handles_labels()[0])
        ax.set_title(title if drawn else f"{title}: not recorded (the engine runs in the server)")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_plots(results: list[dict], out: Path) -> list[str]:
    """The plots of any report; a sweep over the arrival rate adds its SLO-capacity curves."""
    files = {"latency_cdf.png": latency_cdfs, "latency_percentiles.png": latency_percentiles, "timeline.png": timeline}
    for name, fn in files.items():
        fn(results, out / name)
    curve = capacity_plot(results, out / "slo_capacity.png")
    return list(files) + ([curve] if curve else [])


def load_curve(results: list[dict], path: Path) -> str:
    """Throughput and P99 TTFT against the number of users, with the SLO line."""
    plt = _plt()
    users = [r["users"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.plot(users, [r["summary"]["output_tok_s"] for r in results], marker="o")
    a.set_xlabel("users")
    a.set_ylabel("output tok/s")
    a.set_title("throughput")
    for key, label in (("p50", "TTFT p50"), ("p99", "TTFT p99")):
        b.plot(users, [(r["summary"]["ttft_s"].get(key) or 0) * 1000 for r in results], marker="o", label=label)
    b.axhline(results[0]["summary"]["slo"]["ttft_s"] * 1000, color="red", ls="--", label="SLO")
    b.set_xlabel("users")
    b.set_ylabel("ms")
    b.set_title("time to first token")
    b.legend()
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def capacity_plot(results: list[dict], path: Path) -> str | None:
    """Attainment, goodput and TPOT p99 against offered rate, one line per configuration."""
    by_system = capacity.groups(results)
    if not by_system:
        return None
    plt = _plt()
    slo = results[0]["summary"]["slo"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for system, rs in by_system.items():
        x = [offered_rate(r) for r in rs]
        axes[0].plot(x, [r["summary"]["slo"]["attained"] * 100 for r in rs], "o-", label=system)
        axes[1].plot(x, [r["summary"]["goodput_req_s"] for r in rs], "o-", label=system)
        axes[2].plot(x, [(r["summary"]["tpot_s"].get("p99") or 0) * 1000 for r in rs], "o-", label=system)
    axes[0].axhline(capacity.ATTAINMENT * 100, color="grey", ls="--", lw=1)
    axes[2].axhline(slo["tpot_s"] * 1000, color="grey", ls="--", lw=1)
    return _rate_panels(plt, fig, axes, ("requests meeting both targets (%)", "goodput (req/s)", "TPOT p99 (ms)"),
                        path)


def _rate_panels(plt, fig, axes, titles, path: Path) -> str:
    """Label panels that share an offered-rate axis, save the figure, return its file name."""
    for ax, title in zip(axes, titles):
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def disagg_plot(points: list[dict], meta: dict, path: Path) -> str | None:
    """`disagg`: attainment, TTFT p99 and TPOT p99 against rate, colocated and each P:D split."""
    main = [p for p in points if "bandwidth_gbs" not in p]
    if not main:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for config in dict.fromkeys(p["config"] for p in main):
        ps = sorted((p for p in main if p["config"] == config), key=lambda p: p["rate"])
        x = [p["rate"] for p in ps]
        axes[0].plot(x, [p["attained"] * 100 for p in ps], "o-", label=config)
        axes[1].plot(x, [p["ttft_p99_s"] or 0 for p in ps], "o-", label=config)
        axes[2].plot(x, [(p["tpot_p99_s"] or 0) * 1000 for p in ps], "o-", label=config)
    axes[0].axhline(meta["attainment"] * 100, color="grey", ls="--", lw=1)
    axes[1].axhline(meta["slo"][0], color="grey", ls="--", lw=1)
    axes[2].axhline(meta["slo"][1] * 1000, color="grey", ls="--", lw=1)
    return _rate_panels(plt, fig, axes, [f"{t}, simulated" for t in ("requests meeting both targets (%)",
                                                                      "TTFT p99 (s)", "TPOT p99 (ms)")], path)
