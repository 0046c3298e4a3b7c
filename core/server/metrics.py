"""Prometheus metrics under the `servelab:` prefix, named after vLLM's, fed by the observer hooks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.engine.registry import hookimpl

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    """An observer plugin: register it on the engine's plugin manager."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.model_name = model_name

        def hist(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(f"servelab:{name}", doc, label, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens", TOKEN_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1)", TOKEN_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency")
        self.queue = hist("request_queue_time_seconds", "Time waiting before the first schedule")
        self.prefill = hist("request_prefill_time_seconds", "Time from first schedule to the end of prefill")
        self.decode = hist("request_decode_time_seconds", "Time from the first to the last output token")
        self.running = Gauge("servelab:num_requests_running", "Sequences running", label, registry=r)
        self.waiting = Gauge("servelab:num_requests_waiting", "Sequences waiting (preempted included)", label, registry=r)
        self.kv_usage = Gauge("servelab:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", label, registry=r)
        self.kv_free_blocks = Gauge("servelab:kv_cache_free_blocks", "Free KV blocks", label, registry=r)
        self.kv_total_blocks = Gauge("servelab:kv_cache_total_blocks", "KV blocks in the pool", label, registry=r)
        self.degraded = Gauge("servelab:degraded", "1 while the degradation switch is on", label, registry=r)
        self.prefix_queries = Counter("servelab:prefix_cache_queries", "Prompt tokens looked up", label, registry=r)
        self.prefix_hits = Counter("servelab:prefix_cache_hits", "Prompt tokens found in the prefix cache", label,
                                   registry=r)
        self.prompt_tokens = Counter("servelab:prompt_tokens", "Prompt tokens of finished requests", label, registry=r)
        self.generation_tokens = Counter("servelab:generation_tokens", "Generated tokens", label, registry=r)
        self.preemptions = Counter("servelab:num_preemptions", "Sequences preempted", label, registry=r)
        self.success = Counter("servelab:request_success", "Finished requests", label + ["finished_reason"], registry=r)
        self.rejected = Counter("servelab:request_rejected", "Requests refused", label + ["reason"], registry=r)
        self.fallback = Counter("servelab:requests_routed_to_fallback", "Requests served by the fallback model while "
                                "degraded", label, registry=r)
        self._last_queries = self._last_hits = 0

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def set_pool(self, stats) -> None:
        m = self.model_name
        self.kv_usage.labels(m).set(stats.usage)
        self.kv_free_blocks.labels(m).set(stats.num_free_blocks)
        self.kv_total_blocks.labels(m).set(stats.num_blocks)

    @hookimpl
    def servelab_step_finished(self, step_stats):
        m = self.model_name
        self.running.labels(m).set(step_stats.num_running)
        self.waiting.labels(m).set(step_stats.num_waiting)
        self.kv_usage.labels(m).set(step_stats.kv_usage)
        self.preemptions.labels(m).inc(step_stats.num_preempted)
        # the allocator's counters are cumulative: add what this step added
        self.prefix_queries.labels(m).inc(max(0, step_stats.prefix_queries - self._last_queries))
        self.prefix_hits.labels(m).inc(max(0, step_stats.prefix_hits - self._last_hits))
        self._last_queries, self._last_hits = step_stats.prefix_queries, step_stats.prefix_hits

    @hookimpl
    def servelab_request_finished(self, request_id, sequences, records):
        m = self.model_name
        for seq, rec in zip(sequences, records):
            r = rec.to_dict()
            self.success.labels(m, r["finish_reason"] or "abort").inc()
            self.generation_tokens.labels(m).inc(r["num_output_tokens"])
            if seq.index == 0:
                self.prompt_tokens.labels(m).inc(r["num_prompt_tokens"])
            for hist, key in ((self.ttft, "ttft_s"), (self.e2e, "e2e_s"), (self.queue, "queue_s"),
                              (self.prefill, "prefill_s"), (self.tpot, "tpot_s")):
                if r.get(key) is not None:
                    hist.labels(m).observe(r[key])
            for gap in r.get("itl_s") or []:
                self.itl.labels(m).observe(gap)
            times = seq.timings.token_times
            if len(times) > 1:
                self.decode.labels(m).observe(times[-1] - times[0])
