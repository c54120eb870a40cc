"""Graceful drain: on SIGTERM (or ``Server.request_shutdown``) new requests get 503, running ones may finish within
the grace period, and then every request still open is ended with an error (an error event and ``[DONE]`` on a
stream, a 503 body otherwise). Only after that is the HTTP server told to exit, so no stream is ever cut mid-way.

The gate counts requests in flight (:meth:`Drain.track`) and refuses new ones once draining (:attr:`Drain.draining`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger("slora_jax.serve")

SHUTTING_DOWN = "the server is shutting down"
FLUSH_S = 5.0  # after the requests were ended: how long their answers may take to reach the clients


class Drain:
    def __init__(self, engine_thread, flush_s: float = FLUSH_S):
        self.engine_thread, self.flush_s = engine_thread, flush_s
        self.draining = False
        self.in_flight = 0
        self._changed: asyncio.Event | None = None  # set whenever in_flight drops or the grace is cut short
        self._cut = False

    @contextlib.contextmanager
    def track(self):
        """Around one HTTP request (event loop only)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self._changed is not None:
                self._changed.set()

    def cut_short(self) -> None:
        """End the grace period now (a second signal). Event loop only."""
        self._cut = True
        if self._changed is not None:
            self._changed.set()

    async def run(self, grace_s: float) -> None:
        """Refuse new requests, wait up to ``grace_s`` for the running ones, then end the rest with an error and
        give their answers up to ``flush_s`` to go out."""
        self.draining = True
        self._changed = asyncio.Event()
        log.info("shutting down: %d request(s) in flight, %.1f s to finish", self.in_flight, grace_s)
        await self._wait_idle(grace_s, stop_when_cut=True)
        if self.in_flight:
            log.warning("shutdown grace period over: ending %d request(s) with an error", self.in_flight)
            self.engine_thread.end_all(f"{SHUTTING_DOWN}; the request was not finished within the grace period")
            await self._wait_idle(self.flush_s, stop_when_cut=False)
        if self.in_flight:
            log.warning("%d request(s) still open after the flush period", self.in_flight)

    async def _wait_idle(self, timeout_s: float, stop_when_cut: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and not (stop_when_cut and self._cut):
            left = deadline - loop.time()
            if left <= 0:
                return
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
