"""The adapter store: every registered adapter lives on disk (or in memory); a byte-budgeted LRU of them is kept on
the host already laid out as pool rows; only the adapters the running batch needs sit in the device pool.

Three tiers, after S-LoRA:

* **source** (disk / in-memory / synthetic): never evicted; registering only validates cheaply (config, shapes).
* **host**: ``AdapterRows`` in the pool dtype, so moving one to the device is a plain copy. Reads from the source
  run on a thread pool (``fetch_to_host``) so the engine thread never waits on disk unless it has to.
* **pool**: resident adapters, each pinned (refcounted) while a running sequence uses it; unpinned ones stay as a
  cache and are evicted least-recently-used when a load needs a slot or pages. A pinned adapter is never evicted.

``prefetch`` is called right after the engine dispatches a step: it starts host loads for the head of the waiting
queue and turns host-ready adapters into pool loads, which are async JAX dispatches that overlap the running step.
Adapters it asks for are also *staged* on the IO threads (``PagedPool.stage``: padded to the page bucket and copied
to the device, right after the host read, or as a job of its own when already in host memory), so the later pool
load on the engine thread is only the scatter and table update. Staged pages are keyed by (entry, host rows object),
so they never serve another adapter or a re-registered name, and are dropped once loaded, when the rows leave the
host tier, on unregister / retry, and beyond ``max_staged`` held (oldest first), bounding the device memory they use.

Threading: the engine thread calls every public method; the IO workers only run ``_run_load``. Everything both
touch (registrations, host cache, in-flight loads, load errors, IO counters) is guarded by ``_lock``; the pool-tier
books (``_lru``, ``_pins``) are engine-thread only. The store owns adapter residency: do not load or unload adapters
on the pool behind its back.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pallas_kernels.lora_common import pack_offsets
from slora_jax.engine.pool import PagedPool, StagedPages
from slora_jax.lora.peft import (
    AdapterError,
    _check_config,
    _pattern_value,
    _targets,
    load_peft_adapter,
    read_adapter_config,
)
from slora_jax.lora.pool_rows import AdapterRows, to_pool_rows
from slora_jax.model.adapter_weights import LoraAdapter, LoraModule
from slora_jax.model.config import ATTN_MODULES, MODULE_INDEX, MODULES, ModelConfig, module_key

__all__ = [
    "AdapterError",
    "AdapterInUse",
    "AdapterSource",
    "AdapterStore",
    "InMemorySource",
    "NoRoom",
    "PeftDirSource",
    "SyntheticAdapterSource",
    "adapter_from_rows",
    "as_source",
    "synthetic_adapter",
]

log = logging.getLogger(__name__)


class NoRoom(RuntimeError):
    """The pool cannot take the adapter even after evicting every unpinned one: wait until pins are released."""


class AdapterInUse(RuntimeError):
    """The adapter is pinned by running sequences, so it cannot be unregistered now."""


# ----------------------------------------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------------------------------------


class AdapterSource(abc.ABC):
    """Where an adapter's weights come from. ``rank_table`` must be cheap (it runs at register time, on the engine
    thread); ``load_rows`` does the real work on an IO thread. Both raise :class:`AdapterError` for bad adapters."""

    @abc.abstractmethod
    def rank_table(self, name: str, model_cfg: ModelConfig, max_rank: int) -> np.ndarray:
        """Validate without reading weights; int32[L, len(MODULES)] ranks (0 = not adapted)."""

    @abc.abstractmethod
    def load_rows(self, name: str, model_cfg: ModelConfig, max_rank: int, dtype) -> AdapterRows:
        """The adapter laid out for the pool, vectors in ``dtype``."""


def _rank_table_from_pairs(ranks: dict[tuple[int, str], int], model_cfg: ModelConfig) -> np.ndarray:
    table = np.zeros((model_cfg.num_hidden_layers, len(MODULES)), np.int32)
    for (layer, module), r in ranks.items():
        table[layer, MODULE_INDEX[module]] = r
    return table


@dataclasses.dataclass(frozen=True)
class PeftDirSource(AdapterSource):
    """A PEFT LoRA dir (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def rank_table(self, name, model_cfg, max_rank):
        cfg = read_adapter_config(self.path, name)
        try:
            _check_config(cfg, name, max_rank)
            pairs = _targets(cfg, name, model_cfg.num_hidden_layers)
            r_default, pattern = cfg.get("r", 8), cfg.get("rank_pattern") or {}
            ranks = {}
            for layer, module in pairs:
                r = _pattern_value(pattern, module_key(layer, module), r_default)
                if not isinstance(r, int) or isinstance(r, bool) or r < 1:
                    raise AdapterError(name, f"{module_key(layer, module)} has rank {r!r}; ranks must be ints >= 1")
                if r > max_rank:
                    raise AdapterError(name, f"{module_key(layer, module)} has rank {r}, above the maximum {max_rank}")
                ranks[(layer, module)] = r
        except AdapterError:
            raise
        except Exception as e:  # malformed values (wrong types) in an otherwise valid JSON object
            raise AdapterError(name, f"invalid adapter_config.json: {type(e).__name__}: {e}") from None
        if not (self.path / "adapter_model.safetensors").is_file():
            raise AdapterError(name, f"missing adapter_model.safetensors in {self.path}")
        return _rank_table_from_pairs(ranks, model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        adapter = load_peft_adapter(self.path, model_cfg, name, max_rank)
        return to_pool_rows(adapter, model_cfg, dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class InMemorySource(AdapterSource):
    """An already-built :class:`LoraAdapter` (tests, adapters made in-process); kept referenced as the source tier."""

    adapter: LoraAdapter

    def rank_table(self, name, model_cfg, max_rank):
        ranks = {}
        for key, mod in self.adapter.modules.items():
            layer, module = key
            if module not in MODULE_INDEX:
                raise AdapterError(name, f"unknown module {module!r} (supported: {', '.join(MODULES)})")
            if not 0 <= layer < model_cfg.num_hidden_layers:
                raise AdapterError(name, f"layer {layer} outside the model's {model_cfg.num_hidden_layers} layers")
            d_in, d_out = model_cfg.module_dims(module)
            r = mod.a.shape[1] if mod.a.ndim == 2 else -1
            if mod.a.shape != (d_in, r) or mod.b.shape != (r, d_out):
                raise AdapterError(name, f"layer {layer} {module}: a {mod.a.shape} / b {mod.b.shape} do not match "
                                         f"[d_in={d_in}, r] / [r, d_out={d_out}]")
            if r > max_rank:
                raise AdapterError(name, f"layer {layer} {module} has rank {r}, above the maximum {max_rank}")
            if not math.isfinite(mod.scale):
                raise AdapterError(name, f"layer {layer} {module} has a non-finite scale {mod.scale}")
            ranks[key] = r
        return _rank_table_from_pairs(ranks, model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        for (layer, module), mod in self.adapter.modules.items():
            if not (np.isfinite(mod.a).all() and np.isfinite(mod.b).all()):
                raise AdapterError(name, f"layer {layer} {module} has non-finite weights (NaN or inf)")
        try:
            rows = to_pool_rows(self.adapter, model_cfg, dtype)
        except ValueError as e:
            raise AdapterError(name, str(e)) from None
        rows.name = name
        return rows


# Synthetic adapters are read-only windows of a shared bank of random normals (one bank per dtype and size), so making
# one costs no random draws and no copy (Llama-2-7B rank 64 on all 7 projections is 305 MiB of bf16). Distinct seeds
# pick distinct windows. Every layer has the same targets, hence the same vector count: one strided view covers all.
_BANK_SEED = 0x5EED_10A
_MIN_BANK = 1 << 23
_banks: dict[tuple[str, int], np.ndarray] = {}
_banks_lock = threading.Lock()


def _random_bank(dtype: np.dtype, length: int) -> np.ndarray:
    key = (dtype.name, length)
    with _banks_lock:
        bank = _banks.get(key)
        if bank is None:
            rng = np.random.default_rng(_BANK_SEED)
            bank = rng.standard_normal(length, dtype=np.float32).astype(dtype)
            bank.flags.writeable = False
            _banks[key] = bank
        return bank


@dataclasses.dataclass(frozen=True, eq=False)
class SyntheticAdapterSource(AdapterSource):
    """Distinct random adapters from a seed, made straight in pool-row layout (for benchmarks with thousands of
    adapters that would not fit on disk). Same (model shape, rank, targets, seed, dtype) -> same weights.

    A and B are unit normal; ``scale = strength / sqrt(rank * d_in)`` so the delta is about ``strength`` times the
    input's RMS, whatever the shapes. The rows are a view of a shared bank (no memory of their own) unless
    ``materialize``; the host budget counts their full size either way, so host-tier behaviour is as with real ones.
    """

    model_cfg: ModelConfig
    rank: int
    targets: tuple[str, ...] = ATTN_MODULES
    seed: int = 0
    strength: float = 0.3
    materialize: bool = False  # own a copy of the rows (real host memory per adapter) instead of a view of the bank

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))

    def rank_table(self, name, model_cfg, max_rank):
        if _shape_key(self.model_cfg) != _shape_key(model_cfg):
            raise AdapterError(name, "synthetic source was made for a model of a different shape")
        unknown = [t for t in self.targets if t not in MODULE_INDEX]
        if unknown:
            raise AdapterError(name, f"unknown target module(s) {unknown} (supported: {', '.join(MODULES)})")
        if not 1 <= self.rank <= max_rank:
            raise AdapterError(name, f"rank {self.rank} is outside 1..{max_rank}")
        layers = range(model_cfg.num_hidden_layers)
        return _rank_table_from_pairs({(layer, t): self.rank for layer in layers for t in self.targets}, model_cfg)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        dtype = np.dtype(dtype)
        rank = self.rank_table(name, model_cfg, max_rank)
        vec = model_cfg.head_dim
        a_off, b_off, per_layer = pack_offsets(rank, [model_cfg.module_dims(m) for m in MODULES], vec)
        n_vectors = int(per_layer.max(initial=0))
        count, n_layers = n_vectors * vec, len(per_layer)
        bank = _random_bank(dtype, max(_MIN_BANK, 1 << (2 * count - 1).bit_length()))
        # Layer l is the window at base + l * step: a strided view, so making an adapter costs no copy at all.
        rng = np.random.default_rng(self.seed)
        step = int(rng.integers(1, (bank.size - count) // max(n_layers - 1, 1) + 1))
        base = int(rng.integers(0, bank.size - count - (n_layers - 1) * step + 1))
        vectors = np.lib.stride_tricks.as_strided(bank[base:], shape=(n_layers, n_vectors, vec),
                                                  strides=(step * dtype.itemsize, vec * dtype.itemsize, dtype.itemsize),
                                                  writeable=False)
        if self.materialize:
            vectors = vectors.copy()
        d_in = np.array([model_cfg.module_dims(m)[0] for m in MODULES], np.float32)
        scale = np.where(rank > 0, self.strength / np.sqrt(np.maximum(rank, 1) * d_in), 0).astype(np.float32)
        return AdapterRows(name=name, vectors=vectors, rank=rank, a_off=a_off, b_off=b_off, scale=scale,
                           layer_num_vectors=per_layer)

    def adapter(self, name: str, dtype=np.float32) -> LoraAdapter:
        """The same weights as a float32 :class:`LoraAdapter` (values rounded through ``dtype``), for checks."""
        rows = self.load_rows(name, self.model_cfg, max(self.rank, 1), dtype)
        return adapter_from_rows(rows, self.model_cfg)


def synthetic_adapter(cfg: ModelConfig, name: str, rank: int, targets: Iterable[str] = ATTN_MODULES, seed: int = 0,
                      strength: float = 0.3) -> LoraAdapter:
    """A random :class:`LoraAdapter` equal to what ``SyntheticAdapterSource(cfg, rank, targets, seed)`` serves."""
    return SyntheticAdapterSource(cfg, rank, tuple(targets), seed, strength).adapter(name)


def adapter_from_rows(rows: AdapterRows, cfg: ModelConfig) -> LoraAdapter:
    """Inverse of ``to_pool_rows``: float32 ``a [d_in, r]`` / ``b [r, d_out]`` per adapted module."""
    vec = cfg.head_dim
    modules = {}
    for layer, m in zip(*np.nonzero(rows.rank), strict=True):
        module = MODULES[m]
        r, (d_in, d_out) = int(rows.rank[layer, m]), cfg.module_dims(module)
        a0, b0 = int(rows.a_off[layer, m]), int(rows.b_off[layer, m])
        a_t = rows.vectors[layer, a0 : a0 + r * (d_in // vec)].reshape(r, d_in)
        b = rows.vectors[layer, b0 : b0 + r * (d_out // vec)].reshape(r, d_out)
        modules[(int(layer), module)] = LoraModule(a=np.ascontiguousarray(a_t.T, np.float32),
                                                   b=np.asarray(b, np.float32), scale=float(rows.scale[layer, m]))
    return LoraAdapter(name=rows.name, modules=modules)


def _shape_key(cfg: ModelConfig) -> tuple:
    return tuple(cfg.module_dims(m) for m in MODULES) + (cfg.num_hidden_layers, cfg.head_dim)


def as_source(source) -> AdapterSource:
    """A path is a PEFT dir, a :class:`LoraAdapter` is in-memory; sources pass through."""
    if isinstance(source, AdapterSource):
        return source
    if isinstance(source, LoraAdapter):
        return InMemorySource(source)
    if isinstance(source, (str, Path)):
        return PeftDirSource(Path(source))
    raise TypeError(f"cannot make an adapter source from {type(source).__name__}")


# ----------------------------------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Entry:
    name: str
    source: AdapterSource
    pages: int  # pool pages once resident (from the rank table; refreshed from the real rows after a load)


@dataclasses.dataclass(eq=False)
class _HostLoad:
    """One read of an adapter from its source. Whoever claims it first runs it: an IO worker, or ``acquire`` inline
    when it would otherwise wait behind other queued loads."""

    entry: _Entry
    future: Future
    claimed: bool = False


@dataclasses.dataclass(eq=False)
class _Staging:
    """Device staging of one adapter's host rows for its next pool load. ``rows`` is None while waiting for the host
    read (the IO worker stages right after it); whoever claims it first runs it, and the future gives StagedPages."""

    entry: _Entry
    rows: AdapterRows | None
    future: Future
    claimed: bool = False


def _rows_nbytes(rows: AdapterRows) -> int:
    return sum(a.nbytes for a in (rows.vectors, rows.rank, rows.a_off, rows.b_off, rows.scale, rows.layer_num_vectors))


def _finish(future: Future, result=None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # a caller cancelled its future; nothing is waiting for it
        pass


def _done(result=None, error: BaseException | None = None) -> Future:
    future: Future = Future()
    _finish(future, result, error)
    return future


class AdapterStore:
    """Registered adapters, their host-memory cache and their residency in the pool (see the module docstring).

    ``host_budget_bytes`` bounds the host cache (``max_host_adapters`` optionally bounds its count too);
    ``max_rank`` (default: the pool's) is the largest rank ``register`` accepts; ``dtype`` is the host rows' dtype
    (default: the pool's, so staging a load is a plain copy).
    """

    def __init__(self, model_cfg: ModelConfig, pool: PagedPool, *, host_budget_bytes: int, max_rank: int | None = None,
                 dtype=None, io_threads: int = 4, max_host_adapters: int | None = None, max_staged: int = 8):
        if _shape_key(model_cfg) != _shape_key(pool.config):
            raise ValueError("model config and pool config describe different model shapes")
        max_rank = pool.max_rank if max_rank is None else int(max_rank)
        if not 1 <= max_rank <= pool.max_rank:
            raise ValueError(f"max_rank {max_rank} must be in 1..{pool.max_rank} (the pool's max_rank)")
        if (host_budget_bytes < 0 or io_threads < 1 or max_staged < 0
                or (max_host_adapters is not None and max_host_adapters < 0)):
            raise ValueError("host_budget_bytes, max_host_adapters, max_staged must be >= 0 and io_threads >= 1")
        self.model_cfg, self.pool = model_cfg, pool
        self.max_rank = max_rank
        self.dtype = np.dtype(pool.dtype if dtype is None else dtype)
        self.host_budget_bytes = int(host_budget_bytes)
        self.max_host_adapters = max_host_adapters
        self.max_staged = int(max_staged)  # adapters staged on the device ahead of their pool load, at most
        self._widths = np.array([sum(model_cfg.module_dims(m)) // model_cfg.head_dim for m in MODULES], np.int64)

        self._lock = threading.Lock()
        # guarded by _lock (IO workers touch these)
        self._entries: dict[str, _Entry] = {}
        self._errors: dict[str, AdapterError] = {}
        self._host: OrderedDict[str, AdapterRows] = OrderedDict()  # least recently used first
        self._host_sizes: dict[str, int] = {}
        self._host_bytes = 0
        self._loads: dict[str, _HostLoad] = {}
        self._staged: OrderedDict[str, _Staging] = OrderedDict()  # oldest first
        self._stage_failed: set[str] = set()  # staging raised: prefetch loads these inline (cleared by a pool load)
        self._io_counts: Counter[str] = Counter()
        # engine thread only
        self._lru: OrderedDict[str, int] = OrderedDict()  # resident name -> pages, least recently used first
        self._pins: dict[str, int] = {}
        self._evictable_pages = 0  # pages of unpinned resident adapters
        self._counts: Counter[str] = Counter()
        self._executor = ThreadPoolExecutor(io_threads, thread_name_prefix="adapter-io")
        self._closed = False

    # ---- registration ---------------------------------------------------------------------------------------

    def register(self, name: str, source, verify: bool = False) -> None:
        """Add an adapter (a PEFT dir path, a ``LoraAdapter`` or an ``AdapterSource``) after a cheap validation.

        ``verify``: read and check every weight now, on the calling thread (any thread), and keep the rows in host
        memory. Raises :class:`AdapterError` (naming the adapter and the reason) for one we could not serve,
        ValueError if the name is taken.
        """
        entry = self._validated_entry(name, as_source(source))
        rows = None
        if verify:
            rows = entry.source.load_rows(name, self.model_cfg, self.max_rank, self.dtype)
            rows.name = name
            entry.pages = rows.pages_needed(self.pool.page_rows)
        with self._lock:
            if name in self._entries:
                raise ValueError(f"adapter {name!r} is already registered; unregister it first")
            self._entries[name] = entry
            if rows is not None:
                self._insert_host(name, rows)

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
                entry, error = _Entry(sub.name, source, 0), e
            with self._lock:
                if sub.name in self._entries:
                    raise ValueError(f"adapter {sub.name!r} is already registered; unregister it first")
                self._entries[sub.name] = entry
                if error is not None:
                    self._errors[sub.name] = error
            added.append(sub.name)
        return added

    def unregister(self, name: str) -> None:
        """Forget an adapter in every tier; raises :class:`AdapterInUse` while a running sequence pins it."""
        if self._pins.get(name):
            raise AdapterInUse(f"adapter {name!r} is pinned by {self._pins[name]} running sequence(s)")
        if name in self._lru:
            self._unload(name)
        with self._lock:
            if self._entries.pop(name, None) is None:
                raise KeyError(f"adapter {name!r} is not registered")
            self._errors.pop(name, None)
            self._stage_failed.discard(name)
            self._drop_host(name)
            self._drop_staged(name)
            load = self._loads.pop(name, None)
            if load is not None and not load.claimed:
                load.claimed = True
                _finish(load.future, error=AdapterError(name, "unregistered while loading"))

    def retry(self, name: str) -> None:
        """Clear a recorded failure (after the files were fixed): validate again; the next use reloads."""
        entry = self._entry(name)
        fresh = self._validated_entry(name, entry.source)
        with self._lock:
            if self._entries.get(name) is entry:
                self._entries[name] = fresh
                self._errors.pop(name, None)
                self._drop_staged(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def errors(self) -> dict[str, str]:
        """Name -> reason of every adapter that failed validation or loading."""
        with self._lock:
            return {name: e.reason for name, e in self._errors.items()}

    def error_of(self, name: str) -> AdapterError | None:
        with self._lock:
            return self._errors.get(name)

    # ---- host tier ------------------------------------------------------------------------------------------

    def fetch_to_host(self, name: str) -> Future:
        """Future of the adapter's host rows: done at once if cached or failed, else read on an IO thread.

        The future raises the adapter's :class:`AdapterError` if it cannot be loaded; that error is recorded so
        later requests fail the same way without re-reading (until :meth:`retry`).
        """
        entry = self._entry(name)
        with self._lock:
            return self._fetch_locked(entry)

    def in_host(self, name: str) -> bool:
        with self._lock:
            return name in self._host

    def _fetch_locked(self, entry: _Entry) -> Future:
        name = entry.name
        error = self._errors.get(name)
        if error is not None:
            return _done(error=error)
        rows = self._host.get(name)
        if rows is not None:
            self._host.move_to_end(name)
            self._io_counts["host_hits"] += 1
            return _done(rows)
        load = self._loads.get(name)
        if load is None and self._closed:
            return _done(error=AdapterError(name, "adapter store closed"))
        return load.future if load is not None else self._start_read_locked(entry)

    def _start_read_locked(self, entry: _Entry) -> Future:
        self._io_counts["host_misses"] += 1
        load = self._loads[entry.name] = _HostLoad(entry, Future())
        self._executor.submit(self._run_load, load)
        return load.future

    def read_ahead(self, names: Iterable[str]) -> None:
        """Engine thread: start host reads for adapters further back in the waiting queue, only into free host room
        (budget and count, counting reads in flight), so they never evict cached rows (or staged pages) of the
        queue's head; nothing else (no staging, no pool loads, no LRU moves)."""
        with self._lock:
            if self._closed:
                return
            page_bytes = self.pool.page_bytes  # rows of an adapter of n pool pages take at most n * page_bytes
            in_flight = sum(load.entry.pages for load in self._loads.values()) * page_bytes
            room = self.host_budget_bytes - self._host_bytes - in_flight
            slots = (None if self.max_host_adapters is None
                     else self.max_host_adapters - len(self._host) - len(self._loads))
            for name in dict.fromkeys(names):
                entry = self._entries.get(name)
                if (entry is None or name in self._lru or name in self._host or name in self._loads
                        or name in self._errors):
                    continue
                size = entry.pages * page_bytes
                if size > room or (slots is not None and slots < 1):
                    break  # in queue order: what does not fit now is read when it gets nearer the head
                self._start_read_locked(entry)
                self._io_counts["read_aheads"] += 1
                room -= size
                slots = None if slots is None else slots - 1

    def _run_load(self, load: _HostLoad, inline: bool = False) -> None:
        """Read one adapter from its source (IO thread, or inline from ``acquire``); never raises for bad adapters.

        On an IO thread, an adapter ``prefetch`` asked for is also staged on the device before its rows are
        published, so prefetch never sees its rows without its staged pages."""
        with self._lock:
            if load.claimed:
                return
            load.claimed = True
        entry, name = load.entry, load.entry.name
        rows, error, staging = None, None, None
        try:
            rows = entry.source.load_rows(name, self.model_cfg, self.max_rank, self.dtype)
            rows.name = name
            if rows.max_rank > self.max_rank:
                raise AdapterError(name, f"rank {rows.max_rank} is above the maximum {self.max_rank}")
            staging = None if inline else self._claim_staging_after_read(entry)
        except AdapterError as e:
            error = e
        except Exception as e:  # any failure of one adapter's read must not escape into the engine
            error = AdapterError(name, f"load failed: {type(e).__name__}: {e}")
        except BaseException as e:  # interrupted inline: leave no load claimed forever
            with self._lock:
                if self._loads.get(name) is load:
                    del self._loads[name]
            _finish(load.future, error=e)
            raise
        staged = None
        if error is None and staging is not None:
            try:
                staged = self._stage_or_none(name, rows)
            except BaseException as e:  # leave no staging claimed but never finished
                with self._lock:
                    if self._staged.get(name) is staging:
                        del self._staged[name]
                    if self._loads.get(name) is load:
                        del self._loads[name]
                _finish(staging.future, error=e)
                _finish(load.future, error=e)
                raise
        with self._lock:
            if self._loads.get(name) is load:
                del self._loads[name]
            current = self._entries.get(name) is entry
            if error is not None:
                self._io_counts["load_errors"] += 1
                if current:
                    self._errors[name] = error
            else:
                self._io_counts["host_loads"] += 1
                if current:
                    entry.pages = rows.pages_needed(self.pool.page_rows)
                    self._insert_host(name, rows)
            if staging is not None:
                if staged is not None and self._staged.get(name) is staging and self._host.get(name) is rows:
                    staging.rows = rows
                else:  # failed, unregistered, dropped meanwhile, or not kept in host memory: useless
                    if self._staged.get(name) is staging:
                        del self._staged[name]
                    staged = None
        if staging is not None:
            _finish(staging.future, staged, None if staged is not None else AdapterError(name, "not staged"))
        if error is not None:
            log.warning("%s", error)
        _finish(load.future, rows, error)

    def _insert_host(self, name: str, rows: AdapterRows) -> None:
        """Cache rows, evicting least recently used ones over budget; rows larger than the budget are not kept."""
        size = _rows_nbytes(rows)
        if size > self.host_budget_bytes or self.max_host_adapters == 0:
            self._io_counts["host_too_large"] += 1
            return
        self._drop_host(name, keep_staged=True)  # the caller settles this name's staging
        self._host[name], self._host_sizes[name] = rows, size
        self._host_bytes += size
        while self._host_bytes > self.host_budget_bytes or (
                self.max_host_adapters is not None and len(self._host) > self.max_host_adapters):
            oldest = next(iter(self._host))
            self._drop_host(oldest)
            self._io_counts["host_evictions"] += 1

    def _drop_host(self, name: str, keep_staged: bool = False) -> None:
        if self._host.pop(name, None) is not None:
            self._host_bytes -= self._host_sizes.pop(name)
        if not keep_staged:
            self._drop_staged(name)

    # ---- device staging (under _lock unless said otherwise) -------------------------------------------------

    def _drop_staged(self, name: str) -> None:
        staging = self._staged.pop(name, None)
        if staging is not None:
            staging.claimed = True  # a queued job will not run; a running one finishes into a future nobody reads

    def _want_staged(self, entry: _Entry, rows: AdapterRows | None) -> None:
        """Stage ``entry`` for its next load: after its host read (``rows`` None) or now on an IO thread."""
        name = entry.name
        staging = self._staged.get(name)
        if staging is not None and staging.entry is entry and (
                (rows is not None and staging.rows is rows)  # staged, or being staged, from these very rows
                or (staging.rows is None and (rows is None or staging.claimed))):  # staged by the IO read
            self._staged.move_to_end(name)
            return
        if self.max_staged == 0 or self._closed:
            return
        self._drop_staged(name)
        staging = self._staged[name] = _Staging(entry, rows, Future())
        if rows is not None:
            self._executor.submit(self._run_stage, staging)
        while len(self._staged) > self.max_staged:
            self._drop_staged(next(iter(self._staged)))
            self._io_counts["staged_dropped"] += 1

    def _claim_staging_after_read(self, entry: _Entry) -> _Staging | None:
        """IO thread, lock not held: the staging waiting for this host read, now claimed by the caller."""
        with self._lock:
            staging = self._staged.get(entry.name)
            if staging is None or staging.entry is not entry or staging.rows is not None or staging.claimed:
                return None
            staging.claimed = True
            return staging

    def _stage_or_none(self, name: str, rows: AdapterRows) -> StagedPages | None:
        """IO thread, lock not held: ``pool.stage`` (blocking until on the device); None if it failed."""
        try:
            staged = self.pool.stage(rows)
        except Exception as e:  # e.g. device memory short: the load will stage inline instead
            log.warning("staging adapter %r failed: %s: %s", name, type(e).__name__, e)
            with self._lock:
                self._stage_failed.add(name)  # prefetch loads it inline rather than asking for staging forever
            return None
        with self._lock:
            self._io_counts["stagings"] += 1
        return staged

    def _run_stage(self, staging: _Staging) -> None:
        """IO thread: stage rows already in host memory (a job of its own)."""
        with self._lock:
            if staging.claimed:
                return
            staging.claimed = True
        name = staging.entry.name
        staged = self._stage_or_none(name, staging.rows)
        if staged is None:
            with self._lock:
                if self._staged.get(name) is staging:
                    del self._staged[name]
        _finish(staging.future, staged, None if staged is not None else AdapterError(name, "not staged"))

    def _staging_of_locked(self, staging: _Staging | None, name: str, rows: AdapterRows) -> bool:
        """``staging`` was made from exactly ``rows`` of ``name``'s current registration."""
        return staging is not None and staging.rows is rows and staging.entry is self._entries.get(name)

    def _staged_ready(self, name: str, rows: AdapterRows) -> bool:
        """Engine thread: pages staged from exactly these rows are on the device now."""
        with self._lock:
            staging = self._staged.get(name)
            return self._staging_of_locked(staging, name, rows) and staging.future.done()

    def _take_staged(self, name: str, rows: AdapterRows, wait: bool) -> StagedPages | None:
        """Engine thread, lock not held: this adapter's staged pages if made from exactly ``rows`` of its current
        registration and ready (or, with ``wait``, being made on an IO thread right now); the staging is used up."""
        with self._lock:
            staging = self._staged.pop(name, None)
            if staging is None:
                return None
            if not self._staging_of_locked(staging, name, rows) or not staging.claimed:
                staging.claimed = True  # not started: cheaper to stage inline than to wait in the queue
                return None
        if not staging.future.done() and not wait:
            return None
        try:
            return staging.future.result()
        except Exception:
            return None

    # ---- pool tier ------------------------------------------------------------------------------------------

    def acquire(self, name: str) -> int:
        """Make the adapter resident (reading it from its source if needed, blocking) and pin it; returns its slot.

        Raises :class:`AdapterError` for an unknown or broken adapter, :class:`NoRoom` (nothing changed; its host
        read is started) when it cannot fit even after evicting every unpinned adapter.
        """
        if name in self._lru:
            self._lru.move_to_end(name)
            self._pin(name)
            self._counts["hits"] += 1
            return self.pool.slot_of(name)
        entry = self._entry(name)
        error = self.error_of(name)
        if error is not None:
            raise error
        if not self._room_for(entry.pages):
            self.fetch_to_host(name)
            raise NoRoom(self._no_room_message(name, entry.pages))
        rows = self._host_rows_blocking(entry)
        pages = rows.pages_needed(self.pool.page_rows)
        if not self._make_room(pages):
            raise NoRoom(self._no_room_message(name, pages))
        slot = self._load(name, rows, wait_staged=True)
        self._pin(name)
        self._counts["misses"] += 1
        return slot

    def release(self, name: str) -> None:
        """Drop one pin; the adapter stays resident (most recently used) until a load needs its room."""
        count = self._pins.get(name, 0)
        if count <= 0:
            raise ValueError(f"adapter {name!r} is not pinned")
        if count == 1:
            del self._pins[name]
            self._evictable_pages += self._lru[name]
        else:
            self._pins[name] = count - 1

    def is_resident(self, name: str) -> bool:
        return name in self._lru

    def pin_count(self, name: str) -> int:
        return self._pins.get(name, 0)

    def slot_of(self, name: str) -> int:
        return self.pool.slot_of(name)

    def resident(self) -> list[str]:
        """Resident adapters, least recently used first (the eviction order among unpinned ones)."""
        return list(self._lru)

    def pages_needed_to_load(self, name: str) -> int:
        """Pool pages the adapter would take if made resident now: 0 when resident, and 0 for unknown or failed
        adapters (their ``acquire`` raises the reason)."""
        if name in self._lru:
            return 0
        entry = self._entries.get(name)
        return 0 if entry is None or name in self._errors else entry.pages

    def adapter_pages(self, name: str) -> int:
        """Pool pages the adapter takes when resident (0 for unknown adapters)."""
        entry = self._entries.get(name)
        return 0 if entry is None else entry.pages

    def evictable_pages(self) -> int:
        """Pages held by unpinned resident adapters: what eviction could hand back."""
        return self._evictable_pages

    def can_make_resident(self, names: Iterable[str], free_pages_budget: int | None = None) -> bool:
        """Whether all of ``names`` could be resident at once, evicting only unpinned adapters outside ``names``.

        ``free_pages_budget`` is how many free pages adapters may take (default: all free pages of the pool); the
        scheduler passes less to keep KV room. Unknown / failed names are ignored (acquire reports them).
        """
        wanted = dict.fromkeys(names)
        missing = [n for n in wanted if n not in self._lru and n in self._entries and n not in self._errors]
        need_pages = sum(self._entries[n].pages for n in missing)
        spare = [p for n, p in self._lru.items() if n not in self._pins and n not in wanted]
        budget = self.pool.num_free_pages if free_pages_budget is None else int(free_pages_budget)
        return len(missing) <= self.pool.num_free_slots + len(spare) and need_pages <= budget + sum(spare)

    def reclaim_pages(self, n_pages: int) -> bool:
        """Evict unpinned adapters (least recently used first) until ``n_pages`` pages are free, e.g. for KV.

        All or nothing: returns False, evicting nothing, if even evicting every unpinned adapter is not enough.
        """
        if self.pool.num_free_pages >= n_pages:
            return True
        if self.pool.num_free_pages + self._evictable_pages < n_pages:
            return False
        for name in [n for n in self._lru if n not in self._pins]:
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
        staging off, ``max_staged=0``, or after a staging failed, they load here). Resident ones just move to most
        recently used. Nothing is pinned.
        """
        names = list(dict.fromkeys(names))
        todo = []
        for name in reversed(names):  # the head of the queue ends most recently used
            if name in self._lru:
                self._lru.move_to_end(name)
            elif name in self._entries:
                todo.append(name)
        if not todo:
            return
        todo.reverse()
        ready = []
        with self._lock:
            for name in todo:
                entry = self._entries.get(name)
                if entry is None or name in self._errors:
                    continue
                rows = self._host.get(name)
                if rows is None:
                    self._want_staged(entry, None)  # before the read starts, so the IO worker stages after it
                    self._fetch_locked(entry)
                else:
                    self._host.move_to_end(name)
                    ready.append((name, rows))
        protect = set(names)
        loads = 0
        waiting: list[tuple[str, AdapterRows]] = []
        for name, rows in ready:
            if self.max_staged and name not in self._stage_failed and not self._staged_ready(name, rows):
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
            with self._lock:
                for name, rows in waiting:
                    entry = self._entries.get(name)
                    if entry is not None and self._host.get(name) is rows:
                        self._want_staged(entry, rows)

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
        with self._lock:
            host = set(self._host)
            registered = len(self._entries)
            io = dict(self._io_counts)
            host_bytes, loading, failed = self._host_bytes, len(self._loads), len(self._errors)
            staged = len(self._staged)
        resident = set(self._lru)
        keys = ("hits", "misses", "evictions", "loads", "prefetch_loads", "staged_loads")
        io_keys = ("host_hits", "host_misses", "host_loads", "host_evictions", "host_too_large", "load_errors",
                   "stagings", "staged_dropped", "read_aheads")
        return {
            "registered": registered,
            "resident": len(resident),
            "pinned": len(self._pins),
            "in_host": len(host),
            "source_only": registered - len(resident | host),
            "loading": loading,
            "failed": failed,
            "staged": staged,
            "host_bytes": host_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "resident_pages": sum(self._lru.values()),
            "evictable_pages": self._evictable_pages,
            **{k: self._counts[k] for k in keys},
            **{k: io.get(k, 0) for k in io_keys},
        }

    def close(self, wait: bool = True) -> None:
        """Stop the IO threads; loads not yet started fail with 'store closed'."""
        with self._lock:
            self._closed = True
            for name in list(self._staged):
                self._drop_staged(name)
            for load in self._loads.values():
                if not load.claimed:
                    load.claimed = True
                    _finish(load.future, error=AdapterError(load.entry.name, "adapter store closed"))
        self._executor.shutdown(wait=wait)

    def __enter__(self) -> AdapterStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise AdapterError(name, "is not registered")
        return entry

    def _validated_entry(self, name: str, source: AdapterSource) -> _Entry:
        ranks = source.rank_table(name, self.model_cfg, self.max_rank)
        vectors = int((ranks.astype(np.int64) @ self._widths).max(initial=0))
        pages = math.ceil(vectors / self.pool.page_rows)
        if pages > min(self.pool.num_pages, self.pool.max_pages):
            raise AdapterError(name, f"needs {pages} pool pages; the pool has {self.pool.num_pages} "
                                     f"(at most {self.pool.max_pages} per adapter)")
        return _Entry(name, source, pages)

    def _host_rows_blocking(self, entry: _Entry) -> AdapterRows:
        """Host rows now: cached, or read inline if its load is still queued, else wait for the running read."""
        with self._lock:
            future = self._fetch_locked(entry)
            load = self._loads.get(entry.name)
            inline = load if load is not None and load.future is future and not load.claimed else None
        if inline is not None:
            self._run_load(inline, inline=True)
        return future.result()

    def _room_for(self, pages: int, protect: set[str] | frozenset = frozenset(), keep_free: int = 0) -> bool:
        if protect:
            victims = self._evictable(protect)
            n_spare, spare_pages = len(victims), sum(self._lru[n] for n in victims)
        else:  # the common case, kept O(1)
            n_spare, spare_pages = len(self._lru) - len(self._pins), self._evictable_pages
        has_slot = self.pool.num_free_slots > 0 or n_spare > 0
        return has_slot and self.pool.num_free_pages - keep_free + spare_pages >= pages

    def _evictable(self, protect: set[str] | frozenset = frozenset()) -> list[str]:
        return [n for n in self._lru if n not in self._pins and n not in protect]

    def _make_room(self, pages: int, protect: set[str] | frozenset = frozenset(), keep_free: int = 0) -> bool:
        """Evict unpinned (and unprotected) adapters, least recently used first, until a load of ``pages`` fits;
        evicts nothing and returns False if it cannot fit at all."""
        if not self._room_for(pages, protect, keep_free):
            return False
        for name in self._evictable(protect):
            if self.pool.num_free_slots > 0 and self.pool.num_free_pages - keep_free >= pages:
                break
            self._evict(name)
        return True

    def _load(self, name: str, rows: AdapterRows, wait_staged: bool = False) -> int:
        """Load into the pool, using pages an IO thread staged when ready (``wait_staged``: or being staged now)."""
        staged = self._take_staged(name, rows, wait_staged)
        slot = self.pool.load_adapter(name, rows, staged)
        if self._stage_failed:
            with self._lock:
                self._stage_failed.discard(name)
        if staged is not None:
            self._counts["staged_loads"] += 1
        pages = len(self.pool.adapter_pages(name))
        self._lru[name] = pages
        self._evictable_pages += pages
        self._counts["loads"] += 1
        return slot

    def _evict(self, name: str) -> None:
        self._unload(name)
        self._counts["evictions"] += 1

    def _unload(self, name: str) -> None:
        assert not self._pins.get(name), f"unloading pinned adapter {name!r}"
        self.pool.unload_adapter(name)
        self._evictable_pages -= self._lru.pop(name)

    def _pin(self, name: str) -> None:
        count = self._pins.get(name, 0)
        if count == 0:
            self._evictable_pages -= self._lru[name]
        self._pins[name] = count + 1

    def _no_room_message(self, name: str, pages: int) -> str:
        return (f"adapter {name!r} needs {pages} pages and a slot; free: {self.pool.num_free_pages} pages, "
                f"{self.pool.num_free_slots} slots; evictable: {self._evictable_pages} pages in "
                f"{len(self._lru) - len(self._pins)} unpinned adapters ({len(self._pins)} pinned)")
