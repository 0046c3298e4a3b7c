"""Prometheus metrics under the `servelab:` prefix, named after vLLM's, every series labelled with
`model_name`. Counters and histograms are fed by one observer per engine (filtered by the
engine's name, so one engine's steps never count for another); gauges are read live at scrape
time, so an idle server never shows a request that already left."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.engine.registry import hookimpl

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(f"servelab:{name}", doc, label, buckets=buckets, registry=r)

        def gauge(name, doc):
            return Gauge(f"servelab:{name}", doc, label, registry=r)

        def counter(name, doc, extra=()):
            return Counter(f"servelab:{name}", doc, label + list(extra), registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens", TOKEN_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1)", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = hist("request_queue_time_seconds", "Time waiting before the first schedule")
        self.prefill = hist("request_prefill_time_seconds", "Time from first schedule to the end of prefill")
        self.decode = hist("request_decode_time_seconds", "Time from the first to the last output token")
        self.running = gauge("num_requests_running", "Sequences running")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting (preempted included)")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)")
        self.kv_free_blocks = gauge("kv_cache_free_blocks", "Free KV blocks")
        self.kv_total_blocks = gauge("kv_cache_total_blocks", "KV blocks in the pool")
        self.degraded = gauge("degraded", "1 while the degradation switch is on")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.preemptions = counter("num_preemptions", "Sequences preempted")
        self.success = counter("request_success", "Finished requests (abort included)", ["finished_reason"])
        self.rejected = counter("request_rejected", "Requests refused", ["reason"])
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifies (a sequence's drafts checked)")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_accepted_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in their run", ["position"])
        self.fallback = counter("requests_routed_to_fallback", "Requests served by the fallback model while degraded")

    def reject(self, model_name: str, reason: str) -> None:
        self.rejected.labels(model_name, reason).inc()

    def set_live(self, model_name: str, num_running: int, num_waiting: int, stats) -> None:
        """The gauges, from the engine as it is now (called at every scrape)."""
        self.running.labels(model_name).set(num_running)
        self.waiting.labels(model_name).set(num_waiting)
        self.kv_usage.labels(model_name).set(stats.usage)
        self.kv_free_blocks.labels(model_name).set(stats.num_free_blocks)
        self.kv_total_blocks.labels(model_name).set(stats.num_blocks)

    def observer(self, model_name: str) -> EngineObserver:
        return EngineObserver(self, model_name)


class EngineObserver:
    """The observer plugin of one engine: register it on the plugin manager."""

    def __init__(self, metrics: ServerMetrics, model_name: str) -> None:
        self.m, self.name = metrics, model_name
        self._last_queries = self._last_hits = 0

    @hookimpl
    def servelab_step_finished(self, step_stats):
        if step_stats.engine != self.name:
            return
        m, name = self.m, self.name
        m.preemptions.labels(name).inc(step_stats.num_preempted)
        if step_stats.num_drafts:
            m.spec_drafts.labels(name).inc(step_stats.num_drafts)
            m.spec_draft_tokens.labels(name).inc(step_stats.num_draft_tokens)
            m.spec_accepted.labels(name).inc(step_stats.num_accepted_tokens)
            for pos, n in enumerate(step_stats.accepted_per_pos):
                m.spec_accepted_pos.labels(name, str(pos)).inc(n)
        # the allocator's counters are cumulative: add what this step added
        m.prefix_queries.labels(name).inc(max(0, step_stats.prefix_queries - self._last_queries))
        m.prefix_hits.labels(name).inc(max(0, step_stats.prefix_hits - self._last_hits))
        self._last_queries, self._last_hits = step_stats.prefix_queries, step_stats.prefix_hits

    @hookimpl
    def servelab_request_finished(self, request_id, sequences, records, engine):
        if engine != self.name:
            return
        m, name = self.m, self.name
        for seq, rec in zip(sequences, records):
            r = rec.to_dict()
            m.success.labels(name, r["finish_reason"] or "abort").inc()
            m.generation_tokens.labels(name).inc(r["num_output_tokens"])
            if seq.index == 0:
                m.prompt_tokens.labels(name).inc(r["num_prompt_tokens"])
            for hist, key in ((m.ttft, "ttft_s"), (m.e2e, "e2e_s"), (m.queue, "queue_s"), (m.prefill, "prefill_s"),
                              (m.tpot, "tpot_s")):
                if r.get(key) is not None:
                    hist.labels(name).observe(r[key])
            for gap in r.get("itl_s") or []:
                m.itl.labels(name).observe(gap)
            times = seq.timings.token_times
            if len(times) > 1:
                m.decode.labels(name).observe(times[-1] - times[0])
