"""`python -m core disagg`: prefill/decode disaggregation against colocated replicas, simulated.

The same devices (disagg.instances engines of backend=simulator, each possibly tensor-parallel)
serve the same Poisson load two ways:

- **colocated**: every instance runs both phases, with chunked prefill beside decodes as vLLM does
  by default, or with whole prompts (disagg.colocated: chunked, whole); a request goes to the
  instance with the fewest outstanding requests;
- **disaggregated** (DistServe, Mooncake, vLLM's P/D connectors): P instances only prefill (a
  request with max_tokens=1), then the prompt's KV crosses the interconnect to one of the D
  decode instances (fewest outstanding), which loads it instead of computing it
  (SamplingParams.remote_prefill_tokens: the simulator charges loaded tokens nothing) and
  recomputes only the last prompt token to produce the first token the client sees, as vLLM's
  proxy does. Each prefill instance sends one transfer at a time over its link
  (latency + prompt x KV bytes per token / (bandwidth x tensor-parallel ranks)), so transfers queue.
  The prefill instance frees a request's KV when its token is out: memory held until the transfer
  ends is not modelled (it flatters the prefill pool a little under slow links).

All instances advance on their own virtual clocks in one discrete-event loop: the busy instance
furthest behind steps next, and an arrival or a finished transfer reaches its instance before any
step that ends after it, so no instance acts on the future. Per rate the report gives SLO
attainment, goodput, throughput and TTFT/TPOT percentiles for colocated and each P:D split, every
configuration's SLO capacity, and the break-even: the rate from which disaggregation's attainment
beats colocated's, and, with disagg.bandwidths, the transfer bandwidth below which it stops doing so.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field

from omegaconf import DictConfig

from core.bench.driver import Recorder, forced_length
from core.bench.summary import meets_slo, summarize
from core.config.schema import EngineConfig, section
from core.engine.engine import Engine
from core.engine.records import make_record
from core.errors import ConfigError, RequestError


@dataclass
class DisaggConfig:
    instances: int = 4  # engines (devices, or tensor-parallel groups) in all
    prefill_instances: list[int] = field(default_factory=lambda: [1, 2, 3])  # P of each P:D split tried
    rates: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 3.0])  # Poisson arrivals, req/s
    num_requests: int = 200
    transfer_gbs: float | None = None  # per rank and prefill instance; None: the profile's interconnect_gbs
    transfer_latency_s: float = 0.001  # per transfer: connection set-up, block-table exchange
    bandwidths: list[float] = field(default_factory=list)  # GB/s to sweep at bandwidth_rate (the break-even)
    bandwidth_rate: float | None = None  # None: the highest of `rates`
    tpot_targets: list[float] = field(default_factory=lambda: [0.01, 0.015, 0.02, 0.03, 0.05, 0.1])  # re-scored
    colocated: list[str] = field(default_factory=lambda: ["chunked", "whole"])  # the baselines (BASELINES)
    margin: float = 0.05  # a side wins when it leads by more than this share of the other's capacity or attainment
    attainment: float = 0.9  # SLO capacity: the highest rate with at least this share within both targets
    report_dir: str = "reports"
    name: str | None = None  # reports/<name>/; None: disagg-<model>-<hardware>-<workload>


# colocated baselines: the scheduler as configured (chunked prefill beside decodes), and whole
# prompts in one step (vLLM before chunked prefill, the baseline DistServe measured against)
BASELINES = {"chunked": "colocated", "whole": "colocated, whole prompts"}


def baseline_config(ec: EngineConfig, kind: str) -> EngineConfig:
    if kind == "chunked":
        return ec
    sc = ec.scheduler
    if not hasattr(sc, "enable_chunked_prefill"):
        raise ConfigError(f"disagg.colocated=whole needs a scheduler with enable_chunked_prefill, not '{sc.name}'")
    budget = max(sc.max_num_batched_tokens, ec.model.max_model_len)  # room for the longest prompt in one step
    return dataclasses.replace(ec, scheduler=dataclasses.replace(sc, enable_chunked_prefill=False,
                                                                 max_num_batched_tokens=budget))


def check(dc: DisaggConfig, ec: EngineConfig) -> None:
    if ec.backend.name != "simulator":
        raise ConfigError("disagg simulates its instances: add backend=simulator hardware=NAME")
    if dc.instances < 2:
        raise ConfigError(f"disagg.instances must be at least 2 (one prefill, one decode), got {dc.instances}")
    bad = [p for p in dc.prefill_instances if not 1 <= p < dc.instances]
    if bad or not dc.prefill_instances:
        raise ConfigError(f"disagg.prefill_instances must each be in [1, {dc.instances - 1}] (the rest decode), "
                          f"got {list(dc.prefill_instances)}")
    if not dc.rates or min(dc.rates) <= 0:
        raise ConfigError(f"disagg.rates must be positive request rates, got {list(dc.rates)}")
    if (dc.transfer_gbs is not None and dc.transfer_gbs <= 0) or any(b <= 0 for b in dc.bandwidths):
        raise ConfigError("disagg.transfer_gbs and disagg.bandwidths must be positive GB/s")
    if not dc.colocated or set(dc.colocated) - set(BASELINES):
        raise ConfigError(f"disagg.colocated must name baselines among {', '.join(BASELINES)}, got {list(dc.colocated)}")
    if any(t <= 0 for t in dc.tpot_targets) or not 0 <= dc.margin < 1:
        raise ConfigError(f"disagg.tpot_targets must be positive seconds and disagg.margin in [0, 1), got "
                          f"{list(dc.tpot_targets)} and {dc.margin}")
    if dc.transfer_latency_s < 0 or dc.num_requests < 1 or not 0 < dc.attainment <= 1:
        raise ConfigError("disagg.transfer_latency_s must be >= 0, num_requests >= 1, attainment in (0, 1]")


def decode_pool_config(ec: EngineConfig) -> EngineConfig:
    """A decode instance admits a loaded prompt in one step: its token budget counts computed
    tokens, and a loaded prompt computes one."""
    sc, big = ec.scheduler, ec.model.max_model_len + ec.scheduler.max_num_seqs
    changes = {"max_num_batched_tokens": big}
    for key, value in (("long_prefill_token_threshold", big), ("max_num_partial_prefills", sc.max_num_seqs),
                       ("max_long_partial_prefills", sc.max_num_seqs)):
        if hasattr(sc, key):
            changes[key] = value
    return dataclasses.replace(ec, scheduler=dataclasses.replace(sc, **changes))


class Instance:
    """One engine of the cluster and (prefill instances) its outbound link."""

    def __init__(self, ec: EngineConfig, role: str, loaded) -> None:
        self.engine, self.role = Engine(ec, loaded), role
        self.link_free = 0.0

    @property
    def clock(self) -> float:
        return self.engine.core.context.clock()

    @property
    def outstanding(self) -> int:
        return self.engine.scheduler.num_waiting + self.engine.scheduler.num_running

    def add(self, t: float, request_id: str, prompt: list[int], params) -> None:
        if not self.engine.has_unfinished() and self.clock < t:
            self.engine.core.context.sleep(t - self.clock)  # idle until the request arrives
        self.engine.add_request(prompt_token_ids=prompt, params=params, request_id=request_id, arrival_time=t)


@dataclass
class Cluster:
    """The instances of one configuration and the events between them."""

    prefill: list[Instance]  # colocated: every instance, each serving both phases
    decode: list[Instance]  # empty when colocated
    transfer_bps: float
    transfer_latency_s: float
    kv_bytes_per_token: int
    events: list = field(default_factory=list)
    order: itertools.count = field(default_factory=itertools.count)
    records: list[dict] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)
    pending: dict = field(default_factory=dict)  # request id -> (arrival, prefill record)
    # one observer for every instance (they share the plugin manager): only the instance that
    # just stepped can have finished anything, and request ids are unique per stage
    recorder: Recorder = field(default_factory=lambda: Recorder(0.0))  # virtual clocks start at 0

    def run(self, requests, slo: tuple[float, float], progress) -> None:
        self.requests = {str(r.index): r for r in requests}
        for r in requests:
            heapq.heappush(self.events, (r.arrival_s, next(self.order), "arrive", str(r.index)))
        instances = self.prefill + self.decode
        while self.events or any(x.engine.has_unfinished() for x in instances):
            busy = [x for x in instances if x.engine.has_unfinished()]
            nxt = min(busy, key=lambda x: x.clock) if busy else None
            if self.events and (nxt is None or self.events[0][0] <= nxt.clock):
                t, _, kind, rid = heapq.heappop(self.events)
                self.deliver(t, kind, rid, slo)
                continue
            seen = len(self.recorder.records)
            nxt.engine.step(outputs=False)
            for rec in self.recorder.records[seen:]:
                progress.update(self.finished(nxt, rec))

    def deliver(self, t: float, kind: str, rid: str, slo) -> None:
        r = self.requests[rid]
        try:
            if kind == "arrive":
                params = forced_length(1 if self.decode else r.output_len, slo)
                min(self.prefill, key=lambda x: x.outstanding).add(t, rid, r.prompt_token_ids, params)
                self.pending[rid] = (t, None)
            else:  # the prompt's KV has landed: decode, loading all but the last prompt token
                params = dataclasses.replace(forced_length(r.output_len, slo), remote_prefill_tokens=r.prompt_len - 1)
                min(self.decode, key=lambda x: x.outstanding).add(t, rid, r.prompt_token_ids, params)
        except RequestError as e:  # larger than an instance's whole KV pool: counted, not fatal
            self.rejected.append({"request_id": rid, "reason": str(e), "kind": "invalid"})
            self.pending.pop(rid, None)

    def finished(self, inst: Instance, rec: dict) -> int:
        """A sequence ended on `inst`: a prefill's KV starts across the link, or a request is done."""
        rid = rec["request_id"]
        arrival, pre = self.pending[rid]
        if self.decode and inst.role == "prefill":
            start = max(rec["finish_s"], inst.link_free)
            inst.link_free = start + self.transfer_latency_s + \
                rec["num_prompt_tokens"] * self.kv_bytes_per_token / self.transfer_bps
            self.pending[rid] = (arrival, rec | {"transfer_start_s": start, "transfer_end_s": inst.link_free})
            heapq.heappush(self.events, (inst.link_free, next(self.order), "transfer", rid))
            return 0
        self.records.append(stitch(arrival, pre, rec) if pre else rec)
        del self.pending[rid]
        return 1


def stitch(arrival: float, pre: dict, dec: dict) -> dict:
    """One record from a request's prefill and decode halves: the client's view, from its arrival
    at the prefill pool to the decode instance's last token."""
    first_scheduled = pre["arrival_s"] + (pre["queue_s"] or 0.0)
    r = make_record(dec["request_id"], arrival=arrival, token_times=dec["token_times_s"],
                    num_prompt_tokens=dec["num_prompt_tokens"], num_output_tokens=dec["num_output_tokens"],
                    finished=dec["finish_s"], first_scheduled=first_scheduled,
                    prefill_done=first_scheduled + (pre["prefill_s"] or 0.0),
                    num_preemptions=pre["num_preemptions"] + dec["num_preemptions"],
                    finish_reason=dec["finish_reason"]).to_dict()
    r["transfer_s"] = pre["transfer_end_s"] - pre["transfer_start_s"]
    r["transfer_wait_s"] = pre["transfer_start_s"] - pre["finish_s"]
    return r


def simulate(ec: EngineConfig, loaded, workload, num_prefill: int | None, instances: int, transfer_gbs: float,
             latency_s: float, slo: tuple[float, float], progress, tpot_targets: list[float] = ()) -> dict:
    """One configuration on one load: colocated when num_prefill is None; `loaded`: the model's shape
    and tokenizer (components.shape_only), shared by every instance. Returns the run's summary."""
    tp = ec.backend.tensor_parallel_size
    if num_prefill is None:
        prefill, decode = [Instance(ec, "both", loaded) for _ in range(instances)], []
    else:
        dec_ec = decode_pool_config(ec)
        prefill = [Instance(ec, "prefill", loaded) for _ in range(num_prefill)]
        decode = [Instance(dec_ec, "decode", loaded) for _ in range(instances - num_prefill)]
    cluster = Cluster(prefill, decode, transfer_gbs * 1e9 * tp, latency_s, prefill[0].engine.kv_spec.bytes_per_token)
    pm = prefill[0].engine.registry.pm
    pm.register(cluster.recorder)
    try:
        cluster.run(workload.requests, slo, progress)
    finally:
        pm.unregister(cluster.recorder)
    duration = max((r["finish_s"] for r in cluster.records), default=0.0)
    s = summarize(cluster.records, duration, None, *slo, num_rejected=len(cluster.rejected))
    transfers = [r["transfer_s"] for r in cluster.records if "transfer_s" in r]
    waits = [r["transfer_wait_s"] for r in cluster.records if "transfer_wait_s" in r]
    s["transfer_s"] = {"p50": float(_quantile(transfers, 0.5)), "p99": float(_quantile(transfers, 0.99)),
                       "wait_p99": float(_quantile(waits, 0.99))} if transfers else None
    pools = {"prefill": prefill, "decode": decode} if decode else {"both": prefill}
    s["busy_share"] = {role: sum(x.engine.backend.spent.total for x in pool) / len(pool) / max(duration, 1e-9)
                       for role, pool in pools.items()}  # the share of the run each pool's devices spent in steps
    n = len(cluster.records) + len(cluster.rejected)  # the same records, scored against tighter or looser TPOT
    s["attained_by_tpot"] = {t: sum(meets_slo(r, slo[0], t) for r in cluster.records) / n if n else 0.0
                             for t in tpot_targets}
    return s


def _quantile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.quantile(np.asarray(values), q)) if values else math.nan


def disagg_config(cfg: DictConfig) -> DisaggConfig:
    return section(DisaggConfig, cfg.get("disagg"), "disagg")
