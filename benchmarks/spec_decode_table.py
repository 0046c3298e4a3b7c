"""One table from benchmarks/spec_decode.sh's comparisons: `python -m benchmarks.spec_decode_table OUT_DIR`.

Reads OUT_DIR/<run>/report.json (each a `compare` whose first variant is plain decoding) and
writes OUT_DIR/report.md and report.json: per comparison and variant, output tok/s, TPOT p50,
the speed-up over plain decoding in the same run, the acceptance rate and the mean accepted
length (tokens a verify emits); then the speed-up of always-on prompt lookup by concurrency.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def rows(out: Path) -> list[dict]:
    table = []
    def order(f: Path):  # batch 1 first, then the concurrency sweep by its number
        m = re.match(r"concurrency-(\d+)-", f.parent.name)
        return (1, int(m.group(1))) if m else (0, f.parent.name)

    for f in sorted(out.glob("*/report.json"), key=order):
        rep = json.loads(f.read_text())
        runs = rep.get("runs") or []
        if not runs:
            continue
        base = runs[0]["summary"]
        for r in runs:
            s = r["summary"]
            sd = s.get("spec_decode") or {}
            table.append({
                "run": f.parent.name, "variant": r["label"], "output_tok_s": s["output_tok_s"],
                "tpot_p50_s": s["tpot_s"].get("p50"), "speedup": s["output_tok_s"] / base["output_tok_s"],
                "acceptance_rate": sd.get("acceptance_rate"), "mean_accepted_length": sd.get("mean_accepted_length"),
                "draft_tokens": sd.get("num_draft_tokens", 0),
            })
    return table


def main(argv=None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    table = rows(out)
    pct = lambda x: "-" if x is None else f"{x * 100:.1f} %"  # noqa: E731
    lines = ["# Speculative decoding on the embedded model\n",
             "- made by `bash benchmarks/spec_decode.sh` (each comparison in one `python -m core compare` run, "
             "plain decoding first) then `python -m benchmarks.spec_decode_table OUT`\n",
             "| comparison | variant | output tok/s | TPOT p50 ms | x plain | acceptance | mean accepted length |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        tpot = f"{r['tpot_p50_s'] * 1e3:.0f}" if r["tpot_p50_s"] is not None else "-"
        length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        lines.append(f"| {r['run']} | {r['variant']} | {r['output_tok_s']:.1f} | {tpot} | {r['speedup']:.2f} | "
                     f"{pct(r['acceptance_rate'])} | {length} |")
    sweep = {}
    for r in table:
        m = re.match(r"concurrency-(\d+)-", r["run"])
        if m and r["variant"] != "base":
            always = "disable_by_batch_size=0" in r["variant"]
            sweep.setdefault(int(m.group(1)), {})["always" if always else "default"] = r["speedup"]
    if sweep:
        lines += ["\n## Where speculation stops paying (code_edit, prompt lookup)\n",
                  "| running sequences | always on, x plain | default (off from 16 running), x plain |", "|---|---|---|"]
        lines += [f"| {n} | {v.get('always', float('nan')):.2f} | {v.get('default', float('nan')):.2f} |"
                  for n, v in sorted(sweep.items())]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps({"rows": table, "concurrency": sweep}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
