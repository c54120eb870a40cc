"""Every registered adapter read into host memory in the background, as S-LoRA keeps them all there.

Without it an adapter is read from its files the first time a request names it, and an admission that waits for
that read stalls the engine thread and every running sequence with it: on the H200, at 70% of saturation, 142 first
reads of 86 ms were a third of the engine thread's time and the mean time to first token was 159 ms
(benchmarks/NOTES.md, session 11). The fill goes through the host tier's cold read-ahead: it reads only into free
room of the host budget, never evicts (a read whose room other reads took meanwhile is dropped), and its rows are
the least recently used, so requests' reads push them out first. It keeps at most two reads in flight, starting
one only while fewer than three reads of any kind are, so the engine's own reads keep IO threads. Adapters
registered later are read in a later pass; one whose read failed is not tried again by the fill (a request still
may).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

from slora_jax.engine.host_tier import HostTier

__all__ = ["HostFill"]

log = logging.getLogger(__name__)


class HostFill:
    """A daemon thread filling ``host``'s free room with registered adapters; it ends when the tier closes or at
    :meth:`close`. It keeps at most ``max_reads`` of its reads in flight and starts one only while fewer than
    ``busy_reads`` reads of any kind are (the host tier's IO threads, 4 by default, leave the rest to requests).
    ``poll_s``: how often it looks again while waiting; ``idle_s``: between passes that read nothing (new
    registrations, room freed by an unregistration)."""

    def __init__(self, host: HostTier, *, max_reads: int = 2, busy_reads: int = 3, poll_s: float = 0.02,
                 idle_s: float = 2.0):
        if not 1 <= max_reads <= busy_reads or poll_s <= 0 or idle_s <= 0:
            raise ValueError("need 1 <= max_reads <= busy_reads, poll_s > 0 and idle_s > 0")
        self.host, self.max_reads, self.busy_reads = host, int(max_reads), int(busy_reads)
        self.poll_s, self.idle_s = float(poll_s), float(idle_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adapter-host-fill", daemon=True)
        self._pending: dict[str, Future] = {}
        self._failed: set[str] = set()
        self.filled = 0  # adapters this fill read into host memory
        self.complete = threading.Event()  # set after the first pass that found nothing more to read

    def start(self) -> HostFill:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop; reads in flight finish in the host tier on their own."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        started, seen = time.monotonic(), None
        try:
            while not self._stop.is_set():
                if self.host.reads_in_flight() is None:  # the tier closed
                    return
                state = self._state()
                if state == seen:  # nothing registered, unregistered or dropped from host memory since the last pass
                    if self._stop.wait(self.idle_s):
                        return
                    continue
                if not self._one_pass():
                    seen = state
                    if not self.complete.is_set():
                        self.complete.set()
                        log.info("host memory fill: %d adapters read in %.1f s (%d failed); the rest were there "
                                 "already or do not fit the host budget", self.filled, time.monotonic() - started,
                                 len(self._failed))
                    if self._stop.wait(self.idle_s):
                        return
        except _Closed:
            return
        except Exception:  # noqa: BLE001 - a background helper: log, never take the server down
            log.exception("host memory fill stopped")

    def _state(self) -> tuple:
        stats = self.host.stats()
        return stats["registered"], stats["in_host"], stats["host_bytes"], stats["failed"]

    def _one_pass(self) -> bool:
        """Read what fits of the registered adapters not in host memory; whether any read was started."""
        read_any = False
        for name in self.host.names():
            if name in self._failed or self.host.has_rows(name):
                continue
            self._wait_for_turn()
            started = self.host.read_ahead([name], cold=True)  # [] if there, loading, failed, gone, or not fitting
            if started:
                read_any = True
                self._pending[name] = started[0]
        while self._pending:
            if self._stop.is_set():
                raise _Closed
            self._settle(wait=True)
        return read_any

    def _wait_for_turn(self) -> None:
        while True:
            if self._stop.is_set():
                raise _Closed
            self._settle(wait=False)
            in_flight = self.host.reads_in_flight()
            if in_flight is None:  # the tier closed
                raise _Closed
            if len(self._pending) < self.max_reads and in_flight < self.busy_reads:
                return
            self._settle(wait=True)

    def _settle(self, wait: bool) -> None:
        """Count the fill's finished reads; with ``wait``, first wait up to ``poll_s`` for one to finish."""
        if wait:
            if self._pending:
                wait_futures(self._pending.values(), timeout=self.poll_s, return_when=FIRST_COMPLETED)
            elif self._stop.wait(self.poll_s):
                raise _Closed
        for name, future in list(self._pending.items()):
            if future.done():
                del self._pending[name]
                if self.host.has_rows(name):
                    self.filled += 1
                elif self.host.error_of(name) is not None:  # the host tier recorded and logged why
                    self._failed.add(name)
                # else: unregistered meanwhile, the store closing, or no room left when it landed


class _Closed(Exception):
    """The tier closed or the fill was stopped: end the thread."""
