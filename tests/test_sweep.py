"""`python -m core.sweep`: `run` as a Hydra application, swept through Hydra's launchers (joblib,
submitit), its jobs composing exactly as `run` does, gathered into one comparison report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from core.cli import main
from core.sweep import swept_labels

SIM = ["backend=simulator", "model=llama-2-7b", "workload=chat_longtail", "workload.num_requests=12",
       "run.warmup_requests=0", "run.progress=false", "run.plots=false"]


def test_a_jobs_label_is_what_it_swept():
    assert swept_labels([["a=1", "b=2"], ["a=1", "b=3"]]) == ["b=2", "b=3"]
    assert swept_labels([["a=1"], ["a=1"]]) == ["base", "base"]


@pytest.mark.parametrize("launcher", [["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]])
def test_a_launched_sweep_matches_run_and_writes_one_comparison(tmp_path, launcher):
    """Two simulated jobs through the launcher: each matches `python -m core run` with the same
    overrides (the simulator is deterministic), and the callback gathers both into one report."""
    out = tmp_path / "reports"
    r = subprocess.run([sys.executable, "-m", "core.sweep", "-m", *SIM, "hardware=a100-80gb,h100-80gb",
                        f"run.report_dir={out}", "run.name=sw", *launcher], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = {x["label"]: x for x in json.loads((out / "sw" / "report.json").read_text())["runs"]}
    assert set(runs) == {"hardware=a100-80gb", "hardware=h100-80gb"}
    for hw in ("a100-80gb", "h100-80gb"):
        assert main(["run", *SIM, f"hardware={hw}", f"run.report_dir={tmp_path / 'single'}", f"run.name={hw}"]) == 0
        single = json.loads((tmp_path / "single" / hw / "report.json").read_text())["summary"]
        assert runs[f"hardware={hw}"]["summary"]["output_tok_s"] == pytest.approx(single["output_tok_s"], rel=1e-9)
    assert runs["hardware=h100-80gb"]["summary"]["output_tok_s"] > runs["hardware=a100-80gb"]["summary"]["output_tok_s"]
    assert "hardware=a100-80gb" in (out / "sw" / "report.md").read_text()


def test_the_worked_slurm_launcher_composes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "core.sweep", "quant=int8", "hydra/launcher=slurm",
                        "hydra.launcher.partition=gpu", "--cfg", "hydra"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SlurmLauncher" in r.stdout and "partition: gpu" in r.stdout and "gpus_per_node: 1" in r.stdout
