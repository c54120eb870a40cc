"""Device staging of adapters' host rows ahead of their pool loads (part of the host tier, under its lock).

Staging (``PagedPool.stage``: padded to the page bucket and copied to the device) runs on the IO threads, right
after a host read or as a job of its own, so the later pool load on the engine thread is only the scatter and table
update. A staging is keyed by (registration, host rows object), so it never serves another adapter or a
re-registered name; it is dropped once taken, with its host rows, on unregister / retry, and beyond ``max_staged``
held (oldest first), bounding the device memory staged pages use.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Executor, Future, InvalidStateError

from slora_jax.engine.pool import PagedPool, StagedPages
from slora_jax.lora.peft import AdapterError
from slora_jax.lora.pool_rows import AdapterRows

__all__ = ["DeviceStaging", "Staging", "finish", "settled", "staged_pages"]

log = logging.getLogger(__name__)


def finish(future: Future, result=None, error: BaseException | None = None) -> None:
    """Settle ``future``, unless a caller cancelled it (then nothing is waiting for it)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def settled(result=None, error: BaseException | None = None) -> Future:
    """A future already holding ``result`` (or ``error``)."""
    future: Future = Future()
    finish(future, result, error)
    return future


@dataclasses.dataclass(eq=False)
class Staging:
    """One adapter's staging for its next pool load. ``rows`` is None while waiting for the host read (the IO worker
    stages right after it); whoever claims it first runs it, and the future gives StagedPages. ``owner`` is the
    registration it was made for (compared by identity only)."""

    owner: object
    rows: AdapterRows | None
    future: Future
    claimed: bool = False


class DeviceStaging:
    """The stagings of a :class:`~slora_jax.engine.host_tier.HostTier`, guarded by its ``lock``.

    Methods ending in ``_locked`` are called with that lock held; the others take it themselves and must be called
    without it (they may block on a device copy).
    """

    def __init__(self, pool: PagedPool, lock: threading.Lock, executor: Executor, max_staged: int):
        self.pool, self.lock, self.executor, self.max_staged = pool, lock, executor, max_staged
        self._staged: OrderedDict[str, Staging] = OrderedDict()  # oldest first
        self._failed: set[str] = set()  # staging raised: load these without it (cleared by a pool load)
        self._closed = False
        self.counts: Counter[str] = Counter()  # stagings, staged_dropped

    def __len__(self) -> int:
        return len(self._staged)

    def drop_locked(self, name: str) -> None:
        staging = self._staged.pop(name, None)
        if staging is not None:
            staging.claimed = True  # a queued job will not run; a running one finishes into a future nobody reads

    def forget_locked(self, name: str) -> None:
        """The adapter is gone: its staging and any staging failure."""
        self.drop_locked(name)
        self._failed.discard(name)

    def close_locked(self) -> None:
        self._closed = True
        for name in list(self._staged):
            self.drop_locked(name)

    def want_locked(self, owner: object, name: str, rows: AdapterRows | None) -> None:
        """Stage ``name`` for its next load: after its host read (``rows`` None) or now on an IO thread."""
        staging = self._staged.get(name)
        if staging is not None and staging.owner is owner and (
                (rows is not None and staging.rows is rows)  # staged, or being staged, from these very rows
                or (staging.rows is None and (rows is None or staging.claimed))):  # staged by the IO read
            self._staged.move_to_end(name)
            return
        if self.max_staged == 0 or self._closed:
            return
        self.drop_locked(name)
        staging = self._staged[name] = Staging(owner, rows, Future())
        if rows is not None:
            self.executor.submit(self._run_stage, name, staging)
        while len(self._staged) > self.max_staged:
            self.drop_locked(next(iter(self._staged)))
            self.counts["staged_dropped"] += 1

    def ready_locked(self, owner: object, name: str, rows: AdapterRows) -> bool:
        """Whether a pool load from ``rows`` is cheap now: pages staged from exactly these rows (of ``owner``, the
        current registration) are on the device, or staging is off or failed for ``name`` (so never waits on it)."""
        if not self.max_staged or name in self._failed:
            return True
        staging = self._staged.get(name)
        return staging is not None and staging.rows is rows and staging.owner is owner and staging.future.done()

    def take_locked(self, owner: object, name: str, rows: AdapterRows) -> Staging | None:
        """Use up ``name``'s staging: returned if made from exactly ``rows`` of ``owner`` and started (finish it with
        :func:`staged_pages`); a staging not started yet is cancelled (cheaper to stage inline than to wait)."""
        staging = self._staged.pop(name, None)
        if staging is None:
            return None
        if staging.rows is not rows or staging.owner is not owner or not staging.claimed:
            staging.claimed = True
            return None
        return staging

    def loaded(self, name: str) -> None:
        """``name`` was loaded into the pool: a past staging failure no longer matters."""
        if self._failed:  # read without the lock: the common case stays lock-free
            with self.lock:
                self._failed.discard(name)

    # ---- around a host read on an IO thread -----------------------------------------------------------------

    def claim_after_read(self, owner: object, name: str) -> Staging | None:
        """The staging waiting for this host read, now claimed by the caller (who stages it after the read)."""
        with self.lock:
            staging = self._staged.get(name)
            if staging is None or staging.owner is not owner or staging.rows is not None or staging.claimed:
                return None
            staging.claimed = True
            return staging

    def stage_or_none(self, name: str, rows: AdapterRows) -> StagedPages | None:
        """``pool.stage`` (blocking until on the device); None if it failed."""
        try:
            staged = self.pool.stage(rows)
        except Exception as e:  # e.g. device memory short: the load will stage inline instead
            log.warning("staging adapter %r failed: %s: %s", name, type(e).__name__, e)
            with self.lock:
                self._failed.add(name)  # loaded without staging rather than asking for staging forever
            return None
        with self.lock:
            self.counts["stagings"] += 1
        return staged

    def publish_locked(self, name: str, staging: Staging, rows: AdapterRows, staged: StagedPages | None,
                       rows_kept: bool) -> StagedPages | None:
        """After the read: keep ``staging`` (now made from ``rows``) if it worked, is still current and its rows
        were kept in host memory; else drop it and return None."""
        if staged is not None and rows_kept and self._staged.get(name) is staging:
            staging.rows = rows
            return staged
        self.abandon_locked(name, staging)
        return None

    def abandon_locked(self, name: str, staging: Staging) -> None:
        if self._staged.get(name) is staging:
            del self._staged[name]

    def _run_stage(self, name: str, staging: Staging) -> None:
        """IO thread: stage rows already in host memory (a job of its own)."""
        with self.lock:
            if staging.claimed:
                return
            staging.claimed = True
        staged = self.stage_or_none(name, staging.rows)
        if staged is None:
            with self.lock:
                self.abandon_locked(name, staging)
        finish(staging.future, staged, None if staged is not None else AdapterError(name, "not staged"))


def staged_pages(staging: Staging, wait: bool) -> StagedPages | None:
    """A taken staging's pages: None if not ready (unless ``wait``: then block until they are) or it failed."""
    if not staging.future.done() and not wait:
        return None
    try:
        return staging.future.result()
    except Exception:
        return None
