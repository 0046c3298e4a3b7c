"""`parallel.router=prefix`: the PrefixAffinity policy plugged into Ray Serve's request-router API.

Ray Serve asks `choose_replicas` for ranked groups of replicas and sends the request to the
first group's least-loaded replica that has room, falling to the next group when all are full
or do not answer its queue-length probe in time (0.1 s at first, doubling each try). A busy
engine can miss that first deadline, so while the prefix holder is not too loaded it is offered
alone for the first HOLDER_TRIES tries; only then do the other replicas follow it. No FIFOMixin:
the replica chosen for a request must serve that request, not the oldest one waiting.
Each ingress replica holds its own router (Ray builds one per deployment handle), so with one
ingress the index sees every request. Ray's own PrefixCacheAffinityRouter needs `ray[llm]`
(pyarrow, vLLM's stack); this one needs only `ray[serve]`.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from core.replicas.prefix_affinity import PrefixAffinity, ranked

HOLDER_TRIES = 3


def request_key(pending: PendingRequest | None) -> str:
    """The routing key the ingress put on the request (a RoutedRequest's `prompt`)."""
    if pending is None or not pending.args:
        return ""
    return getattr(pending.args[0], "prompt", "") or ""


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, block_chars: int = 256, max_imbalance: int = 4, capacity: int = 100_000) -> None:
        self.policy = PrefixAffinity(block_chars, max_imbalance, capacity)

    def _load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        key, load = request_key(pending_request), {rid: self._load(r) for rid, r in by_id.items()}
        holder, by_load = self.policy.choose(key, load)
        if pending_request is None:
            return [[by_id[rid]] for rid in ranked(holder, by_load)]
        ctx = pending_request.routing_context
        ctx.should_backoff = True  # back off (and wait longer for probes) between tries
        ctx.servelab_tries = getattr(ctx, "servelab_tries", 0) + 1  # the context is this request's own
        if holder is not None and ctx.servelab_tries <= HOLDER_TRIES:
            return [[by_id[holder]]]
        order = ranked(holder, by_load)
        if ctx.servelab_tries == 1:  # claim the prefix now: requests sharing it that are routed while this
            self.policy.record(key, order[0])  # one waits for its probe must follow it, not split
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.policy.record(request_key(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        policy = getattr(self, "policy", None)  # Ray may list replicas before initialize_state
        for rid in gone if policy is not None else ():
            policy.forget(rid)
