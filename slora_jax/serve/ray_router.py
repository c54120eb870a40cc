"""Ray Serve request router for slora replicas: send a request to a replica that already holds its adapter.

A replica holds an adapter when the adapter is in its device pool (costs nothing) or its host tier (costs a pool copy);
anywhere else it costs a read from the source first (a cold load). Each replica reports its residency through
``record_routing_stats`` (``SloraReplica``: ``device`` and ``host`` adapter names, from ``Engine.adapter_states``),
which Ray hands to every router with the replica list. Those reports are up to a period old, so the router also
remembers where it sent each adapter lately: the replica it chose will hold it by the time the next request comes.

Order for a request with an adapter (``multiplexed_model_id``): replicas with it on the device, then in host memory
(or in Ray's multiplexed model ids, or chosen for it lately), then the least loaded replicas, then any. A holder
carrying ``imbalance`` more requests than the least loaded replica drops to the last rank, so a popular adapter cannot
pile its traffic on one replica. Load is what this router has in flight on each replica. Within a rank Ray picks the
replica with the shortest queue that still has room (``max_ongoing_requests``).

Two other modes, chosen per request with the ``routing`` keyword of the call, exist to measure this one against:
``multiplex`` (Ray's own: multiplexed model ids, then power of two choices) and ``random``.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

MODES = ("affinity", "multiplex", "random")
DEFAULT_IMBALANCE = 8  # requests in flight by which a holder may exceed the least loaded replica
DEFAULT_MEMORY_S = 10.0  # how long a choice counts as residency (residency reports come every stats period)


class AdapterAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, memory_s: float = DEFAULT_MEMORY_S, **_) -> None:
        self.imbalance = imbalance
        self.memory_s = memory_s
        self.in_flight: dict = defaultdict(int)  # replica id -> requests this router has on it
        self.routed_to: dict = {}  # internal request id -> replica id (to count completions)
        self.recent: dict[str, dict] = defaultdict(dict)  # adapter -> {replica id: when this router sent it there}
        self._tiers: dict = {}  # replica id -> (stats dict it came from, device names, host names)

    # ---------------------------------------------------------------- what each replica holds
    def tiers(self, replica: RunningReplica) -> tuple[frozenset, frozenset]:
        """(device, host) adapter names of the replica's latest residency report (cached per report)."""
        stats = replica.routing_stats or {}
        cached = self._tiers.get(replica.replica_id)
        if cached is None or cached[0] is not stats:
            cached = (stats, frozenset(stats.get("device", ())), frozenset(stats.get("host", ())))
            self._tiers[replica.replica_id] = cached
        return cached[1], cached[2]

    def chosen_lately(self, adapter: str) -> set:
        now, sent = time.monotonic(), self.recent.get(adapter, {})
        for rid in [rid for rid, t in sent.items() if now - t > self.memory_s]:
            del sent[rid]
        return set(sent)

    def load(self, replica: RunningReplica) -> int:
        return self.in_flight.get(replica.replica_id, 0)

    # ---------------------------------------------------------------- choosing
    def affinity_ranks(self, replicas: list[RunningReplica], adapter: str) -> list[list[RunningReplica]]:
        least = min(self.load(r) for r in replicas)
        lightest = [r for r in replicas if self.load(r) == least]
        random.shuffle(lightest)  # Ray takes the first of equally short queues: spread ties
        if not adapter:
            return [lightest, replicas]
        lately = self.chosen_lately(adapter)
        device, host, spill = [], [], []
        for r in replicas:
            on_device, in_host = self.tiers(r)
            if adapter in on_device:
                rank = device
            elif adapter in in_host or adapter in r.multiplexed_model_ids or r.replica_id in lately:
                rank = host
            else:
                continue
            (rank if self.load(r) <= least + self.imbalance else spill).append(r)
        return [rank for rank in (device, host, lightest, spill, replicas) if rank]

    def multiplex_ranks(self, pending: PendingRequest | None, replicas: list[RunningReplica]):
        """Ray's default: replicas with the multiplexed model id (then those with the fewest), two at random."""
        by_id = {r.replica_id: r for r in replicas}
        ids = self.apply_multiplex_routing(pending) if pending is not None else set(by_id)
        chosen = [by_id[i] for i in ids if i in by_id]
        return [random.sample(chosen, min(2, len(chosen)))] if chosen else []

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        mode, adapter = "affinity", ""
        if pending_request is not None:
            mode = pending_request.kwargs.get("routing") or mode
            adapter = pending_request.metadata.multiplexed_model_id or ""
        if mode == "random":
            return [[random.choice(candidate_replicas)]]
        if mode == "multiplex" and adapter:
            return self.multiplex_ranks(pending_request, candidate_replicas)
        return self.affinity_ranks(candidate_replicas, adapter)

    # ---------------------------------------------------------------- bookkeeping
    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        meta = pending_request.metadata
        self.in_flight[replica_id] += 1
        self.routed_to[meta.internal_request_id] = replica_id
        if meta.multiplexed_model_id:
            self.recent[meta.multiplexed_model_id][replica_id] = time.monotonic()

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        if self.routed_to.pop(internal_request_id, None) is not None and self.in_flight[replica_id] > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
        self._tiers.pop(replica_id, None)
        for sent in self.recent.values():
            sent.pop(replica_id, None)
