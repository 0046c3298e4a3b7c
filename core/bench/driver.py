"""The offline driver: replay a workload's arrivals against the engine and record every request
and step through the observer hooks (the same door any exporter plugin uses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.config.schema import section
from core.engine.engine import Engine
from core.engine.records import sequence_record
from core.engine.registry import hookimpl
from core.engine.types import SamplingParams, StepStats
from core.errors import DeadlineError, RequestError
from scenarios.workloads import Workload, WorkloadConfig


def workload_config(cfg) -> WorkloadConfig:
    return section(WorkloadConfig, cfg.get("workload"), "workload")


@dataclass
class Recorder:
    """Observer plugin: every finished request's record and every step's stats, times relative to `start`."""

    start: float
    records: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)

    @hookimpl
    def servelab_request_finished(self, request_id, sequences, records):
        self.records += [sequence_record(seq, origin=self.start).to_dict() for seq in sequences]

    @hookimpl
    def servelab_step_finished(self, step_stats: StepStats):
        d = {k: v for k, v in step_stats.__dict__.items() if k != "time"}
        d["time_s"] = step_stats.time - self.start
        self.steps.append(d)


def slo_targets(wc: WorkloadConfig, rc) -> tuple[float, float]:
    """The (TTFT, TPOT) targets of a run: the workload's own, else the run's goodput SLOs."""
    return (wc.slo_ttft_s or rc.slo_ttft_s, wc.slo_tpot_s or rc.slo_tpot_s)


def forced_length(output_len: int, slo: tuple[float, float] | None = None) -> SamplingParams:
    # Output length is forced, as in vLLM's benchmarks: greedy, ignore EOS, exactly output_len tokens.
    ttft, tpot = slo or (None, None)
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, slo_ttft_s=ttft, slo_tpot_s=tpot)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False)


def drive_engine(engine: Engine, workload: Workload, progress: bool = True, slo: tuple[float, float] | None = None,
                 shed: bool = False):
    """Replay the workload's arrivals against the engine, each request carrying the `slo` targets
    (and refused at arrival when `shed` and it cannot make them); returns (records, steps,
    duration_s, rejected)."""
    pending = sorted(workload.requests, key=lambda r: r.arrival_s)
    clock, sleep = engine.core.context.clock, engine.core.context.sleep  # virtual under backend=simulator
    start = clock()
    recorder = Recorder(start)
    pm = engine.registry.pm
    pm.register(recorder)
    bar = progress_bar(len(pending), workload.config.name, progress)
    users = workload.config.concurrency if workload.config.arrival == "concurrent" else None  # a closed loop
    i = 0
    rejected: list[dict] = []
    try:
        while i < len(pending) or engine.has_unfinished():
            now = clock() - start
            while i < len(pending) and pending[i].arrival_s <= now and (
                    users is None or i - len(recorder.records) - len(rejected) < users):
                r = pending[i]
                i += 1
                try:
                    engine.add_request(prompt_token_ids=r.prompt_token_ids, params=forced_length(r.output_len, slo),
                                       request_id=f"{r.index}", shed=shed,
                                       arrival_time=start + r.arrival_s if users is None else clock())
                except RequestError as e:  # e.g. larger than the whole KV pool, or shed: counted, not fatal
                    rejected.append({"request_id": str(r.index), "reason": str(e),
                                     "kind": "deadline" if isinstance(e, DeadlineError) else "invalid"})
                    bar.update(1)
            if engine.has_unfinished():
                done_before = len(recorder.records)
                engine.step(outputs=False)
                bar.update(len(recorder.records) - done_before)
            elif i < len(pending):
                sleep(max(0.0, min(pending[i].arrival_s - now, 0.05)))
    finally:
        pm.unregister(recorder)
        bar.close()
    end = max((r["finish_s"] for r in recorder.records), default=0.0)
    return recorder.records, recorder.steps, end, rejected


def warm_up(engine: Engine, n: int) -> None:
    """Run a few small requests first so one-time costs (allocations, kernels) are not measured."""
    if n > 0:  # short enough for any max_model_len
        length = max(1, min(16, engine.max_model_len // 2))
        prompt = [engine.tokenizer.eos_token_id or 0] * length
        engine.generate([prompt] * n, SamplingParams(max_tokens=4, ignore_eos=True))
        # and a lone request: a batch-1 decode step has its own compiled graph (backend.compile)
        engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))
