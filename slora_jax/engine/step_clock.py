"""Where the engine thread's time goes, step by step: host seconds per phase, and per kind of step (prefill or
decode) how long the host waited for it and how often it did not wait at all.

Why per kind: the step is pipelined (the next one is queued before the previous one is read back), so a wait near
zero means the device finished that step before the host had queued the next one: the device sat idle for part of
the host's work. Prefill steps are the shorter ones on the device; whether the host keeps up with them is what the
serving bars (S1's requests a second) need to know, and a total over all steps hides it.
"""

from __future__ import annotations

from typing import NamedTuple

HOST_BOUND_WAIT_S = 0.0005  # a wait shorter than this: the device was done (or nearly) before the host asked
KINDS = ("prefill", "decode")


class StepTiming(NamedTuple):
    """Host seconds in each phase of one :meth:`Engine.step`. ``wait`` is the host blocked on the device (the
    previous step still running): near zero means the host, not the device, sets the pace."""

    schedule: float  # admission (incl. blocking adapter loads), decode page reservation, preemption
    dispatch: float  # building the batch in numpy and queueing the jitted step
    prefetch: float  # adapters of the waiting head: host reads started, pool loads queued
    wait: float  # reading the previous step's tokens back
    append: float  # tokens appended, stops checked, callbacks run


class StepClock:
    """Running totals: ``total`` (phase -> seconds), ``last`` (the last step's :class:`StepTiming`) and, per kind of
    the step read back, ``steps``, ``wait`` seconds and ``host_bound`` steps (waited less than HOST_BOUND_WAIT_S)."""

    def __init__(self):
        self.total = dict.fromkeys(StepTiming._fields, 0.0)
        self.last: StepTiming | None = None
        self.by_kind = {kind: {"steps": 0, "wait_s": 0.0, "host_bound": 0} for kind in KINDS}

    def record(self, phases: tuple[float, ...], read_back: str | None) -> None:
        """One ``Engine.step``: its phases, and the kind of the step it read back (None: none was in flight)."""
        self.last = StepTiming(*phases)
        for name, value in zip(StepTiming._fields, phases, strict=True):
            self.total[name] += value
        if read_back is not None:
            kind = self.by_kind[read_back]
            kind["steps"] += 1
            kind["wait_s"] += self.last.wait
            kind["host_bound"] += self.last.wait < HOST_BOUND_WAIT_S
