"""The calibration's second half and its report: each workload on the real backend and on the
simulator with the fitted profile, predicted against measured."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# the bar for a useful simulator: throughput within 15 %, TTFT and TPOT p50 within 25 %
TOLERANCE = {"output_tok_s": 0.15, "total_tok_s": 0.15, "ttft_p50_s": 0.25, "tpot_p50_s": 0.25}


def _metrics(summary: dict) -> dict:
    return {"output_tok_s": summary["output_tok_s"], "total_tok_s": summary["total_tok_s"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "tpot_p99_s": summary["tpot_s"]["p99"],
            "duration_s": summary["duration_s"]}


def validate(overrides: list[str], cc, profile_path: Path) -> list[dict]:
    """Each workload of `cc.validate`, measured then simulated, with the command line's overrides."""
    from core.bench import report
    from core.bench.run import run_one
    from core.config.compose import compose
    from core.config.schema import run_config

    base = [o for o in overrides if not o.startswith("calibrate.")]
    rows = []
    for name in cc.validate:
        common = base + [f"workload={name}"] + list(cc.validate_overrides)
        real = run_one(compose(common + ["run.plots=false"]), label=f"{name} measured")
        sim = run_one(compose(common + ["backend=simulator", "hardware=cpu", f"hardware.path={profile_path}",
                                        "run.plots=false"]), label=f"{name} simulated")
        cfg = compose(common + [f"run.report_dir={Path(cc.report_dir) / cc.name}", "run.plots=false"])
        report.write_comparison([real, sim], name, run_config(cfg))
        measured, predicted = _metrics(real["summary"]), _metrics(sim["summary"])
        errors = {k: (predicted[k] - measured[k]) / measured[k] if measured[k] else None for k in measured}
        rows.append({"workload": name, "measured": measured, "simulated": predicted, "relative_error": errors,
                     "within_tolerance": {k: errors[k] is not None and abs(errors[k]) <= t
                                          for k, t in TOLERANCE.items()}})
    return rows


def write_report(out: Path, profile, fit: dict, samples: list[dict], validation: list[dict], rates: dict) -> None:
    p = dataclasses.asdict(profile)
    (out / "report.json").write_text(json.dumps({"profile": p, "fit": fit, "samples": samples,
                                                 "validation": validation, "machine": rates}, indent=1))
    lines = [f"# Calibration of this machine's CPU profile\n\n- machine: {rates['cpu']}, {rates['cores']} cores, torch "
             f"{rates['torch']}\n- made by `python -m core calibrate`; the profile is saved where `hardware=cpu` "
             "finds it (and as profile.json here)\n", "## The fitted profile\n", "| parameter | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in p.items() if k != "notes"]
    lines += ["", f"Step times over the grid: median relative error {fit['median_abs_relative_error'] * 100:.1f} %, "
              f"p90 {fit['p90_abs_relative_error'] * 100:.1f} % ({len(samples)} steps).", "",
              "| grid point | measured ms (median) | predicted ms | relative error |", "|---|---|---|---|"]
    lines += [f"| {t['point']} | {t['measured_s'] * 1e3:.1f} | {t['predicted_s'] * 1e3:.1f} | "
              f"{t['relative_error'] * 100:+.1f} % |" for t in fit["points"]]
    if validation:
        lines += ["", "## Simulated against measured, whole workloads", "",
                  "Tolerance: throughput within 15 %, TTFT and TPOT p50 within 25 %. Each workload's two runs are "
                  "also in `<workload>/report.md`.", "",
                  "| workload | metric | measured | simulated | error | within |", "|---|---|---|---|---|---|"]
        for v in validation:
            for k in ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
                e = v["relative_error"][k]
                ok = v["within_tolerance"].get(k)
                lines.append(f"| {v['workload']} | {k} | {v['measured'][k]:.4g} | {v['simulated'][k]:.4g} | "
                             f"{'' if e is None else f'{e * 100:+.1f} %'} | {'' if ok is None else ('yes' if ok else 'no')} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
