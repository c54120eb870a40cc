"""The host tier of the adapter store: registered adapters (and failed ones), a byte-budgeted LRU of them as pool
rows (``AdapterRows`` in the pool dtype: moving one to the device is a plain copy), the IO threads that read them
so the engine thread waits on disk only when it must, and their device staging: an adapter the pool tier asks to
have ready (``rows_or_read``, ``stage``) is staged by the IO threads, so its pool load is only scatter and table.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from slora_jax.engine.device_staging import DeviceStaging, finish, settled, staged_pages
from slora_jax.engine.host_records import AdapterEntry, Failures, HostLoad
from slora_jax.engine.pool import PagedPool, StagedPages
from slora_jax.engine.read_workers import adapter_reader
from slora_jax.lora.errors import RETRY_AFTER_S, AdapterError
from slora_jax.lora.pool_rows import AdapterRows, layout_key
from slora_jax.lora.sources import AdapterSource, PeftDirSource, as_source
from slora_jax.model.config import MODULES, ModelConfig

__all__ = ["HostTier"]

log = logging.getLogger(__name__)


class HostTier:
    """Registered adapters, their recorded failures, their host-memory rows and device staging.

    Threading: every public method is thread-safe; one lock guards all state, held only for bookkeeping (never
    across a read, a device copy or a wait). Reads and staging copies run on ``io_threads`` workers, or on the
    calling thread where a method says so. ``host_budget_bytes`` bounds the host rows (``max_host_adapters``
    their count too); ``max_rank``: the largest rank ``register`` accepts; ``dtype``: the host rows'; ``max_staged``:
    adapters holding staged pages at once; ``read_processes``: see :func:`read_workers.adapter_reader`.
    """

    def __init__(self, model_cfg: ModelConfig, pool: PagedPool, *, host_budget_bytes: int, max_rank: int, dtype,
                 io_threads: int = 4, max_host_adapters: int | None = None, max_staged: int = 8,
                 read_processes: int = 0):
        if layout_key(model_cfg) != layout_key(pool.config):
            raise ValueError("model config and pool config describe different model shapes")
        if not 1 <= max_rank <= pool.max_rank:
            raise ValueError(f"max_rank {max_rank} must be in 1..{pool.max_rank} (the pool's max_rank)")
        if (host_budget_bytes < 0 or io_threads < 1 or max_staged < 0
                or (max_host_adapters is not None and max_host_adapters < 0)):
            raise ValueError("host_budget_bytes, max_host_adapters, max_staged must be >= 0 and io_threads >= 1")
        self.model_cfg, self.pool = model_cfg, pool  # of the pool: only constants and the thread-safe ``stage``
        self.max_rank, self.max_staged, self.dtype = int(max_rank), int(max_staged), np.dtype(dtype)
        self.host_budget_bytes, self.max_host_adapters = int(host_budget_bytes), max_host_adapters
        self._widths = pool.vectors_per_rank  # pool vectors per unit of rank, per module (per device under TP)

        self._lock = threading.Lock()  # guards everything below
        self._entries: dict[str, AdapterEntry] = {}
        self._errors = Failures()  # name -> AdapterError (those that may pass expire)
        self._host: OrderedDict[str, AdapterRows] = OrderedDict()  # least recently used first
        self._host_sizes: dict[str, int] = {}
        self._host_bytes, self._closed = 0, False
        self._not_kept: set[str] = set()  # too large for host memory (or none kept): only a pool load reads them
        self._loads: dict[str, HostLoad] = {}
        self._counts: Counter[str] = Counter()
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="adapter-io")
        self._reader = adapter_reader(read_processes)  # PEFT dirs in worker processes, if any (IO threads wait)
        self._staging = DeviceStaging(pool, self._lock, self._executor, self.max_staged)
        self.on_read: Callable[[str, float], None] | None = None  # (name, seconds) of each read: see _tell_read

    # ---- registry ---------------------------------------------------------------------------------------------

    def register(self, name: str, source, verify: bool = False) -> None:
        """Add an adapter (a PEFT dir path, a ``LoraAdapter`` or an ``AdapterSource``) after a cheap validation.

        ``verify``: read and check every weight now, on the calling thread, and keep the rows in host memory.
        Raises :class:`AdapterError` (naming the adapter and the reason) for one we could not serve, ValueError if
        the name is taken.
        """
        entry = self._validated_entry(name, as_source(source))
        rows = None
        if verify:
            t0 = time.perf_counter()
            rows = self._read(entry)
            entry.pages = rows.pages_needed(self.pool.page_rows)
            entry.reads = (1, seconds := time.perf_counter() - t0, seconds)  # not published yet: no lock needed
        with self._lock:
            if name in self._entries:
                raise ValueError(f"adapter {name!r} is already registered; unregister it first")
            self._entries[name] = entry
            if rows is not None:
                self._insert_host(name, rows)
        if rows is not None:
            self._tell_read(name, entry.reads[2])

    def register_dir(self, root: str | Path, *, strict: bool = False) -> list[str]:
        """Register every subdir of ``root`` holding an ``adapter_config.json``, named after the subdir.

        A subdir that fails validation raises with ``strict``; otherwise it is registered as failed, so requests
        naming it get its reason (see :meth:`errors`). Returns the names added, failed ones included.
        """
        added = []
        for sub in sorted(Path(root).iterdir()):
            if not (sub / "adapter_config.json").is_file():
                continue
            source = PeftDirSource(sub)
            try:
                entry = self._validated_entry(sub.name, source)
                error = None
            except AdapterError as e:
                if strict:
                    raise
                log.warning("%s", e)
                entry, error = AdapterEntry(sub.name, source, 0), e
            with self._lock:
                if sub.name in self._entries:
                    raise ValueError(f"adapter {sub.name!r} is already registered; unregister it first")
                self._entries[sub.name] = entry
                if error is not None:
                    self._errors[sub.name] = error
            added.append(sub.name)
        return added

    def unregister(self, name: str) -> None:
        """Forget an adapter: its registration, failure, host rows, staged pages; a read in flight fails.
        KeyError if it is not registered. (The pool tier unloads it from the pool first.)"""
        with self._lock:
            if self._entries.pop(name, None) is None:
                raise KeyError(f"adapter {name!r} is not registered")
            self._errors.pop(name, None)
            self._drop_host(name)
            self._staging.forget_locked(name)
            load = self._loads.pop(name, None)
            if load is not None and not load.claimed:
                load.claimed = True
                finish(load.future, error=AdapterError(name, "unregistered while loading"))

    def retry(self, name: str) -> None:
        """Clear a recorded failure (after the files were fixed): validate again; the next use reloads."""
        entry = self._entry(name)
        fresh = self._validated_entry(name, entry.source)
        with self._lock:
            if self._entries.get(name) is entry:
                self._entries[name] = fresh
                self._errors.pop(name, None)
                self._drop_host(name)  # its rows too: the next use reads the fixed files

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def errors(self) -> dict[str, str]:  # name -> reason of every adapter that failed validation or loading
        with self._lock:
            return {name: e.reason for name, e in self._errors.items()}

    def error_of(self, name: str) -> AdapterError | None:
        with self._lock:
            return self._errors.get(name)

    def pages(self, name: str) -> int:  # pool pages the adapter takes when resident (0 for unknown adapters)
        with self._lock:
            return getattr(self._entries.get(name), "pages", 0)

    def usable_pages(self, name: str) -> int:
        """Pool pages of an adapter that may be loaded; raises its :class:`AdapterError` if it is unknown or failed."""
        with self._lock:
            entry, error = self._entries.get(name), self._errors.get(name)
        if entry is None:
            raise AdapterError(name, "is not registered")
        if error is not None:
            raise error
        return entry.pages

    def rank_table(self, name: str) -> np.ndarray:
        """The adapter's int32 ``[L, len(MODULES)]`` ranks from its validation (0 = not adapted; do not modify);
        raises its :class:`AdapterError` if it is unknown or failed."""
        self.usable_pages(name)
        return self._entry(name).ranks

    def describe(self, names: Iterable[str] | None = None) -> dict[str, dict]:
        """Per registered adapter (all, or those of ``names``): pages, rank, targets, whether its rows are in host
        memory, its failure reason (or None), and its reads from the source (count, seconds summed, last)."""
        with self._lock:
            entries = (list(self._entries.values()) if names is None
                       else [e for e in map(self._entries.get, names) if e is not None])
            return {e.name: {"pages": e.pages, "rank": e.rank, "targets": e.targets, "in_host": e.name in self._host,
                             "error": getattr(self._errors.get(e.name), "reason", None),
                             "reads": e.reads} for e in entries}

    def pages_to_load(self, name: str) -> int:  # pool pages if it may be loaded; 0 if unknown or failed (loads say why)
        with self._lock:
            return 0 if name in self._errors else getattr(self._entries.get(name), "pages", 0)

    # ---- host rows --------------------------------------------------------------------------------------------

    def fetch(self, name: str) -> Future:
        """Future of the adapter's host rows: done at once if cached or failed, else read on an IO thread. It
        raises the adapter's :class:`AdapterError` if it cannot be loaded, recorded so later requests fail the same
        way without re-reading (until :meth:`retry`, or for a failure that may pass until its ``retry_after_s``)."""
        entry = self._entry(name)
        with self._lock:
            return self._fetch_locked(entry)

    def has_rows(self, name: str) -> bool:  # whether the adapter's rows are in host memory now
        with self._lock:
            return name in self._host

    def ready_without_wait(self, name: str) -> bool:
        """Whether a pool load of ``name`` would not wait for a read or a staging copy (True too for unknown and
        failed adapters, whose load fails at once, and for those host memory cannot keep, whose load must read them
        itself); if it would, that read (then staging) or copy starts here."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or name in self._errors or name in self._not_kept:  # not_kept: its load reads it
                return True
            rows = self._host.get(name)
            if rows is not None and self._staging.ready_locked(entry, name, rows):
                return True
        self.stage(self.rows_or_read([name]))
        return False

    def rows_now(self, name: str) -> AdapterRows:
        """Host rows, blocking: cached, or read on the calling thread if its read is still queued (rather than wait
        behind other reads), else wait for the running read. Raises the adapter's :class:`AdapterError`."""
        entry = self._entry(name)
        with self._lock:
            future = self._fetch_locked(entry)
            load = self._loads.get(entry.name)
            inline = load if load is not None and load.future is future and not load.claimed else None
        if inline is not None:
            self._run_load(inline, inline=True)
        return future.result()

    def read_ahead(self, names: Iterable[str], cold: bool = False) -> list[Future]:
        """Start host reads only into free host room (budget and count, counting reads in flight), so they never
        evict cached rows (or staged pages) of adapters needed sooner; nothing else (no staging, no LRU moves).
        ``names`` in queue order; the caller leaves out adapters it does not need read (e.g. resident ones).
        ``cold`` (a background fill's): rows kept only if they still fit when read (other reads may have filled
        the room meanwhile), as the least recently used. Returns the futures of the reads it started."""
        started: list[Future] = []
        with self._lock:
            if self._closed:
                return started
            page_bytes = self.pool.page_bytes  # rows of an adapter of n pool pages take at most n * page_bytes
            in_flight = sum(load.entry.pages for load in self._loads.values()) * page_bytes
            room = self.host_budget_bytes - self._host_bytes - in_flight
            slots = (None if self.max_host_adapters is None
                     else self.max_host_adapters - len(self._host) - len(self._loads))
            for name in dict.fromkeys(names):
                entry = self._entries.get(name)
                if entry is None or name in self._host or name in self._loads or name in self._errors:
                    continue
                size = entry.pages * page_bytes
                if size > room or (slots is not None and slots < 1):
                    break  # in queue order: what does not fit now is read when it gets nearer the head
                started.append(self._start_read_locked(entry, cold))
                self._counts["read_aheads"] += 1
                room -= size
                slots = None if slots is None else slots - 1
        return started

    def reads_in_flight(self) -> int | None:  # reads started, not finished; None once closed (a filler's cue to stop)
        with self._lock:
            return None if self._closed else len(self._loads)

    def rows_or_read(self, names: Iterable[str]) -> list[tuple[str, AdapterRows]]:
        """(name, rows) of those of ``names`` in host memory (each made most recently used); a read is started for
        the others, to be staged on the device right after it. Skipped: unknown, failed and not-kept names."""
        ready = []
        with self._lock:
            for name in names:
                entry = self._entries.get(name)
                if entry is None or name in self._errors or name in self._not_kept:
                    continue
                rows = self._host.get(name)
                if rows is None:
                    self._staging.want_locked(entry, name, None)  # before the read starts: staged right after it
                    self._fetch_locked(entry)
                else:
                    self._host.move_to_end(name)
                    ready.append((name, rows))
        return ready

    # ---- device staging ---------------------------------------------------------------------------------------

    def ready_to_load(self, name: str, rows: AdapterRows) -> bool:
        """Whether a pool load from ``rows`` is cheap now: pages staged from exactly these rows are on the device,
        or staging is off or failed for this adapter (waiting for it would wait forever)."""
        with self._lock:
            return self._staging.ready_locked(self._entries.get(name), name, rows)

    def stage(self, pairs: Iterable[tuple[str, AdapterRows]]) -> None:
        """Stage each (name, rows) on an IO thread for its next pool load, if those rows are still its host rows."""
        with self._lock:
            for name, rows in pairs:
                entry = self._entries.get(name)
                if entry is not None and self._host.get(name) is rows:
                    self._staging.want_locked(entry, name, rows)

    def take_staged(self, name: str, rows: AdapterRows, wait: bool) -> StagedPages | None:
        """This adapter's staged pages if made from exactly ``rows`` of its current registration and ready (or, with
        ``wait``, being made on an IO thread right now, blocking until they are); the staging is used up."""
        with self._lock:
            staging = self._staging.take_locked(self._entries.get(name), name, rows)
        return None if staging is None else staged_pages(staging, wait)

    def loaded(self, name: str) -> None:  # loaded into the pool: a past staging failure no longer matters
        self._staging.loaded(name)

    # ---- stats / lifecycle ------------------------------------------------------------------------------------

    def stats(self, elsewhere: Iterable[str] = ()) -> dict[str, int]:
        """Counts and IO counters; ``source_only`` counts registered adapters neither in host memory nor in
        ``elsewhere`` (the pool tier passes its resident ones)."""
        with self._lock:
            registered, held = len(self._entries), set(self._host).union(elsewhere)
            stats = {"registered": registered, "in_host": len(self._host), "source_only": registered - len(held),
                     "loading": len(self._loads), "failed": len(self._errors), "staged": len(self._staging),
                     "host_bytes": self._host_bytes, "host_budget_bytes": self.host_budget_bytes}
            counts = self._counts + self._staging.counts
        io_keys = ("host_hits", "host_misses", "host_loads", "host_evictions", "host_too_large", "host_fill_dropped",
                   "load_errors", "stagings", "staged_dropped", "read_aheads")
        return stats | {k: counts[k] for k in io_keys}

    def close(self, wait: bool = True) -> None:
        """Stop the IO threads; loads not yet started fail with 'store closed'."""
        with self._lock:
            self._closed = True
            self._staging.close_locked()
            for load in self._loads.values():
                if not load.claimed:
                    load.claimed = True
                    finish(load.future, error=AdapterError(load.entry.name, "adapter store closed"))
        self._executor.shutdown(wait=wait)
        self._reader.close()

    # ---- internals: registry and reads ------------------------------------------------------------------------

    def _entry(self, name: str) -> AdapterEntry:
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            raise AdapterError(name, "is not registered")
        return entry

    def _validated_entry(self, name: str, source: AdapterSource) -> AdapterEntry:
        try:
            ranks = source.rank_table(name, self.model_cfg, self.max_rank)
        except AdapterError as e:  # a registration's failure stands (a wrong path is no reason to retry): a 400
            raise type(e)(e.adapter, e.reason) from None
        vectors = int((ranks.astype(np.int64) @ self._widths).max(initial=0))
        pages = math.ceil(vectors / self.pool.page_rows)
        if pages > min(self.pool.num_pages, self.pool.max_pages):
            raise AdapterError(name, f"needs {pages} pool pages; the pool has {self.pool.num_pages} "
                                     f"(at most {self.pool.max_pages} per adapter)")
        adapted = ranks.max(axis=0, initial=0)
        return AdapterEntry(name, source, pages, int(adapted.max(initial=0)),
                            tuple(m for m, r in zip(MODULES, adapted, strict=True) if r), ranks=ranks)

    def _tell_read(self, name: str, seconds: float) -> None:
        """Lock not held, on the reading thread: tell ``on_read`` (metrics); its failure never fails the read."""
        try:
            if self.on_read is not None:
                self.on_read(name, seconds)
        except Exception:  # noqa: BLE001 - a metrics hook
            log.exception("adapter read listener failed")

    def _read(self, entry: AdapterEntry) -> AdapterRows:
        """Lock not held: the adapter's rows from its source, checked against its registered shape, ``max_rank``."""
        rows = self._reader.load_rows(entry.source, entry.name, self.model_cfg, self.max_rank, self.dtype)
        entry.check_shape(rows)
        rows = self.pool.shard_rows(rows)  # each device's share side by side when the pool is sharded
        rows.name = entry.name
        if rows.max_rank > self.max_rank:
            raise AdapterError(entry.name, f"rank {rows.max_rank} is above the maximum {self.max_rank}")
        return rows

    def _fetch_locked(self, entry: AdapterEntry) -> Future:
        name = entry.name
        error = self._errors.get(name)
        if error is not None:
            return settled(error=error)
        rows = self._host.get(name)
        if rows is not None:
            self._host.move_to_end(name)
            self._counts["host_hits"] += 1
            return settled(rows)
        load = self._loads.get(name)
        if load is None and self._closed:
            return settled(error=AdapterError(name, "adapter store closed"))
        if load is not None:
            load.cold = False  # a request wants these rows now: kept as any read's
        return load.future if load is not None else self._start_read_locked(entry)

    def _start_read_locked(self, entry: AdapterEntry, cold: bool = False) -> Future:
        self._counts["host_misses"] += 1
        load = self._loads[entry.name] = HostLoad(entry, Future(), cold=cold)
        self._executor.submit(self._run_load, load)
        return load.future

    def _run_load(self, load: HostLoad, inline: bool = False) -> None:
        """Read one adapter from its source (IO thread, or inline from ``rows_now``); never raises for bad adapters.

        On an IO thread, an adapter ``rows_or_read`` asked for is also staged on the device before its rows are
        published, so ``ready_to_load`` never sees its rows without its staged pages."""
        with self._lock:
            if load.claimed:
                return
            load.claimed = True
        entry, name = load.entry, load.entry.name
        rows, error, staging = None, None, None
        t0 = time.perf_counter()
        try:
            rows = self._read(entry)
            seconds = time.perf_counter() - t0
            staging = None if inline else self._staging.claim_after_read(entry, name)
        except AdapterError as e:
            error = e
        except Exception as e:  # any failure of one adapter's read must not escape into the engine
            error = AdapterError(name, f"load failed: {type(e).__name__}: {e}", RETRY_AFTER_S if isinstance(e, OSError)
                                 else None)  # the disk may come back
        except BaseException as e:  # interrupted inline: leave no load claimed forever
            with self._lock:
                if self._loads.get(name) is load:
                    del self._loads[name]
            finish(load.future, error=e)
            raise
        staged = None
        if error is None and staging is not None:
            try:
                staged = self._staging.stage_or_none(name, rows)
            except BaseException as e:  # leave no staging claimed but never finished
                with self._lock:
                    self._staging.abandon_locked(name, staging)
                    if self._loads.get(name) is load:
                        del self._loads[name]
                finish(staging.future, error=e)
                finish(load.future, error=e)
                raise
        with self._lock:
            if self._loads.get(name) is load:
                del self._loads[name]
            current = self._entries.get(name) is entry
            if error is not None:
                self._counts["load_errors"] += 1
                if current:
                    self._errors.record_read(name, error)
            else:
                self._counts["host_loads"] += 1
                entry.reads = (entry.reads[0] + 1, entry.reads[1] + seconds, seconds)
                if current:
                    entry.pages = rows.pages_needed(self.pool.page_rows)
                    self._insert_host(name, rows, load.cold)
            if staging is not None:  # useless if failed, unregistered, dropped meanwhile or not kept in host memory
                staged = self._staging.publish_locked(name, staging, rows, staged, self._host.get(name) is rows)
        if staging is not None:
            finish(staging.future, staged, None if staged is not None else AdapterError(name, "not staged"))
        if error is not None:
            log.warning("%s", error)
        else:
            self._tell_read(name, seconds)
        finish(load.future, rows, error)

    def _insert_host(self, name: str, rows: AdapterRows, cold: bool = False) -> None:
        """Cache rows, evicting least recently used ones over budget; rows larger than the budget are not kept;
        ``cold`` rows only into free room, as the least recently used."""
        size, most = rows.nbytes, math.inf if self.max_host_adapters is None else self.max_host_adapters
        if cold and (self._host_bytes + size > self.host_budget_bytes or len(self._host) >= most):
            self._counts["host_fill_dropped"] += 1
            return
        if size > self.host_budget_bytes or self.max_host_adapters == 0:
            self._counts["host_too_large"] += 1
            self._not_kept.add(name)
            return
        self._drop_host(name, keep_staged=True)  # the caller settles this name's staging
        self._host[name], self._host_sizes[name] = rows, size
        self._host_bytes += size
        if cold:
            self._host.move_to_end(name, last=False)
        while self._host_bytes > self.host_budget_bytes or len(self._host) > most:
            oldest = next(iter(self._host))
            self._drop_host(oldest)
            self._counts["host_evictions"] += 1

    def _drop_host(self, name: str, keep_staged: bool = False) -> None:
        if self._host.pop(name, None) is not None:
            self._host_bytes -= self._host_sizes.pop(name)
        if not keep_staged:
            self._staging.drop_locked(name)
            self._not_kept.discard(name)
