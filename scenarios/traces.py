"""Trace files: Azure LLM inference CSVs and Mooncake JSONL, read into rows and written back."""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

from core.errors import ConfigError


def detect_trace_format(path: Path) -> str:
    head = path.open().readline()
    if head.lstrip().startswith("{"):
        return "mooncake"
    if "ContextTokens" in head:
        return "azure"
    raise ConfigError(f"{path}: not an Azure CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a Mooncake JSONL")


def read_trace(path: Path, fmt: str = "auto") -> list[dict]:
    """Rows of {t (s, from 0), prompt, output, hash_ids} in time order."""
    if not path.exists():
        raise ConfigError(f"trace file {path} does not exist")
    fmt = detect_trace_format(path) if fmt == "auto" else fmt
    rows = []
    if fmt == "azure":
        for r in csv.DictReader(path.open()):
            t = datetime.fromisoformat(r["TIMESTAMP"].strip()[:26]).timestamp()
            rows.append({"t": t, "prompt": int(r["ContextTokens"]), "output": int(r["GeneratedTokens"]),
                         "hash_ids": None})
    elif fmt == "mooncake":
        for line in path.open():
            if line.strip():
                r = json.loads(line)
                rows.append({"t": r["timestamp"] / 1000.0, "prompt": r["input_length"], "output": r["output_length"],
                             "hash_ids": r.get("hash_ids")})
    else:
        raise ConfigError(f"workload.format must be auto, azure or mooncake, got '{fmt}'")
    rows.sort(key=lambda r: r["t"])
    t0 = rows[0]["t"] if rows else 0.0
    for r in rows:
        r["t"] -= t0
    return rows


def write_trace(path: Path, rows: list[dict], fmt: str) -> None:
    """The inverse of read_trace (for tests and for saving a generated workload)."""
    if fmt == "azure":
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
            for r in rows:
                w.writerow([datetime.fromtimestamp(1_700_000_000 + r["t"]).isoformat(sep=" "), r["prompt"], r["output"]])
    else:
        with path.open("w") as f:
            for r in rows:
                f.write(json.dumps({"timestamp": int(round(r["t"] * 1000)), "input_length": r["prompt"],
                                    "output_length": r["output"], "hash_ids": r["hash_ids"] or []}) + "\n")
