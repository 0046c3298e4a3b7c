"""benchmarks/before_after_table.py: the merged before/after table from two halves' reports."""

import json

from benchmarks import before_after_table


def summary(tok_s: float, tpot: float, ttft: float) -> dict:
    return {"output_tok_s": tok_s, "tpot_s": {"p50": tpot}, "ttft_s": {"p50": ttft}}


def write(half, run, report) -> None:
    (half / run).mkdir(parents=True)
    (half / run / "report.json").write_text(json.dumps(report))


def test_table_ratios_commits_and_quant_rows(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    roof = {"fraction_of_roofline": 0.25}
    # a single run (one report) and a comparison (runs with labels, "base" being the default)
    write(before, "decode_heavy", {"summary": summary(200.0, 0.3, 70.0), "roofline": roof})
    write(after, "decode_heavy", {"summary": summary(500.0, 0.12, 35.0), "roofline": None})
    write(before, "chat", {"runs": [{"label": "base", "summary": summary(50.0, 1.0, 30.0), "roofline": roof},
                                    {"label": "quant=int8", "summary": summary(35.0, 1.5, 60.0), "roofline": roof}]})
    write(after, "chat", {"runs": [{"label": "base", "summary": summary(100.0, 0.15, 30.0), "roofline": roof},
                                   {"label": "quant=int8", "summary": summary(90.0, 0.2, 31.0), "roofline": roof}]})
    # this tree only, with no bf16 default in its run: no quant ratio row for it
    write(after, "batch1-extra", {"runs": [{"label": "quant=gguf x=1", "summary": summary(80.0, 0.01, 0.1),
                                            "roofline": roof}]})
    (before / "commit").write_text("aaaa\n")
    (after / "commit").write_text("bbbb\ndirty:  M benchmarks/slo_capacity.sh\n")

    assert before_after_table.main([str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "- before: `aaaa`\n" in md
    assert "- after: `bbbb` (dirty:  M benchmarks/slo_capacity.sh)\n" in md
    assert "| decode_heavy | default | 200.0 | 500.0 | 2.50 | 300 | 120 | 70.00 | 35.00 | 25.0 % | - |" in md
    assert "| chat | quant=int8 | 35.0 | 90.0 | 2.57 |" in md
    assert "| chat | quant=int8 / bf16 | 0.70x | 0.90x |" in md
    assert "| batch1-extra | quant=gguf x=1 | 80.0 | 10 | 0.10 | 25.0 % |" in md
    assert "/ bf16 | - | - |" not in md
    rep = json.loads((tmp_path / "report.json").read_text())
    ratios = {(r["run"], r["configuration"]): r.get("output_tok_s_ratio") for r in rep["rows"]}
    assert abs(ratios[("decode_heavy", "default")] - 2.5) < 1e-12
    assert abs(ratios[("chat", "default")] - 2.0) < 1e-12
    assert ratios[("batch1-extra", "quant=gguf x=1")] is None
