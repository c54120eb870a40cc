"""Admission-order policies: in which order the scheduler tries waiting requests (and prefetches their adapters).

A policy is one class registered under a name (``@register_policy("name")``) and chosen by
``EngineConfig.scheduling_policy``. ``order(waiting)`` is all it must provide; the hooks let a policy keep state (a
tenant's service so far, how often a request was overtaken). Admission stops at the first request in this order that
does not fit, so an order never lets a large request be skipped for ever by smaller ones behind it.

* ``fcfs``: arrival order (preempted requests go back to the front).
* ``slo``: earliest first-token deadline first (EDF); requests without a deadline after, in arrival order. With
  ``EngineConfig.early_abort`` the scheduler also ends requests that can no longer meet their deadline.
* ``vtc``: per-tenant fairness with virtual token counters (Sheng et al., "Fairness in Serving Large Language Models",
  OSDI'24): the tenant with the least weighted service so far goes first, and a tenant that was idle starts from the
  least counter among the active ones, so idling banks no credit. Bound, for two tenants both backlogged: the
  difference of their weighted service stays within ``2 * U`` where U is the weighted cost of the largest request
  (``input_weight * max_model_len + output_weight * max_model_len``) plus one prefill batch of the other tenant.
  Order alone cannot help a light tenant once a heavy tenant's backlog fills the batch: its request would wait for a
  running one to finish (~40 ms at batch 128 on the H200). So the last ``vtc_reserved_slots`` batch slots go only to
  tenants holding less than an equal share of the batch (``max_batch_size / tenants``, counting tenants with requests
  in the engine or seen in the last ``RESERVE_MEMORY_S``, so a light tenant between two requests finds its slot
  still free) and not ahead of the least served tenant (else the reserve alone would hold the shares of the batch
  equal and the service drift apart); a tenant alone keeps every slot.
* ``adapter-aware``: within the first ``adapter_lookahead`` waiting requests, those whose adapter is already in the
  pool (or that need none) go first, saving cold loads; a request overtaken by ``adapter_max_bypass`` younger ones is
  served before any other, so none waits more than that many admissions beyond its FCFS turn.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator

from .config import EngineConfig
from .sequence import Sequence


@dataclasses.dataclass(frozen=True)
class PolicyContext:
    """What a policy may consult: the settings, whether an adapter is resident in the pool, the scheduler's clock and
    its typical admission-to-first-token time lately (seconds; 0 before any)."""

    ecfg: EngineConfig
    is_resident: Callable[[str], bool] = lambda name: False
    clock: Callable[[], float] = time.monotonic
    typical_ttft: Callable[[], float] = lambda: 0.0


class Policy:
    """Base class: arrival order, no state. Subclasses override ``order`` and any hook they need."""

    def __init__(self, ctx: PolicyContext):
        self.ctx = ctx

    def order(self, waiting: deque[Sequence]) -> Iterable[Sequence]:
        """Waiting sequences in admission order; consumed lazily (admission and prefetch stop early)."""
        return iter(waiting)

    def on_arrival(self, seq: Sequence) -> None:
        """A new request joined the waiting queue."""

    def on_admitted(self, batch: list[Sequence], waiting: deque[Sequence]) -> None:
        """``batch`` was admitted (taken out of ``waiting``, which holds the rest)."""

    def may_take_slot(self, seq: Sequence, free_slots: int) -> bool:
        """May ``seq`` be admitted into one of the ``free_slots`` batch slots left? False skips it this step (the
        requests after it in ``order`` are still tried)."""
        return True

    def on_preempted(self, seq: Sequence) -> None:
        """``seq`` went back from running to waiting."""

    def on_tokens(self, seq: Sequence, n: int) -> None:
        """``seq`` generated ``n`` tokens."""

    def on_finished(self, seq: Sequence) -> None:
        """``seq`` left the engine (finished, aborted or failed)."""


POLICIES: dict[str, Callable[[PolicyContext], Policy]] = {}


def register_policy(name: str):
    """Class decorator: make a policy selectable as ``EngineConfig(scheduling_policy=name)``."""

    def add(cls):
        if name in POLICIES:
            raise ValueError(f"scheduling policy {name!r} is already registered")
        POLICIES[name] = cls
        return cls

    return add


def make_policy(name: str, ctx: PolicyContext) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None
    return factory(ctx)


@register_policy("fcfs")
class FCFS(Policy):
    """First come, first served (preempted sequences go back to the front)."""


@register_policy("slo")
class EarliestDeadlineFirst(Policy):
    """Earliest first-token deadline first among requests that can still expect to make it (deadline further than
    the typical first-token time lately); then those that could make it only with a faster than typical first
    token; then requests without a deadline, in arrival order. Under overload the capacity goes to requests likely
    to meet their deadline instead of to ones that would most likely be late (and, with early abort, cut)."""

    def order(self, waiting: deque[Sequence]) -> Iterator[Sequence]:
        horizon = self.ctx.clock() + self.ctx.typical_ttft()
        with_deadline = sorted((s for s in waiting if s.deadline is not None), key=lambda s: s.deadline)
        likely = [s for s in with_deadline if s.deadline >= horizon]
        unlikely = [s for s in with_deadline if s.deadline < horizon]
        return itertools.chain(likely, unlikely, (s for s in waiting if s.deadline is None))


RESERVE_MEMORY_S = 10.0  # vtc: how long a tenant with nothing in the engine still counts for the reserved slots


def tenant_of(seq: Sequence) -> str:
    """Whose service a request counts towards: its tenant if the caller named one, else its adapter (or base)."""
    if seq.tenant is not None:
        return seq.tenant
    return f"adapter:{seq.adapter}" if seq.adapter is not None else "base"


@register_policy("vtc")
class VirtualTokenCounter(Policy):
    """Per-tenant fairness: admit from the tenant with the least weighted service (see the module docstring)."""

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.input_weight = ctx.ecfg.vtc_input_weight
        self.output_weight = ctx.ecfg.vtc_output_weight
        self.counter: dict[str, float] = defaultdict(float)  # weighted service so far (lifted on return from idle)
        self.active: dict[str, int] = defaultdict(int)  # requests waiting or running, per tenant
        self.running: dict[str, set[Sequence]] = defaultdict(set)  # admitted and not yet finished, per tenant
        self.last_seen: dict[str, float] = {}  # when a tenant last had a request in the engine
        batch = ctx.ecfg.max_batch_size
        reserved = ctx.ecfg.vtc_reserved_slots
        self.reserved_slots = max(1, batch // 32) if reserved is None else min(reserved, batch - 1)

    def order(self, waiting: deque[Sequence]) -> Iterator[Sequence]:
        queues: dict[str, deque[Sequence]] = defaultdict(deque)
        for seq in waiting:  # arrival order within a tenant (preempted ones are at the front already)
            queues[tenant_of(seq)].append(seq)
        counter = {t: self.counter[t] for t in queues}  # a simulation: the real counters move on admission
        while queues:
            tenant = min(queues, key=lambda t: (counter[t], queues[t][0].arrival_time))
            seq = queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            counter[tenant] += self.input_weight * seq.num_tokens
            yield seq

    def on_arrival(self, seq: Sequence) -> None:
        tenant = tenant_of(seq)
        if self.active[tenant] == 0:  # back from idle: no credit for the time it sent nothing
            others = [self.counter[t] for t, n in self.active.items() if n > 0 and t != tenant]
            if others:
                self.counter[tenant] = max(self.counter[tenant], min(others))
        self.active[tenant] += 1

    def may_take_slot(self, seq: Sequence, free_slots: int) -> bool:
        if free_slots > self.reserved_slots:
            return True
        recent = self.ctx.clock() - RESERVE_MEMORY_S
        for t in [t for t, when in self.last_seen.items() if when < recent and t not in self.active]:
            del self.last_seen[t]
        tenants = len(self.last_seen.keys() | self.active.keys())
        if tenants <= 1:
            return True
        tenant = tenant_of(seq)
        # below a share of the batch, and not ahead of the least served tenant: a tenant ahead of it takes no reserved
        # slot, or holding half the batch by the reserve alone its service drifts ahead without bound (a random walk,
        # 10.6 U ahead after 30 s in one simulated trace of 200)
        least = min(self.counter[t] for t in self.active)
        return len(self.running.get(tenant, ())) * tenants < self.ctx.ecfg.max_batch_size and \
            self.counter[tenant] <= least

    def on_admitted(self, batch: list[Sequence], waiting: deque[Sequence]) -> None:
        for seq in batch:  # a recomputed (preempted) prompt is charged again: it is served again
            tenant = tenant_of(seq)
            self.counter[tenant] += self.input_weight * seq.num_tokens
            self.running[tenant].add(seq)

    def on_preempted(self, seq: Sequence) -> None:
        self._stopped_running(seq)

    def _stopped_running(self, seq: Sequence) -> None:
        tenant = tenant_of(seq)
        running = self.running.get(tenant)
        if running is not None:
            running.discard(seq)
            if not running:
                del self.running[tenant]

    def on_tokens(self, seq: Sequence, n: int) -> None:
        self.counter[tenant_of(seq)] += self.output_weight * n

    def on_finished(self, seq: Sequence) -> None:
        self._stopped_running(seq)
        tenant = tenant_of(seq)
        self.last_seen[tenant] = self.ctx.clock()
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]


@register_policy("adapter-aware")
class AdapterAware(Policy):
    """Resident adapters first within a bounded look-ahead, with a bound on how often a request is overtaken."""

    def __init__(self, ctx: PolicyContext):
        super().__init__(ctx)
        self.lookahead = ctx.ecfg.adapter_lookahead
        self.max_bypass = ctx.ecfg.adapter_max_bypass
        self.bypassed: dict[Sequence, int] = {}  # younger requests admitted before it, per waiting request

    def _warm(self, seq: Sequence) -> bool:
        return seq.adapter is None or self.ctx.is_resident(seq.adapter)

    def _starved(self, seq: Sequence) -> bool:
        return self.bypassed.get(seq, 0) >= self.max_bypass

    def order(self, waiting: deque[Sequence]) -> Iterator[Sequence]:
        yield from (s for s in waiting if self._starved(s))
        window = [s for s in itertools.islice(waiting, self.lookahead) if not self._starved(s)]
        yield from (s for s in window if self._warm(s))
        yield from (s for s in window if not self._warm(s))
        yield from (s for s in itertools.islice(waiting, self.lookahead, None) if not self._starved(s))

    def on_admitted(self, batch: list[Sequence], waiting: deque[Sequence]) -> None:
        if not batch:
            return
        youngest = max(s.arrival_time for s in batch)
        for seq in waiting:
            if seq.arrival_time < youngest:  # older than an admitted one, still waiting: overtaken once more
                overtook = sum(1 for s in batch if s.arrival_time > seq.arrival_time)
                self.bypassed[seq] = self.bypassed.get(seq, 0) + overtook
        for seq in batch:
            self.bypassed.pop(seq, None)

    def on_finished(self, seq: Sequence) -> None:
        self.bypassed.pop(seq, None)
