"""Ray Serve request router for slora replicas: send a request to a replica that already holds its adapter.

A replica holds an adapter when the adapter is in its device pool (costs nothing) or its host tier (costs a pool copy);
anywhere else it costs a read from the source first (a cold load). Each replica reports its residency through
``record_routing_stats`` (``SloraReplica``: ``device`` and ``host`` adapter names, from ``Engine.adapter_states``),
which Ray hands to every router with the replica list, and Ray's multiplexing tells it which adapters each replica
served lately (its multiplexed model ids, pushed within 0.1 s).

Order for a request with an adapter (``multiplexed_model_id``): replicas with it on the device, then those with it in
host memory or among their multiplexed model ids, then the replica this router sent it to last (residency reports lag
by up to a stats period), then every replica. Within a rank Ray takes the replica with the shortest queue that still
has room (``max_ongoing_requests``), so a holder that is full passes its adapter's requests on; a request without an
adapter goes to the shortest queue.

Load is bounded before a replica is full: a holder that took more than ``1 + LOAD_SLACK`` times its fair share of
this router's last ``LOAD_WINDOW`` choices drops out of the holder ranks for hot adapters (``HOT`` or more of those
choices), and one over ``1 + COLD_SLACK`` times it for every adapter (a replica that joined late, after a restart or
at start-up, holds nothing: with many cold adapters all held elsewhere it would idle until the holder is full).
Their requests fall to the last rank, every replica, where Ray takes the shortest queue. Every rank is ordered by
recent load, least first, which is the order Ray keeps among equally short queues. The replica that takes
a hot adapter then holds it too: a hot adapter ends up on several replicas, moving the most load for one extra read;
a cold one stays where it is (moving it would cost a read and move almost no load). Without the bound, power-law
popularity pins the hottest adapter's share (a fifth of the traffic for 50 adapters) to wherever it first landed, and
one of two replicas served up to two thirds of a window at low concurrency.

Two other modes, chosen per request with the ``routing`` keyword of the call, exist to measure this one against:
``multiplex`` (Ray's own: multiplexed model ids, then power of two choices) and ``random``.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

MODES = ("affinity", "multiplex", "random")
DEFAULT_MEMORY_S = 2.0  # how long this router's last choice for an adapter stands in for a residency report
MAX_REMEMBERED = 10_000  # adapters remembered before the stale ones are forgotten
LOAD_WINDOW = 64  # this router's last choices that count as a replica's recent load
LOAD_SLACK = 0.25  # a holder may take this much over its fair share of the window before its adapters spill
HOT = 4  # an adapter with this many of the window's choices is hot: it spills from an overloaded holder
SWEEP_SLACK = 256  # model ids in Ray's pending index beyond twice the pending requests before it is swept
COLD_SLACK = 0.5  # a holder this far over its fair share spills every adapter, hot or not


class AdapterAffinityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    def initialize_state(self, memory_s: float = DEFAULT_MEMORY_S, **_) -> None:
        self.memory_s = memory_s
        self.last_sent: dict[str, tuple] = {}  # adapter -> (replica id, when this router last sent it there)
        self._tiers: dict = {}  # replica id -> (stats dict it came from, device names, host names)
        self.recent: deque = deque(maxlen=LOAD_WINDOW)  # (replica id, adapter) of this router's last choices

    # ---------------------------------------------------------------- what each replica holds
    def tiers(self, replica: RunningReplica) -> tuple[frozenset, frozenset]:
        """(device, host) adapter names of the replica's latest residency report (cached per report)."""
        stats = replica.routing_stats or {}
        cached = self._tiers.get(replica.replica_id)
        if cached is None or cached[0] is not stats:
            cached = (stats, frozenset(stats.get("device", ())), frozenset(stats.get("host", ())))
            self._tiers[replica.replica_id] = cached
        return cached[1], cached[2]

    # ---------------------------------------------------------------- choosing
    def overloaded(self, replicas: list[RunningReplica], counts: Counter, slack: float = LOAD_SLACK) -> set:
        """Ids of replicas that took more than (1 + slack) times a fair share of the recent choices that went to the
        replicas here now (choices for replicas gone since do not count), once there are a window's worth."""
        seen = sum(counts[r.replica_id] for r in replicas)
        if seen < LOAD_WINDOW or len(replicas) < 2:
            return set()
        cap = (1 + slack) * seen / len(replicas)
        return {r.replica_id for r in replicas if counts[r.replica_id] > cap}

    def affinity_ranks(self, replicas: list[RunningReplica], adapter: str) -> list[list[RunningReplica]]:
        counts = Counter(replica_id for replica_id, _ in self.recent)
        shuffled = random.sample(replicas, len(replicas))  # equal loads: spread ties at random
        anyone = sorted(shuffled, key=lambda r: counts[r.replica_id])  # stable sort: least loaded first
        if not adapter:
            return [anyone]
        device, host, last = [], [], []
        sent_to, sent_at = self.last_sent.get(adapter, (None, 0.0))
        recent = time.monotonic() - sent_at <= self.memory_s
        hot = sum(a == adapter for _, a in self.recent) >= HOT
        busy = self.overloaded(replicas, counts, LOAD_SLACK if hot else COLD_SLACK)
        for r in anyone:  # least loaded first in every rank: equal queues go to the less busy holder
            if r.replica_id in busy:
                continue
            on_device, in_host = self.tiers(r)
            if adapter in on_device:
                device.append(r)
            elif adapter in in_host or adapter in r.multiplexed_model_ids:
                host.append(r)
            elif recent and r.replica_id == sent_to:
                last.append(r)
        return [rank for rank in (device, host, last, anyone) if rank]

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
        adapter, now = pending_request.metadata.multiplexed_model_id, time.monotonic()
        self.recent.append((replica_id, adapter or ""))
        if adapter:
            self.last_sent[adapter] = (replica_id, now)
            if len(self.last_sent) > MAX_REMEMBERED:  # names clients made up must not pile up
                self.last_sent = {a: v for a, v in self.last_sent.items() if now - v[1] <= self.memory_s}
            self.forget_routed(adapter)

    def forget_routed(self, adapter: str) -> None:
        """Drop routed requests from Ray's index of pending requests by model id. Ray (2.60) empties a model id's
        entry only when that id is routed again, so every name a client sent once kept one routed request, its body
        included (up to --max-body-bytes), in the ingress for good: random model names leaked memory without bound.
        Requests cancelled while queued never reach here; a sweep drops those once the index outgrows the queue."""
        index = getattr(self, "_pending_requests_by_model_id", None)
        if index is None:
            return
        queue = index.get(adapter)
        while queue and queue[0].future.done():
            queue.popleft()
        if queue is not None and not queue:
            del index[adapter]
        if len(index) > 2 * len(getattr(self, "_pending_requests_by_id", ())) + SWEEP_SLACK:
            for name in [name for name, q in index.items() if all(p.future.done() for p in q)]:
                del index[name]

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._tiers.pop(replica_id, None)
