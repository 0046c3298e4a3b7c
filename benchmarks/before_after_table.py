"""One table from benchmarks/before_after.sh's two halves: `python -m benchmarks.before_after_table OUT_DIR`.

Reads OUT_DIR/{before,after}/<run>/report.json (single runs and comparisons alike) and writes
OUT_DIR/report.md and report.json: per workload and configuration, output tok/s, TPOT and TTFT
p50 and the share of the report's own roofline, before and after, and the after/before ratio.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def runs(half: Path) -> dict[tuple[str, str], dict]:
    """(run name, configuration label) -> that run's summary and roofline."""
    out = {}
    for f in sorted(half.glob("*/report.json")):
        rep = json.loads(f.read_text())
        for r in rep.get("runs", [rep]):
            label = r["label"] if "runs" in rep and r["label"] != "base" else "default"
            out[(f.parent.name, label)] = {"summary": r["summary"], "roofline": r.get("roofline")}
    return out


def cells(r: dict) -> list[str]:
    s, roof = r["summary"], r["roofline"]
    share = f"{roof['fraction_of_roofline'] * 100:.1f} %" if roof else "-"
    return [f"{s['output_tok_s']:.1f}", f"{s['tpot_s']['p50'] * 1e3:.0f}", f"{s['ttft_s']['p50']:.2f}", share]


def commit_md(text: str) -> str:
    """A half's commit file as Markdown: the hash in backticks, then what before_after.sh noted
    beside it (the first uncommitted change, `dirty: ...`), in parentheses."""
    first, *rest = text.splitlines() or ["?"]
    return f"`{first}`" + (f" ({'; '.join(r.strip() for r in rest)})" if rest else "")


def quant_ratios(before: dict, after: dict) -> dict[tuple[str, str], tuple[str, str]]:
    """(run, quant label) -> its output tok/s over the same run's bf16 default, before and after."""
    def ratio(half, run, label):
        if (run, label) not in half or (run, "default") not in half:
            return "-"
        return f"{half[(run, label)]['summary']['output_tok_s'] / half[(run, 'default')]['summary']['output_tok_s']:.2f}x"
    labels = {k for k in set(before) | set(after) if k[1].startswith("quant=")}
    return {k: (ratio(before, *k), ratio(after, *k)) for k in sorted(labels)}


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    before, after = runs(out / "before"), runs(out / "after")
    commits = {h: (out / h / "commit").read_text().strip() if (out / h / "commit").exists() else "?"
               for h in ("before", "after")}
    lines = [f"# Before and after, side by side\n\n- before: {commit_md(commits['before'])}\n"
             f"- after: {commit_md(commits['after'])}\n"
             "- made by `bash benchmarks/before_after.sh REF OUT` then `python -m benchmarks.before_after_table OUT`;"
             " both halves in one session on one machine\n",
             "| run | configuration | output tok/s before | after | x | TPOT p50 ms before | after | TTFT p50 s before |"
             " after | roofline before | after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    table = []
    for key in sorted(set(before) & set(after)):
        b, a = cells(before[key]), cells(after[key])
        ratio = after[key]["summary"]["output_tok_s"] / max(before[key]["summary"]["output_tok_s"], 1e-9)
        lines.append(f"| {key[0]} | {key[1]} | {b[0]} | {a[0]} | {ratio:.2f} | {b[1]} | {a[1]} | {b[2]} | {a[2]} | "
                     f"{b[3]} | {a[3]} |")
        table.append({"run": key[0], "configuration": key[1], "before": before[key], "after": after[key],
                      "output_tok_s_ratio": ratio})
    extra = sorted(set(after) - set(before))
    if extra:
        lines += ["\n## This tree only (configurations the earlier tree lacks), same session\n",
                  "| run | configuration | output tok/s | TPOT p50 ms | TTFT p50 s | roofline |", "|---|---|---|---|---|---|"]
        lines += [f"| {run} | {label} | " + " | ".join(cells(after[(run, label)])) + " |" for run, label in extra]
        table += [{"run": run, "configuration": label, "after": after[(run, label)]} for run, label in extra]
    quant = quant_ratios(before, after)
    if quant:
        lines += ["\n## Quantized against bf16, within each half\n", "| run | configuration | before | after |",
                  "|---|---|---|---|"]
        lines += [f"| {run} | {label} / bf16 | {b} | {a} |" for (run, label), (b, a) in quant.items()
                  if (b, a) != ("-", "-")]  # a run with no bf16 default to divide by
    lines += ["\nStep profiles: [before](before/profile-step/report.md), [after](after/profile-step/report.md)."]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps({"commits": commits, "rows": table,
                                                  "quant_over_bf16": {f"{k[0]}/{k[1]}": v for k, v in quant.items()}},
                                                 indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
