"""The adapter store: every registered adapter lives on disk (or in memory); a byte-budgeted LRU of them is kept on
the host already laid out as pool rows; only the adapters the running batch needs sit in the device pool.

Three tiers, after S-LoRA:

* **source** (``slora_jax.lora.sources``: disk / in-memory / synthetic): never evicted; registering only validates
  cheaply (config, shapes).
* **host** (:class:`~slora_jax.engine.host_tier.HostTier`, thread-safe): rows in the pool dtype, read on IO threads
  and staged on the device ahead of their pool loads.
* **pool** (this module, engine thread): resident adapters, each pinned (refcounted) while a running sequence uses
  it or an operator pinned it (``pin``); unpinned ones stay as a cache and are evicted in the order an
  :class:`EvictionPolicy` gives (LRU by default) when a load needs a slot or pages. A pinned one is never evicted.

``prefetch`` is called right after the engine dispatches a step: it starts host reads for the head of the waiting
queue and turns host-ready adapters into pool loads, which are async JAX dispatches that overlap the running step;
those not loadable yet are staged on the device by the IO threads, so their later load is only a scatter.

Threading: ``register``, ``register_dir``, ``names``, ``in`` and ``len`` only touch the host tier and are safe from any
thread; every other method is for the engine thread. The store owns adapter residency: do not load or unload
adapters on the pool behind its back.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

import numpy as np

from slora_jax.engine.host_tier import HostTier
from slora_jax.engine.pool import PagedPool
from slora_jax.lora.pool_rows import AdapterRows
from slora_jax.model.config import MODULES, ModelConfig

__all__ = ["LRU", "TIERS", "AdapterInUse", "AdapterStore", "EvictionPolicy", "NoRoom"]

log = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")  # where an adapter's weights are: the pool, host memory, only its source


class NoRoom(RuntimeError):
    """The pool cannot take the adapter even after evicting every unpinned one: wait until pins are released."""


class AdapterInUse(RuntimeError):
    """The adapter is pinned by running sequences, so it cannot be unregistered now."""


class EvictionPolicy(abc.ABC):
    """Which resident adapter the pool evicts first. The store tells it of every use and every unload; pins and
    protection are the store's business (it only asks about candidates it may evict)."""

    @abc.abstractmethod
    def mark_used(self, name: str) -> None:
        """``name`` was loaded, acquired or asked for by prefetch."""

    @abc.abstractmethod
    def forget(self, name: str) -> None:
        """``name`` left the pool."""

    @abc.abstractmethod
    def eviction_order(self, candidates: Collection[str]) -> Iterator[str]:
        """``candidates`` (resident adapters), the first to evict first."""


class LRU(EvictionPolicy):
    """Least recently used first."""

    def __init__(self):
        self._order: OrderedDict[str, None] = OrderedDict()  # least recently used first

    def mark_used(self, name):
        self._order[name] = None
        self._order.move_to_end(name)

    def forget(self, name):
        self._order.pop(name, None)

    def eviction_order(self, candidates):
        return (name for name in self._order if name in candidates)


@dataclasses.dataclass(slots=True)
class _Usage:
    """One adapter's pool-tier books for the residency API, O(1) per event."""

    loads: int = 0
    evictions: int = 0
    load_seconds: float = 0.0  # host seconds of its pool loads, summed (the device copy may still run after)
    last_load_seconds: float | None = None
    last_used: float | None = None  # unix time a request last acquired or released it


_UNUSED = _Usage()


def _timing(count: int, total: float, last: float | None) -> dict:
    return {"count": count, "mean": total / count if count else None, "last": last}


class AdapterStore:
    """Registered adapters, their host-memory cache and their residency in the pool (see the module docstring).

    ``host_budget_bytes`` bounds the host cache (``max_host_adapters`` optionally bounds its count too);
    ``max_rank`` (default: the pool's) is the largest rank ``register`` accepts; ``dtype`` is the host rows' dtype
    (default: the pool's, so staging a load is a plain copy); ``eviction`` the pool's eviction order (default LRU).
    """

    def __init__(self, model_cfg: ModelConfig, pool: PagedPool, *, host_budget_bytes: int, max_rank: int | None = None,
                 dtype=None, io_threads: int = 4, max_host_adapters: int | None = None, max_staged: int = 8,
                 eviction: EvictionPolicy | None = None, read_processes: int = 0):
        self.model_cfg, self.pool = model_cfg, pool
        self.host = HostTier(model_cfg, pool, host_budget_bytes=host_budget_bytes,
                             max_rank=pool.max_rank if max_rank is None else int(max_rank),
                             dtype=pool.dtype if dtype is None else dtype, io_threads=io_threads,
                             max_host_adapters=max_host_adapters, max_staged=max_staged,
                             read_processes=read_processes)
        self.eviction = LRU() if eviction is None else eviction
        self._resident: dict[str, int] = {}  # name -> pool pages
        self._pins: dict[str, int] = {}
        self._evictable_pages = 0  # pages of unpinned resident adapters
        self._counts: Counter[str] = Counter()
        self._explicit: dict[str, int] = {}  # an operator's pins (also counted in _pins): name -> count
        self._usage: dict[str, _Usage] = {}
        self._listeners: tuple[Callable[[str, str, float | None], None], ...] = ()
        self.host.on_read = lambda name, seconds: self._tell(name, "host_read", seconds)

    # ---- registration (thread-safe: host tier only) ---------------------------------------------------------

    def register(self, name: str, source, verify: bool = False) -> None:
        """Add an adapter (a PEFT dir path, a ``LoraAdapter`` or an ``AdapterSource``); see :meth:`HostTier.register`.

        ``verify``: read and check every weight now, on the calling thread (any thread), and keep the rows in host
        memory. Raises :class:`AdapterError` (naming the adapter and the reason) for one we could not serve,
        ValueError if the name is taken.
        """
        self.host.register(name, source, verify=verify)

    def register_dir(self, root: str | Path, *, strict: bool = False) -> list[str]:
        """Register every adapter dir under ``root``, failed ones as failed; see :meth:`HostTier.register_dir`."""
        return self.host.register_dir(root, strict=strict)

    def names(self) -> list[str]:
        return self.host.names()

    def __contains__(self, name: object) -> bool:
        return name in self.host

    def __len__(self) -> int:
        return len(self.host)

    def unregister(self, name: str) -> None:
        """Forget an adapter in every tier; raises :class:`AdapterInUse` while running sequences or explicit pins
        pin it."""
        if self._pins.get(name):
            explicit = self._explicit.get(name, 0)
            raise AdapterInUse(f"adapter {name!r} is pinned by {self._pins[name] - explicit} running sequence(s) and "
                               f"{explicit} explicit pin(s)")
        if name in self._resident:
            self._unload(name)
        self.host.unregister(name)
        self._usage.pop(name, None)

    # ---- pool tier ------------------------------------------------------------------------------------------

    def acquire(self, name: str) -> int:
        """Make the adapter resident (reading it from its source if needed, blocking) and pin it; returns its slot.

        Raises :class:`AdapterError` for an unknown or broken adapter, :class:`NoRoom` (nothing changed; its host
        read is started) when it cannot fit even after evicting every unpinned adapter.
        """
        slot = self._acquire(name)
        self._books(name).last_used = time.time()
        return slot

    def _acquire(self, name: str) -> int:
        if name in self._resident:
            self.eviction.mark_used(name)
            self._pin(name)
            self._counts["hits"] += 1
            return self.pool.slot_of(name)
        pages = self.host.usable_pages(name)
        if not self._room_for(pages):
            self.host.fetch(name)
            raise NoRoom(self._no_room_message(name, pages))
        rows = self.host.rows_now(name)
        pages = rows.pages_needed(self.pool.page_rows)
        if not self._make_room(pages):
            raise NoRoom(self._no_room_message(name, pages))
        slot = self._load(name, rows, wait_staged=True)
        self._pin(name)
        self._counts["misses"] += 1
        return slot

    def release(self, name: str) -> None:
        """Drop one pin; the adapter stays resident, as a cache, until a load needs its room."""
        self._drop_pin(name)
        self._books(name).last_used = time.time()

    def _drop_pin(self, name: str) -> None:
        count = self._pins.get(name, 0)
        if count <= 0:
            raise ValueError(f"adapter {name!r} is not pinned")
        if count == 1:
            del self._pins[name]
            self._evictable_pages += self._resident[name]
        else:
            self._pins[name] = count - 1

    def is_resident(self, name: str) -> bool:
        return name in self._resident

    def pin_count(self, name: str) -> int:
        """Pins of every kind: running sequences' and explicit ones."""
        return self._pins.get(name, 0)

    # ---- explicit pins (an operator's: the residency API) ----------------------------------------------------

    def check_pin(self, name: str, keep_free_pages: int = 0) -> None:
        """Raise :class:`NoRoom` if a first explicit pin of ``name`` would leave the explicitly pinned adapters all
        slots but one, or fewer than ``keep_free_pages`` pool pages to everything else (so requests of other
        adapters can always run); :class:`AdapterError` if it is unknown or failed."""
        pages = self.host.usable_pages(name)
        if self._explicit.get(name):
            return
        held = sum(self._resident[n] for n in self._explicit) + self._resident.get(name, pages)
        if len(self._explicit) + 1 >= self.pool.max_slots or held > self.pool.num_pages - keep_free_pages:
            raise NoRoom(f"pinning adapter {name!r} would leave {len(self._explicit) + 1} of {self.pool.max_slots} "
                         f"slots and {held} of {self.pool.num_pages} pool pages pinned; explicit pins must leave a "
                         f"slot and {keep_free_pages} pages to the others")

    def pin(self, name: str, keep_free_pages: int = 0) -> int:
        """Make ``name`` resident (blocking on its source if its rows are not in host memory) and keep it there until
        as many :meth:`unpin` calls; returns its explicit pin count. Raises as :meth:`check_pin` and :meth:`acquire`.
        """
        self.check_pin(name, keep_free_pages)
        self._acquire(name)
        self._explicit[name] = self._explicit.get(name, 0) + 1
        return self._explicit[name]

    def unpin(self, name: str) -> int:
        """Drop one explicit pin (ValueError if it has none); returns those left. Unpinned, it stays as a cache."""
        count = self._explicit.get(name, 0)
        if count <= 0:
            raise ValueError(f"adapter {name!r} has no explicit pin")
        if count == 1:
            del self._explicit[name]
        else:
            self._explicit[name] = count - 1
        self._drop_pin(name)
        return count - 1

    # ---- the residency API ----------------------------------------------------------------------------------

    def states(self, tier: str | None = None, names: Iterable[str] | None = None) -> list[dict]:
        """Each registered adapter (or those of ``names``; only those in ``tier`` of :data:`TIERS` if given) as a
        plain dict: its tier, size, pins, pool loads and evictions, last use (unix time), load times (pool loads and
        reads from the source: count, mean and last seconds) and failure reason (None if fine). O(adapters)."""
        out = []
        for name, h in self.host.describe(names).items():
            pages = self._resident.get(name)
            where = "device" if pages is not None else "host" if h["in_host"] else "disk"
            if tier is not None and where != tier:
                continue
            pages = h["pages"] if pages is None else pages
            use, pins, explicit = self._usage.get(name, _UNUSED), self._pins.get(name, 0), self._explicit.get(name, 0)
            out.append({"name": name, "tier": where, "rank": h["rank"], "targets": list(h["targets"]),
                        "pages": pages, "bytes": pages * self.pool.page_bytes, "pinned": pins > 0,
                        "request_pins": pins - explicit, "explicit_pins": explicit, "loads": use.loads,
                        "evictions": use.evictions, "last_used": use.last_used,
                        "load_seconds": {"pool": _timing(use.loads, use.load_seconds, use.last_load_seconds),
                                         "host": _timing(*h["reads"])},
                        "error": h["error"]})
        return out

    def add_listener(self, listener: Callable[[str, str, float | None], None]) -> None:
        """Thread-safe: ``listener(name, event, seconds)`` for every pool load (``"pool_load"``, its host seconds),
        eviction (``"eviction"``, None) and read from the source (``"host_read"``, seconds), on the engine thread or
        an IO thread. It must be cheap; an exception is logged, never raised."""
        self._listeners = (*self._listeners, listener)

    def resident(self) -> list[str]:
        """Resident adapters, the first to be evicted first (pinned ones included, in the policy's order)."""
        return list(self.eviction.eviction_order(self._resident))

    def pages_needed_to_load(self, name: str) -> int:
        """Pool pages the adapter would take if made resident now: 0 when resident, and 0 for unknown or failed
        adapters (their ``acquire`` raises the reason)."""
        return 0 if name in self._resident else self.host.pages_to_load(name)

    def adapter_pages(self, name: str) -> int:
        """Pool pages the adapter takes when resident (0 for unknown adapters)."""
        return self.host.pages(name)

    def evictable_pages(self) -> int:
        """Pages held by unpinned resident adapters: what eviction could hand back."""
        return self._evictable_pages

    def reclaim_pages(self, n_pages: int) -> bool:
        """Evict unpinned adapters (in eviction order) until ``n_pages`` pages are free, e.g. for KV.

        All or nothing: returns False, evicting nothing, if even evicting every unpinned adapter is not enough.
        """
        if self.pool.num_free_pages >= n_pages:
            return True
        if self.pool.num_free_pages + self._evictable_pages < n_pages:
            return False
        for name in self._victims():
            if self.pool.num_free_pages >= n_pages:
                break
            self._evict(name)
        return True

    def prefetch(self, names: Iterable[str], *, keep_free_pages: int = 0, max_pool_loads: int | None = None) -> None:
        """Get the waiting queue's next adapters ready without blocking (``names``: head of the queue first).

        Host reads start for adapters not in host memory (each staged on the device by its IO thread after the
        read). Adapters in host memory whose staged pages are on the device are loaded into the pool if a slot and
        pages are free, evicting only unpinned adapters that are not in ``names`` (never pinned ones) and leaving
        ``keep_free_pages`` pages free; the others are staged on an IO thread and loaded by a later call (with
        staging off, ``max_staged=0``, or after a staging failed, they load here). Resident ones are marked used
        (the head of the queue last). Nothing is pinned.
        """
        names = list(dict.fromkeys(names))
        todo = []
        for name in reversed(names):  # the head of the queue ends most recently used
            if name in self._resident:
                self.eviction.mark_used(name)
            else:
                todo.append(name)
        if not todo:
            return
        todo.reverse()
        protect = set(names)
        loads = 0
        waiting: list[tuple[str, AdapterRows]] = []
        for name, rows in self.host.rows_or_read(todo):
            if not self.host.ready_to_load(name, rows):
                # copied to the device on an IO thread first (staged below, or in flight), loaded at a later call:
                # a copy on this thread would hold up the step the engine is about to build
                waiting.append((name, rows))
                continue
            if ((max_pool_loads is None or loads < max_pool_loads)
                    and self._make_room(rows.pages_needed(self.pool.page_rows), protect, keep_free_pages)):
                self._load(name, rows)
                self._counts["prefetch_loads"] += 1
                loads += 1
            else:
                waiting.append((name, rows))
        if waiting:  # not loadable yet: stage them on the IO threads so their load is cheap later
            self.host.stage(waiting)

    def read_ahead(self, names: Iterable[str]) -> None:
        """Start host reads for adapters further back in the waiting queue, only into free host room, so they never
        evict cached rows (or staged pages) of the queue's head; nothing else (see :meth:`HostTier.read_ahead`)."""
        self.host.read_ahead([name for name in names if name not in self._resident])

    def warmup(self) -> None:
        """Compile the pool's load / unload for every page-count bucket now, so serving never compiles.

        Loads and unloads a zero adapter per bucket into free pages (contents of free pages do not matter); a bucket
        that cannot be reached with the pages free now is skipped.
        """
        pool = self.pool
        if not pool.num_free_slots:
            return
        n_layers, n_mod = pool.num_layers, len(MODULES)
        buckets = sorted({pool.page_bucket(n) for n in range(1, pool.max_pages + 1)})
        for bucket in buckets:
            n_pages = min(bucket, pool.num_free_pages)
            if n_pages < 1 or pool.page_bucket(n_pages) != bucket:
                continue
            zeros_i = np.zeros((n_layers, n_mod), np.int32)
            rows = AdapterRows(
                name="<warmup>", vectors=np.zeros((n_layers, n_pages * pool.page_rows, pool.vec), pool.dtype),
                rank=zeros_i, a_off=zeros_i, b_off=zeros_i, scale=np.zeros((n_layers, n_mod), np.float32),
                layer_num_vectors=np.full(n_layers, n_pages * pool.page_rows, np.int64))
            pool.load_adapter("<warmup>", rows)
            pool.unload_adapter("<warmup>")

    # ---- stats / lifecycle ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Tier counts (pool / host / source only), host bytes, and hit / miss / eviction / load counters.

        ``hits`` / ``misses``: acquires that found the adapter resident / had to load it; ``evictions``: pool
        evictions; ``loads``: pool loads (``prefetch_loads`` of them by prefetch); ``host_*``: the host cache.
        """
        host = self.host.stats(elsewhere=self._resident)
        keys = ("hits", "misses", "evictions", "loads", "prefetch_loads", "staged_loads")
        return {
            "registered": host.pop("registered"),
            "resident": len(self._resident),
            "pinned": len(self._pins),
            "explicit_pins": sum(self._explicit.values()),
            "resident_pages": sum(self._resident.values()),
            "evictable_pages": self._evictable_pages,
            **{k: self._counts[k] for k in keys},
            **host,
        }

    def close(self, wait: bool = True) -> None:
        """Stop the IO threads; loads not yet started fail with 'store closed'."""
        self.host.close(wait)

    def __enter__(self) -> AdapterStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------------------

    def _victims(self, protect: Collection[str] = frozenset()) -> list[str]:
        """Unpinned resident adapters outside ``protect``, the first to evict first."""
        candidates = {n for n in self._resident if n not in self._pins and n not in protect}
        return list(self.eviction.eviction_order(candidates))

    def _room_for(self, pages: int, protect: Collection[str] = frozenset(), keep_free: int = 0) -> bool:
        if protect:
            victims = self._victims(protect)
            n_spare, spare_pages = len(victims), sum(self._resident[n] for n in victims)
        else:  # the common case, kept O(1)
            n_spare, spare_pages = len(self._resident) - len(self._pins), self._evictable_pages
        has_slot = self.pool.num_free_slots > 0 or n_spare > 0
        return has_slot and self.pool.num_free_pages - keep_free + spare_pages >= pages

    def _make_room(self, pages: int, protect: Collection[str] = frozenset(), keep_free: int = 0) -> bool:
        """Evict unpinned (and unprotected) adapters, in eviction order, until a load of ``pages`` fits; evicts
        nothing and returns False if it cannot fit at all."""
        if not self._room_for(pages, protect, keep_free):
            return False
        if self.pool.num_free_slots > 0 and self.pool.num_free_pages - keep_free >= pages:
            return True  # fits already: no need to order the victims
        for name in self._victims(protect):
            if self.pool.num_free_slots > 0 and self.pool.num_free_pages - keep_free >= pages:
                break
            self._evict(name)
        return True

    def _load(self, name: str, rows: AdapterRows, wait_staged: bool = False) -> int:
        """Load into the pool, using pages an IO thread staged when ready (``wait_staged``: or being staged now)."""
        t0 = time.perf_counter()
        staged = self.host.take_staged(name, rows, wait_staged)
        slot = self.pool.load_adapter(name, rows, staged)
        self.host.loaded(name)
        if staged is not None:
            self._counts["staged_loads"] += 1
        pages = len(self.pool.adapter_pages(name))
        self._resident[name] = pages
        self.eviction.mark_used(name)
        self._evictable_pages += pages
        self._counts["loads"] += 1
        seconds = time.perf_counter() - t0
        use = self._books(name)
        use.loads, use.load_seconds, use.last_load_seconds = use.loads + 1, use.load_seconds + seconds, seconds
        self._tell(name, "pool_load", seconds)
        return slot

    def _evict(self, name: str) -> None:
        self._unload(name)
        self._counts["evictions"] += 1
        self._books(name).evictions += 1
        self._tell(name, "eviction", None)

    def _books(self, name: str) -> _Usage:
        use = self._usage.get(name)
        if use is None:
            use = self._usage[name] = _Usage()
        return use

    def _tell(self, name: str, event: str, seconds: float | None) -> None:
        for listener in self._listeners:
            try:
                listener(name, event, seconds)
            except Exception:  # noqa: BLE001 - a metrics hook must not fail a load
                log.exception("adapter event listener failed")

    def _unload(self, name: str) -> None:
        assert not self._pins.get(name), f"unloading pinned adapter {name!r}"
        self.pool.unload_adapter(name)
        self._evictable_pages -= self._resident.pop(name)
        self.eviction.forget(name)

    def _pin(self, name: str) -> None:
        count = self._pins.get(name, 0)
        if count == 0:
            self._evictable_pages -= self._resident[name]
        self._pins[name] = count + 1

    def _no_room_message(self, name: str, pages: int) -> str:
        return (f"adapter {name!r} needs {pages} pages and a slot; free: {self.pool.num_free_pages} pages, "
                f"{self.pool.num_free_slots} slots; evictable: {self._evictable_pages} pages in "
                f"{len(self._resident) - len(self._pins)} unpinned adapters ({len(self._pins)} pinned)")
