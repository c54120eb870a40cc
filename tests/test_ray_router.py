"""The adapter-affinity router's ranking, without a cluster: holders first, and the load bound that spills a hot
adapter from a holder that took too much of the recent traffic (the balance tests/test_ray_serve.py measures end to
end)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest

pytest.importorskip("ray.serve.request_router")
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402

from slora_jax.serve.ray_router import COLD_SLACK, HOT, LOAD_SLACK, LOAD_WINDOW, AdapterAffinityRouter  # noqa: E402


@dataclass
class FakeReplica:
    """The three attributes of Ray's RunningReplica the router reads."""
    replica_id: str
    routing_stats: dict = field(default_factory=dict)
    multiplexed_model_ids: set = field(default_factory=set)


def router() -> AdapterAffinityRouter:
    r = AdapterAffinityRouter.__new__(AdapterAffinityRouter)  # Ray's constructor wants a deployment: not needed
    r.initialize_state()
    return r


def ids(ranks) -> list[list[str]]:
    return [[r.replica_id for r in rank] for rank in ranks]


def test_holders_rank_before_others_and_device_before_host():
    a = FakeReplica("a", {"device": ["x"], "host": []})
    b = FakeReplica("b", {"device": [], "host": ["x"]})
    c = FakeReplica("c")
    ranks = ids(router().affinity_ranks([c, b, a], "x"))
    assert ranks[:2] == [["a"], ["b"]] and sorted(ranks[2]) == ["a", "b", "c"]
    other = ids(router().affinity_ranks([c, b, a], "y"))  # held nowhere: one rank, every replica
    assert len(other) == 1 and sorted(other[0]) == ["a", "b", "c"]


def window(r: AdapterAffinityRouter, *runs: tuple[str, str, int]) -> None:
    """Fill the router's window with runs of (replica, adapter, count) choices."""
    r.recent.clear()
    for replica, adapter, n in runs:
        r.recent.extend([(replica, adapter)] * n)
    assert len(r.recent) == LOAD_WINDOW


@pytest.mark.parametrize("n_replicas", [2, 3])
def test_a_holder_over_its_share_of_the_window_spills_its_hot_adapter_to_the_least_loaded(n_replicas):
    replicas = [FakeReplica(f"r{i}", {"device": ["hot", "cold"] if i == 0 else []}) for i in range(n_replicas)]
    others = [r.replica_id for r in replicas[1:]]
    r = router()
    cap = (1 + LOAD_SLACK) * LOAD_WINDOW / n_replicas
    over = int(cap) + 1
    rest = LOAD_WINDOW - over
    # r0 took `over` choices (HOT of them for "hot"); the others share the rest, the last one a choice fewer
    runs = [("r0", "hot", HOT), ("r0", "other", over - HOT)]
    per = [rest // len(others) + (i < rest % len(others)) for i in range(len(others))]
    runs += [(o, "x", n) for o, n in zip(others, sorted(per, reverse=True), strict=True)]
    window(r, *runs)
    ranks = ids(r.affinity_ranks(replicas, "hot"))
    assert len(ranks) == 1, "an overloaded holder still ranks first for its hot adapter"
    counts = {x: sum(rep == x for rep, _ in r.recent) for x in ranks[0]}
    assert [counts[x] for x in ranks[0]] == sorted(counts.values()) and ranks[0][-1] == "r0"  # least loaded first
    # a cold adapter (fewer than HOT choices) stays with its holder: moving it would cost a read for little load
    assert ids(r.affinity_ranks(replicas, "cold"))[0] == ["r0"]
    # at the cap, not over it: the holder keeps its hot adapter too
    at = int(cap)
    window(r, ("r0", "hot", at), *[(o, "x", n) for o, n in zip(others, [LOAD_WINDOW - at - (len(others) - 1)]
                                                             + [1] * (len(others) - 1), strict=True)])
    assert ids(r.affinity_ranks(replicas, "hot"))[0] == ["r0"]


def test_no_bound_before_the_window_fills_and_routing_is_recorded():
    a, b = FakeReplica("a", {"device": ["x"]}), FakeReplica("b")
    r = router()
    r.recent.extend([("a", "x")] * (LOAD_WINDOW - 1))
    assert ids(r.affinity_ranks([a, b], "x"))[0] == ["a"]

    class Pending:
        class metadata:
            multiplexed_model_id = "x"

    r.on_request_routed(Pending, "a", None)
    assert len(r.recent) == LOAD_WINDOW and r.last_sent["x"][0] == "a" and r.recent[-1] == ("a", "x")
    assert ids(r.affinity_ranks([a, b], "x")) == [["b", "a"]]


def test_choices_for_replicas_gone_since_do_not_count():
    """After a scale-down the window still holds choices for the replica that left: they neither fill the window
    nor count towards a fair share, so the bound waits for a window's worth of choices among the replicas here."""
    a, b = FakeReplica("a", {"device": ["x"]}), FakeReplica("b")
    r = router()
    window(r, ("gone", "y", LOAD_WINDOW // 4), ("a", "x", LOAD_WINDOW * 3 // 4))
    assert ids(r.affinity_ranks([a, b], "x"))[0] == ["a"]  # 48 of 64 for "a", but only 48 seen here: no bound yet
    r.recent.extend([("a", "x")] * (LOAD_WINDOW // 4))  # the gone replica's choices age out
    assert ids(r.affinity_ranks([a, b], "x")) == [["b", "a"]]


def test_a_replica_that_joined_late_takes_a_share_from_the_holder_of_every_adapter():
    """A replica restarted (or started late) holds nothing while the other holds every adapter; with traffic spread
    over many adapters none is hot, and holder-first ranking sent everything to the holder, the newcomer idling
    until the holder was full. A holder over 1 + COLD_SLACK of its fair share spills cold adapters too, and holders
    of equal queues are taken least loaded first, so the newcomer's share grows as it picks adapters up."""
    names = [f"ad{i}" for i in range(200)]
    old, new = FakeReplica("old", {"device": [], "host": names}), FakeReplica("new", {"device": [], "host": []})
    r, rng = router(), random.Random(0)
    served = Counter()
    for i in range(1000):
        name = rng.choice(names)
        chosen = r.affinity_ranks([old, new], name)[0][0]  # equal (short) queues: Ray takes the first of rank 0

        class Pending:
            class metadata:
                multiplexed_model_id = name

        r.on_request_routed(Pending, chosen.replica_id, None)
        if chosen is new and name not in new.routing_stats["host"]:  # its next report shows the adapter it read
            new.routing_stats = {"device": [], "host": [*new.routing_stats["host"], name]}
        served[chosen.replica_id] += i >= 800
    share = served["old"] / 200
    assert share <= 1 / (1 + 1) * (1 + COLD_SLACK), served  # within the bound: at most 1.5x a fair share


def test_model_ids_of_routed_requests_are_not_kept_by_rays_router():
    """Ray's router indexes pending requests by model id and drops an id's entry only when that id is routed again:
    each made-up model name kept its routed request (args, so the request body) for good. Through Ray's own routing
    path, 200 requests with distinct names leave nothing behind."""
    dep = DeploymentID(name="replicas", app_name="app")

    @dataclass(eq=False)
    class Replica(FakeReplica):
        max_ongoing_requests: int = 8

        async def get_queue_len(self, deadline_s: float) -> int:
            return 0

    async def route_all() -> AdapterAffinityRouter:
        r = AdapterAffinityRouter(dep, DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True)
        r.initialize_state()
        r.update_replicas([Replica(ReplicaID("a", dep)), Replica(ReplicaID("b", dep))])
        for i in range(200):
            meta = RequestMetadata(request_id=str(i), internal_request_id=uuid.uuid4().hex,
                                   multiplexed_model_id=f"made-up-{i}")
            pending = PendingRequest(args=[b"body" * 1000], kwargs={}, metadata=meta)
            replica = await r._choose_replica_for_request(pending)  # what Ray's Router does per request
            r.on_send_request(replica.replica_id)
            r.on_request_routed(pending, replica.replica_id, None)
        return r

    r = asyncio.run(route_all())
    assert len(r._pending_requests_by_model_id) == 0, len(r._pending_requests_by_model_id)
    assert len(r.last_sent) == 200  # this router's own memory is bounded separately (MAX_REMEMBERED, memory_s)


def test_holders_of_an_adapter_rank_least_loaded_first():
    """Ray takes the first of equally short queues in a rank: among holders that is the one with less recent load,
    not whichever Ray lists first (which took every tie before)."""
    a, b = FakeReplica("a", {"device": ["x"]}), FakeReplica("b", {"device": ["x"]})
    r = router()
    window(r, ("a", "y", LOAD_WINDOW // 2 + 4), ("b", "z", LOAD_WINDOW // 2 - 4))  # a busier, within every bound
    assert ids(r.affinity_ranks([a, b], "x"))[0] == ["b", "a"]
