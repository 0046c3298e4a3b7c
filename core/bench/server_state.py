"""What `bench` reads from the server's own /metrics (per model, and per replica behind Ray Serve),
and the fault it can inject: `target.kill_replica_after_s` SIGKILLs one replica's process that
many seconds into the run, as an OOM kill would, to see Ray replace it and count what failed.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

SERIES = {"request_success_total": "requests", "generation_tokens_total": "generation_tokens",
          "prefix_cache_queries_total": "prefix_queries", "prefix_cache_hits_total": "prefix_hits"}
_LINE = re.compile(r"^(?:servelab|vllm):(" + "|".join(SERIES) + r")\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def scrape(url: str) -> str:
    import httpx

    try:
        return httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def parse(text: str) -> tuple[dict, dict]:
    """(per served model, per replica): finished requests, generated tokens, prefix-cache queries and
    hits. Totals are the series without a `replica` label (servelab's and vLLM's names alike)."""
    models: dict[str, dict] = {}
    replicas: dict[str, dict] = {}
    for name, labels, value in _LINE.findall(text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        where = replicas.setdefault(lab["replica"], {}) if "replica" in lab else \
            models.setdefault(lab.get("model_name", "?"), {})
        where[SERIES[name]] = where.get(SERIES[name], 0.0) + float(value)
    return models, replicas


def hit_rate(counts: dict) -> dict:
    q, h = counts.get("prefix_queries", 0.0), counts.get("prefix_hits", 0.0)
    return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0}


def difference(after: dict, before: dict) -> dict:
    return {m: {k: v - before.get(m, {}).get(k, 0.0) for k, v in c.items()} for m, c in after.items()}


def run_counts(before: str, after: str) -> tuple[dict, dict | None]:
    """What the server counted between two scrapes, per model, and the prefix-cache hit rate of all
    its models together (None if it reports no prefix-cache lookups)."""
    counted = difference(parse(after)[0], parse(before)[0])
    totals: dict[str, float] = {}
    for counts in counted.values():
        for k, v in counts.items():
            totals[k] = totals.get(k, 0.0) + v
    return counted, hit_rate(totals) if totals.get("prefix_queries") else None


def replicas_seen(at_start: dict, at_end: dict | None, after: str, killer: ReplicaKiller | None) -> dict:
    """The replicas over a run: who was there at its start and end, how many were ever started, what
    failed because a replica died, each replica's counts, and the kill if one was injected."""
    return {"router": at_start["router"], "at_start": [r["id"] for r in at_start["replicas"]],
            "at_end": [r["id"] for r in at_end["replicas"]] if at_end else [],
            "started": at_end["started"] if at_end else None, "failures": failures(after),
            "per_replica": {rid: {**c, **hit_rate(c)} for rid, c in parse(after)[1].items()},
            "kill": killer.outcome(at_end) if killer else None}


def failures(text: str) -> dict[str, float]:
    """Requests the ingress answered with an error because their replica died, by stage."""
    return {stage: float(v) for stage, v in
            re.findall(r'^servelab:replica_failures_total\{stage="(\w+)"\} ([0-9.e+-]+)$', text, re.M)}


def listing(url: str) -> dict | None:
    """The server's /v1/replicas (servelab on Ray Serve), or None for a server without replicas."""
    import httpx

    try:
        r = httpx.get(f"{url}/v1/replicas", timeout=10)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


class ReplicaKiller:
    """After `after_s`, SIGKILL the longest-serving replica listed by the server (its pid must be on
    this machine); `event` says what was killed and when (wall clock, as /v1/replicas' `since`)."""

    def __init__(self, url: str, after_s: float) -> None:
        self.url, self.event = url, {}
        self.timer = threading.Timer(after_s, self._kill)
        self.timer.daemon = True

    def start(self) -> ReplicaKiller:
        self.timer.start()
        return self

    def _kill(self) -> None:
        listed = listing(self.url)
        if not listed or not listed["replicas"]:
            self.event = {"error": "the server lists no replicas to kill"}
            return
        victim = listed["replicas"][0]
        if victim["node"] not in ("127.0.0.1", "localhost"):
            self.event = {"error": f"replica {victim['id']} runs on {victim['node']}, not this machine"}
            return
        os.kill(victim["pid"], signal.SIGKILL)
        self.event = {"replica": victim["id"], "pid": victim["pid"], "at": time.time()}

    def await_replacement(self, expected: int, timeout_s: float = 120.0) -> dict | None:
        """After the run: the listing once the server is back to `expected` replicas (Ray restarts
        the killed one), or the last listing when it is not within `timeout_s`."""
        end = time.monotonic() + timeout_s
        while True:
            listed = listing(self.url)
            if not self.event.get("at") or (listed and len(listed["replicas"]) >= expected) or time.monotonic() > end:
                return listed
            time.sleep(0.5)

    def outcome(self, after: dict | None) -> dict:
        """The kill and its replacement: the replica that appeared after it and how long that took."""
        self.timer.cancel()
        out = dict(self.event)
        if "at" in out and after:
            new = [r for r in after["replicas"] if r["since"] > out["at"]]
            out["replacement"] = new[0]["id"] if new else None
            out["replaced_after_s"] = new[0]["since"] - out["at"] if new else None
        return out
