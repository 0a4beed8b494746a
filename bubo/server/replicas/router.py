"""Bubo's request router on Ray Serve's request-router API: the ranking of bubo/server/replicas/
affinity.py, over the replicas Ray's locality offers (this node's first), and the prefix index kept up
to date as requests are routed and replicas die."""

from ray.serve.request_router import (
    LocalityMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from bubo.server.replicas.affinity import PrefixIndex, ranks
from bubo.server.replicas.forwarding import Forwarded

__all__ = ["PrefixAffinityRouter"]


def _forwarded(pending_request: PendingRequest | None) -> Forwarded | None:
    if pending_request is None:
        return None
    return next((arg for arg in pending_request.args if isinstance(arg, Forwarded)), None)


class PrefixAffinityRouter(LocalityMixin, RequestRouter):
    """Without Ray's FIFO mixin, so that the replica chosen for a request is the one it gets.

    Ray takes, in the first rank with a replica that accepts the request (below its
    max_ongoing_requests), the one with the fewest requests in flight: a request whose prompt prefix a
    replica holds goes there unless it is full, any other to the least loaded replica."""

    def initialize_state(self, capacity: int = 200_000) -> None:
        self._index = PrefixIndex(capacity)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        # Ray's locality: replicas on this node first, all of them after. It also sets whether Ray backs
        # off before asking again, which it never does for a router that skips it.
        near = self.apply_locality_routing(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas if r.replica_id in near}
        ranked = ranks(list(by_id), _forwarded(pending_request), self._index)
        return [[by_id[replica] for replica in rank] for rank in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: object
    ) -> None:
        forwarded = _forwarded(pending_request)
        if forwarded is not None and forwarded.prompt:
            self._index.record(PrefixIndex.keys(forwarded.prompt), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.unique_id)
