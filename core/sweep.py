"""`python -m core.sweep -m OVERRIDES`: `run` as a Hydra application, so a multirun goes through
Hydra's launchers: the basic one (one job after another), joblib (parallel local processes:
`hydra/launcher=joblib`) or submitit (Slurm: `hydra/launcher=submitit_slurm`, or
`submitit_local`). Each job composes its overrides exactly as `python -m core run` would, runs,
and leaves its result in its own job directory; when the last one ends, a callback gathers them
into one comparison report (labelled by what the jobs swept), as `run -m` writes in-process.

    python -m core.sweep -m scheduler=static,continuous hydra/launcher=joblib hydra.launcher.n_jobs=1
    python -m core.sweep -m backend=simulator hardware=a100-80gb,h100-80gb model=llama-2-7b \\
        hydra/launcher=submitit_slurm hydra.launcher.partition=gpu hydra.launcher.timeout_min=60

Timed runs on one machine want one job at a time (`hydra.launcher.n_jobs=1`: parallel jobs share
its cores and corrupt each other's numbers); simulated runs and jobs on separate Slurm nodes do not.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

RESULT = "result.json"
log = logging.getLogger("servelab")


def swept_labels(override_lists: list[list[str]]) -> list[str]:
    """Each job's label: its overrides that not every job shares."""
    common = set.intersection(*(set(o) for o in override_lists)) if override_lists else set()
    return [" ".join(o for o in ovs if o not in common) or "base" for ovs in override_lists]


@hydra.main(config_path="pkg://conf", config_name="sweep", version_base=None)
def job(_: DictConfig) -> dict:
    from core.bench.run import run_one
    from core.config.compose import compose

    overrides = list(HydraConfig.get().overrides.task)
    out = Path(HydraConfig.get().runtime.output_dir)
    result = run_one(compose(overrides))  # the same composition (and checks) as `python -m core run`
    result["overrides"] = overrides
    (out / RESULT).write_text(json.dumps(result))
    s = result["summary"]
    log.info("%s: %.1f output tok/s, TTFT p50 %.3f s", " ".join(overrides), s["output_tok_s"], s["ttft_s"].get("p50", 0))
    return {"overrides": overrides, "output_tok_s": s["output_tok_s"]}


class CompareCallback(Callback):
    """After a multirun: every job's result -> one comparison report under run.report_dir."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from core.bench import report
        from core.config.compose import compose
        from core.config.schema import run_config

        sweep_dir = Path(config.hydra.sweep.dir)
        results = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob(f"*/{RESULT}"),
                                                              key=lambda p: int(p.parent.name))]
        if not results:
            log.warning("no job of %s left a result: no comparison report", sweep_dir)
            return
        for r, label in zip(results, swept_labels([r["overrides"] for r in results])):
            r["label"] = label
        rc = run_config(compose([o for o in results[0]["overrides"] if o.startswith("run.")]))
        name = rc.name or f"sweep-{sweep_dir.name}"
        out = report.write_comparison(results, name, rc)
        print(report.summary_table(results))
        print(f"report: {out / 'report.md'}")


if __name__ == "__main__":
    job()
