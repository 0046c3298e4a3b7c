"""Derive the shipped length tables from the public traces (run once; the traces are not shipped).

    python -m scenarios.derive_tables --azure-dir PATH/azure2023 --mooncake-dir PATH/mooncake

Writes scenarios/data/{azure_conv_2023,azure_code_2023,mooncake_conversation}.json: quantiles of
prompt and output lengths (401 points, every 0.25 %), arrival-gap statistics, and the citation.
"""

from __future__ import annotations

import argparse
import csv
import json
from datetime import datetime
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "data"
PROBS = np.round(np.linspace(0.0, 1.0, 401), 4)

AZURE = {
    "source": "Azure LLM inference trace 2023 (Azure/AzurePublicDataset @ b469a113, data/AzureLLMInferenceTrace_{kind}.csv)",
    "citation": "Patel et al., Splitwise: Efficient Generative LLM Inference Using Phase Splitting, ISCA 2024",
    "licence": "CC-BY-4.0; only derived quantiles are shipped here",
}
MOONCAKE = {
    "source": "Mooncake conversation trace (kvcache-ai/Mooncake @ 3b5a5941, FAST25-release/traces/conversation_trace.jsonl)",
    "citation": "Qin et al., Mooncake: A KVCache-centric Disaggregated Architecture for LLM Serving, FAST 2025",
    "licence": "Apache-2.0; only derived quantiles are shipped here",
}


def _table(values: np.ndarray) -> dict:
    q = np.quantile(values, PROBS)
    return {
        "probs": PROBS.tolist(),
        "values": [round(float(v), 2) for v in q],
        "mean": round(float(values.mean()), 2),
        "p50": float(np.quantile(values, 0.5)),
        "p90": float(np.quantile(values, 0.9)),
        "p99": float(np.quantile(values, 0.99)),
        "max": float(values.max()),
    }


def _arrivals(t: np.ndarray) -> dict:
    gaps = np.diff(np.sort(t))
    return {"rate_per_s": round(float(len(t) / (t.max() - t.min())), 3),
            "gap_cv": round(float(gaps.std() / gaps.mean()), 3),
            "frac_gaps_under_1ms": round(float((gaps < 1e-3).mean()), 4)}


def derive_azure(path: Path, kind: str) -> dict:
    rows = list(csv.DictReader(open(path / f"AzureLLMInferenceTrace_{kind}.csv")))
    t = np.array([datetime.fromisoformat(r["TIMESTAMP"][:26]).timestamp() for r in rows])
    prompt = np.array([int(r["ContextTokens"]) for r in rows], dtype=float)
    output = np.array([int(r["GeneratedTokens"]) for r in rows], dtype=float)
    meta = {k: v.format(kind=kind) for k, v in AZURE.items()}
    return {**meta, "rows": len(rows), "prompt_tokens": _table(prompt), "output_tokens": _table(output),
            "arrivals": _arrivals(t), "prompt_output_corr": round(float(np.corrcoef(prompt, output)[0, 1]), 3)}


def derive_mooncake(path: Path) -> dict:
    rows = [json.loads(line) for line in open(path / "conversation_trace.jsonl")]
    t = np.array([r["timestamp"] / 1000.0 for r in rows])
    prompt = np.array([r["input_length"] for r in rows], dtype=float)
    output = np.array([r["output_length"] for r in rows], dtype=float)
    seen, hit, total = set(), 0, 0
    for r in rows:  # prefix reuse with an infinite cache, in arrival order
        for i, h in enumerate(r["hash_ids"]):
            block = min(512, r["input_length"] - 512 * i)
            total += block
            if h in seen:
                hit += block
            seen.add(h)
    return {**MOONCAKE, "rows": len(rows), "prompt_tokens": _table(prompt), "output_tokens": _table(output),
            "arrivals": _arrivals(t), "prefix_reuse_fraction": round(hit / total, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--azure-dir", type=Path, required=True)
    ap.add_argument("--mooncake-dir", type=Path, required=True)
    a = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    tables = {
        "azure_conv_2023": derive_azure(a.azure_dir, "conv"),
        "azure_code_2023": derive_azure(a.azure_dir, "code"),
        "mooncake_conversation": derive_mooncake(a.mooncake_dir),
    }
    for name, table in tables.items():
        (OUT / f"{name}.json").write_text(json.dumps(table, indent=1) + "\n")
        p, o = table["prompt_tokens"], table["output_tokens"]
        print(f"{name}: prompt mean {p['mean']:.0f} p50 {p['p50']:.0f} p99 {p['p99']:.0f}; "
              f"output mean {o['mean']:.0f} p50 {o['p50']:.0f} p99 {o['p99']:.0f}; arrivals {table['arrivals']}")


if __name__ == "__main__":
    main()
