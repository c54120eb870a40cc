"""Scheduling policies against their promises, in a simulation of the scheduler with a fake clock, pool and store
(the real Scheduler and policies; the device replaced by step times), so overload and long traces run in moments.

* early abort (``slo`` + ``early_abort``): never serves a first token past its deadline, never aborts a request whose
  deadline is further than the fastest first token seen, and serves more requests within their deadline than FCFS;
* ``vtc``: two backlogged tenants, one sending 10x the other, get service within the stated bound of each other;
* ``adapter-aware``: fewer cold adapter loads than FCFS, and no request overtaken by more than the stated bound.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque

import numpy as np
import pytest

from slora_jax.engine.adapter_store import NoRoom
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.policies import PolicyContext, make_policy
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.scheduler import Scheduler
from slora_jax.engine.sequence import Sequence, Status

PREFILL_S, PER_TOKEN_S, DECODE_S = 0.020, 2e-5, 0.012  # simulated step times: a prefill costs per prompt token


class FakePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.num_free_pages = num_pages
        self.allocator = None  # the scheduler's fork page sharing keeps it; no trace here forks

    def alloc_kv_pages(self, n, owner=None):
        assert n <= self.num_free_pages
        self.num_free_pages -= n
        return [0] * n

    def free_kv_pages(self, pages, owner=None):
        self.num_free_pages += len(pages)


class FakeStore:
    """Adapters of 0 pages in ``slots`` pool slots, evicted LRU among unpinned; counts cold loads."""

    def __init__(self, slots: int):
        self.slots, self.resident, self.pins, self.loads = slots, [], Counter(), 0

    def is_resident(self, name):
        return name in self.resident

    def adapter_pages(self, name):
        return 0

    def pin_count(self, name):
        return self.pins[name]

    pages_needed_to_load = adapter_pages

    def evictable_pages(self):
        return 0

    def reclaim_pages(self, n):
        return False

    def acquire(self, name):
        if name in self.resident:
            self.resident.remove(name)
        else:
            if len(self.resident) >= self.slots:
                victim = next((n for n in self.resident if not self.pins[n]), None)
                if victim is None:
                    raise NoRoom(name)
                self.resident.remove(victim)
            self.loads += 1
        self.resident.append(name)
        self.pins[name] += 1
        return self.resident.index(name)

    def release(self, name):
        self.pins[name] -= 1


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@dataclasses.dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    adapter: str | None = None
    tenant: str | None = None
    slo_s: float | None = None


def simulate(ecfg: EngineConfig, requests: list[Request], slots: int = 64, until: float | None = None):
    """Run the scheduler over ``requests`` (sorted by arrival); returns (sequences, store, scheduler, aborted)."""
    clock, store = Clock(), FakeStore(slots)
    sched = Scheduler(ecfg, FakePool(ecfg.num_pages), store, clock=clock)
    pending, seqs, aborted = list(requests), [], []
    while pending or sched.has_work():
        while pending and pending[0].arrival <= clock.now:
            r = pending.pop(0)
            seq = Sequence(prompt_ids=[1] * r.prompt, adapter=r.adapter, arrival_time=r.arrival, tenant=r.tenant,
                           sampling=SamplingParams(max_tokens=r.output, temperature=0.0),
                           deadline=None if r.slo_s is None else r.arrival + r.slo_s)
            sched.add(seq)
            seqs.append(seq)
        plan = sched.schedule()
        for seq, _, kind in sched.take_failed():  # aborted while waiting, with the bound it was judged by
            assert kind == "deadline"
            aborted.append((seq, clock.now, sched.min_time_to_first_token()))
            sched.finish(seq, "error")
        if plan is None:
            clock.now = pending[0].arrival if pending else clock.now + DECODE_S
            continue
        if plan.kind == "prefill":
            clock.now += PREFILL_S + PER_TOKEN_S * sum(len(s.prompt_ids) for s in plan.seqs)
        else:
            clock.now += DECODE_S
        for seq in plan.seqs:
            if seq.status != Status.RUNNING:
                continue
            if not sched.on_token(seq, clock.now):  # a first token past its deadline: ended, not served
                assert clock.now > seq.deadline
                aborted.append((seq, clock.now, None))
                sched.finish(seq, "error")
                continue
            if seq.first_token_time is None:
                seq.first_token_time = clock.now
            seq.output_ids.append(7)
            if len(seq.output_ids) >= seq.sampling.max_tokens:
                sched.finish(seq, "length")
        if until is not None and clock.now > until:
            break
    return seqs, store, sched, aborted


def base_cfg(**kw) -> EngineConfig:
    base = dict(max_batch_size=32, max_prefill_tokens=2048, max_prefill_seqs=8, max_model_len=1024, page_size=16,
                num_pages=4096, dtype="float32", backend="reference")
    return EngineConfig(**(base | kw))


def overload_trace(rng, rate: float, seconds: float, slo_s: float) -> list[Request]:
    t, out = 0.0, []
    while t < seconds:
        t += rng.exponential(1 / rate)
        out.append(Request(t, int(rng.integers(8, 256)), int(rng.integers(8, 64)), slo_s=slo_s))
    return out


def test_early_abort_never_serves_late_nor_aborts_what_could_make_it():
    rng = np.random.default_rng()
    trace = overload_trace(rng, rate=60.0, seconds=20.0, slo_s=1.0)  # ~2x what the simulated device serves
    seqs, _, sched, aborted = simulate(base_cfg(scheduling_policy="slo", early_abort=True), trace)
    served = [s for s in seqs if s.first_token_time is not None]
    assert served and aborted, "the trace should both serve and abort requests"
    assert all(s.first_token_time <= s.deadline for s in served), "a first token was served past its deadline"
    waiting_aborts = [(seq, when, bound) for seq, when, bound in aborted if bound is not None]
    assert waiting_aborts and len(waiting_aborts) < len(aborted), "both kinds of abort should happen"
    for seq, when, bound in waiting_aborts:
        # aborted before admission only when its deadline was nearer than the fastest recent first token (which
        # is never faster than one prefill of one short prompt)
        assert bound >= PREFILL_S and when + bound > seq.deadline, (when, bound, seq.deadline)
    assert sched.num_deadline_aborts == len(aborted)  # both cuts counted


def test_early_abort_leaves_a_preempted_request_that_met_its_deadline_alone():
    """A request preempted after its first token waits again; its first-token deadline was met, so early abort must
    not end it mid-stream when the deadline has passed (it once did), while a never-served one past it is ended."""
    clock = Clock()
    sched = Scheduler(base_cfg(scheduling_policy="slo", early_abort=True), FakePool(4096), FakeStore(8), clock=clock)
    served, fresh = (Sequence(prompt_ids=[1] * 20, adapter=None, arrival_time=0.0, deadline=1.0,
                              sampling=SamplingParams(max_tokens=50, temperature=0.0)) for _ in range(2))
    sched.add(served)
    plan = sched.schedule()
    assert plan.seqs == [served]
    clock.now = 0.1
    assert sched.on_token(served, clock.now)
    served.first_token_time = clock.now
    served.output_ids.append(7)
    sched.preempt(served)  # back in the queue, to be recomputed
    sched.add(fresh)
    clock.now = 5.0  # both deadlines long past
    sched.schedule()
    failed = [seq for seq, _, kind in sched.take_failed() if kind == "deadline"]
    assert failed == [fresh]
    assert served.status == Status.RUNNING and sched.num_deadline_aborts == 1


def test_early_abort_serves_more_within_deadline_than_fcfs():
    """Over six random overload traces: never fewer within the deadline, and well more in all (one trace alone
    ranged 1.06-3x of FCFS over 60 seeds, so a 1.2x bound on one trace failed 3% of runs; three summed fell under
    1.5x in ~0.5% of runs (1.41 and 1.45 in 200); six summed: about 1 in 20,000, resampled)."""
    rng = np.random.default_rng()

    def within_slo(seqs):
        return sum(1 for s in seqs if s.first_token_time is not None and s.first_token_time <= s.deadline)

    counts = []
    for _ in range(6):
        trace = overload_trace(rng, rate=40.0, seconds=20.0, slo_s=1.0)
        fcfs, *_ = simulate(base_cfg(), trace)
        abort, *_ = simulate(base_cfg(scheduling_policy="slo", early_abort=True), trace)
        counts.append((within_slo(abort), within_slo(fcfs)))
    assert all(a >= f for a, f in counts), counts
    assert sum(a for a, _ in counts) > 1.5 * sum(f for _, f in counts), counts


def test_without_deadlines_nothing_is_aborted():
    rng = np.random.default_rng()
    trace = [dataclasses.replace(r, slo_s=None) for r in overload_trace(rng, 40.0, 5.0, 1.0)]
    seqs, _, _, aborted = simulate(base_cfg(scheduling_policy="slo", early_abort=True), trace)
    assert not aborted and all(s.status == Status.FINISHED and s.finish_reason == "length" for s in seqs)


def _service(seqs, ecfg, until):
    got = Counter()
    for s in seqs:
        if s.admit_time is not None and s.admit_time <= until:
            got[s.tenant] += ecfg.vtc_input_weight * len(s.prompt_ids) + ecfg.vtc_output_weight * len(s.output_ids)
    return got


@pytest.mark.parametrize("policy", ["vtc", "fcfs"])
def test_vtc_keeps_backlogged_tenants_within_its_bound(policy):
    rng = np.random.default_rng()
    ecfg = base_cfg(scheduling_policy=policy, max_batch_size=8)
    trace = []
    for tenant, rate in (("heavy", 100.0), ("light", 10.0)):  # both backlogged: ~10x what the device serves
        # and from the start: 16 requests each at t=0. Without them the light tenant's queue could empty early (a 1 s
        # gap among its first arrivals, 1 seed in 300), and VTC rightly lifts an idle tenant's counter, which the
        # service counted here from t=0 does not see
        trace += [Request(0.0, int(rng.integers(8, 128)), int(rng.integers(8, 64)), tenant=tenant) for _ in range(16)]
        t = 0.0
        while t < 30.0:
            t += rng.exponential(1 / rate)
            trace.append(Request(t, int(rng.integers(8, 128)), int(rng.integers(8, 64)), tenant=tenant))
    trace.sort(key=lambda r: r.arrival)
    seqs, *_ = simulate(ecfg, trace, until=30.0)
    got = _service(seqs, ecfg, 30.0)
    largest = ecfg.vtc_input_weight * 128 + ecfg.vtc_output_weight * 64
    bound = 2 * largest + ecfg.max_prefill_seqs * largest  # the module docstring's bound for these lengths
    if policy == "vtc":
        assert abs(got["heavy"] - got["light"]) <= bound, got
    else:  # FCFS: the heavy tenant takes about its share of arrivals, ~10x the light one's (7.4x mean, 4.9x least
        assert got["heavy"] > 3 * got["light"], got  # in 800 runs: a 5x bound failed 1 run in ~300)


def test_vtc_reserved_slot_goes_to_a_tenant_below_its_share_only_while_it_is_not_ahead():
    """The last slot (the reserve) once went to any tenant below its share of the batch, even one ahead in service:
    the reserve then held the shares of the batch equal whatever the counters said, and the service difference
    walked away (10.6 U after 30 s in one simulated trace of 200; the bound is 10 U). Now a tenant ahead of the least
    served one waits for VTC's order; one level with it or behind still takes the reserve."""
    ecfg = base_cfg(scheduling_policy="vtc", max_batch_size=8)
    vtc = make_policy("vtc", PolicyContext(ecfg))
    rng = np.random.default_rng()
    seqs = {t: [Sequence(prompt_ids=[1] * int(rng.integers(8, 64)), adapter=None, tenant=t, arrival_time=0.0,
                         sampling=SamplingParams(max_tokens=8)) for _ in range(6)] for t in ("heavy", "light")}
    for t in seqs:
        for seq in seqs[t]:
            vtc.on_arrival(seq)
    vtc.on_admitted(seqs["heavy"][:4] + seqs["light"][:3], deque())  # 7 of 8 rows: the last one is the reserve
    lead = float(rng.uniform(1, 500))
    vtc.counter["heavy"], vtc.counter["light"] = 1000.0, 1000.0 + lead
    assert not vtc.may_take_slot(seqs["light"][3], free_slots=1)  # below its share (3 of 8) but ahead
    assert not vtc.may_take_slot(seqs["heavy"][4], free_slots=1)  # the least served, at its share (4 of 8)
    vtc.counter["light"] = 1000.0 - lead
    assert vtc.may_take_slot(seqs["light"][3], free_slots=1)  # below its share and behind
    vtc.counter["light"] = 1000.0
    assert vtc.may_take_slot(seqs["light"][3], free_slots=1)  # level
    assert vtc.may_take_slot(seqs["heavy"][4], free_slots=2)  # outside the reserve: VTC's order decides


def test_vtc_gives_an_idle_tenant_no_banked_credit():
    ecfg = base_cfg(scheduling_policy="vtc", max_batch_size=4)
    trace = [Request(0.001 * i, 64, 32, tenant="a") for i in range(600)]  # a: backlogged for ~60 s
    trace += [Request(20.0 + 0.001 * i, 64, 32, tenant="b") for i in range(40)]  # b: idle until t = 20 s
    trace.sort(key=lambda r: r.arrival)
    seqs, *_ = simulate(ecfg, trace)
    b_times = [s.admit_time for s in seqs if s.tenant == "b"]
    a_meanwhile = [s for s in seqs if s.tenant == "a" and min(b_times) < s.admit_time < max(b_times)]
    # b starts level with a instead of owning all of a's 20 s of service: the two alternate while both wait
    assert len(a_meanwhile) >= 20, len(a_meanwhile)


def _light_tenant_trace(rng, with_heavy: bool) -> list[Request]:
    """A light tenant at 2 req/s; with ``with_heavy``, a heavy one at ~5x what the simulated device serves, which
    keeps the batch full of its requests."""
    trace = []
    for tenant, rate in (("light", 2.0),) + ((("heavy", 150.0),) if with_heavy else ()):
        t = 0.0
        while t < 20.0:
            t += rng.exponential(1 / rate)
            trace.append(Request(t, int(rng.integers(8, 128)), int(rng.integers(8, 64)), tenant=tenant))
    return sorted(trace, key=lambda r: r.arrival)


def _mean_light_ttft(seqs) -> float:
    light = [s.first_token_time - s.arrival_time for s in seqs if s.tenant == "light" and s.first_token_time]
    assert len(light) >= 20, len(light)
    return float(np.mean(light))


def test_vtc_reserved_slots_keep_a_light_tenant_near_its_latency_alone():
    rng = np.random.default_rng()
    ecfg = base_cfg(scheduling_policy="vtc", max_batch_size=16)
    alone = _mean_light_ttft(simulate(ecfg, _light_tenant_trace(rng, with_heavy=False))[0])
    shared_trace = _light_tenant_trace(rng, with_heavy=True)
    reserved = _mean_light_ttft(simulate(ecfg, shared_trace, until=20.0)[0])
    no_reserve = _mean_light_ttft(simulate(dataclasses.replace(ecfg, vtc_reserved_slots=0), shared_trace,
                                           until=20.0)[0])
    # without the reserve, the light request waits for a heavy one to finish (the batch is full); with it, only for
    # the step in flight and its own prefill
    # (25 runs: reserved up to 1.92x alone, no_reserve down to 1.38x reserved; the bounds leave room for the tails)
    assert reserved <= 2.5 * alone, (reserved, alone)
    assert no_reserve > 1.15 * reserved, (no_reserve, reserved)


def test_vtc_tenant_alone_keeps_every_slot():
    ecfg = base_cfg(scheduling_policy="vtc", max_batch_size=8)
    trace = [Request(0.0, 16, 400, tenant="only") for _ in range(20)]
    _, _, sched, _ = simulate(ecfg, trace, until=0.2)
    assert len(sched.running) == 8


def test_adapter_aware_loads_fewer_adapters_and_bounds_overtaking():
    rng = np.random.default_rng()
    names = [f"ad-{i}" for i in range(40)]
    weights = 1.0 / np.arange(1, 41)
    weights /= weights.sum()
    trace = [Request(0.002 * i, int(rng.integers(8, 64)), int(rng.integers(4, 32)),
                     adapter=str(rng.choice(names, p=weights))) for i in range(600)]
    max_bypass = 16
    loads = {}
    for policy in ("fcfs", "adapter-aware"):
        ecfg = base_cfg(scheduling_policy=policy, adapter_max_bypass=max_bypass, adapter_lookahead=32,
                        max_batch_size=16)
        seqs, store, sched, _ = simulate(ecfg, trace, slots=6)
        loads[policy] = store.loads
        assert all(s.finish_reason == "length" for s in seqs)
        if policy == "adapter-aware":
            for s in seqs:  # admitted after at most max_bypass younger requests (+ one prefill batch of them)
                overtook = sum(1 for o in seqs if o.arrival_time > s.arrival_time and o.admit_time < s.admit_time)
                assert overtook <= max_bypass + ecfg.max_prefill_seqs, overtook
    assert loads["adapter-aware"] < 0.8 * loads["fcfs"], loads


def test_reconfigure_swaps_policy_and_cache_only_while_idle():
    from slora_jax.engine.policies import EarliestDeadlineFirst, VirtualTokenCounter

    sched = Scheduler(base_cfg(scheduling_policy="slo"), FakePool(64), FakeStore(4), clock=Clock())
    assert isinstance(sched.policy, EarliestDeadlineFirst)
    sched.reconfigure(scheduling_policy="vtc", early_abort=True)
    assert isinstance(sched.policy, VirtualTokenCounter) and sched.ecfg.early_abort
    with pytest.raises(ValueError, match="max_batch_size"):
        sched.reconfigure(max_batch_size=4)  # shapes are compiled: not a scheduling setting
    sched.add(Sequence(prompt_ids=[1, 2], adapter=None, sampling=SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="no request"):
        sched.reconfigure(scheduling_policy="fcfs")
