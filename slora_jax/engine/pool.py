"""The unified paged pool: one device array holding every layer's KV cache and every resident adapter's weights.

Layout and addressing are fixed by docs/DESIGN.md: ``array`` is ``[L, num_pages, page_rows, V]`` with
``page_rows = 2 * n_kv_heads * page_size`` and ``V = head_dim``; a page is either a KV page or an adapter page, the
same page id in every layer. ``table`` is the device ``AdapterTable`` the LoRA kernels read through.

With tensor parallelism (``tp``) the array is ``[L, num_pages, page_rows, N * V]`` sharded on its last axis: each
device holds its n_kv / N KV heads (``page_rows = 2 * n_kv / N * page_size``) and its share of every adapter, under
the same page ids, slots, ranks and offsets on every device (``adapter_shards.py``); the table is replicated.

Both ``array`` and ``table`` are replaced (their old buffers donated) by every load and unload, and the engine
replaces ``array`` after each step: always read ``pool.array`` / ``pool.table`` afresh, never keep an old reference.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Hashable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels.lora_common import AdapterTable
from pallas_kernels.lowering import next_pow2
from slora_jax.engine.adapter_shards import AdapterShards
from slora_jax.engine.page_allocator import ADAPTER, KV, ForeignPage, OutOfPages, PageAllocator, owner_kind
from slora_jax.lora.pool_rows import AdapterRows
from slora_jax.model.config import MODULES, ModelConfig
from slora_jax.model.sharding import POOL_SPEC, TensorParallel

__all__ = ["OutOfPages", "OutOfSlots", "PagedPool", "ResidentAdapter", "StagedPages", "max_adapter_vectors"]


class OutOfSlots(RuntimeError):
    """Every adapter slot of the device table is taken; unload (evict) an adapter first."""


@dataclasses.dataclass(frozen=True)
class ResidentAdapter:
    """Host-side record of one loaded adapter."""

    name: str
    slot: int
    pages: tuple[int, ...]
    total_vectors: int  # vectors actually used, summed over layers


@dataclasses.dataclass(frozen=True, eq=False)
class StagedPages:
    """One adapter's vectors already on the device, laid out for one scatter (see :meth:`PagedPool.stage`).

    ``vectors`` is ``[L, bucket, page_rows, V]`` in the pool dtype: the adapter's ``n_pages`` pages, then zero pages
    up to ``bucket`` (``page_bucket(n_pages)``). Made from one ``AdapterRows``; only ever load it with those rows.
    """

    bucket: int
    n_pages: int
    vectors: jax.Array


def _scatter_pages(pool: jax.Array, page_ids: jax.Array, page_vectors: jax.Array) -> jax.Array:
    """Scatter whole pages into every layer in place; page ids from ``num_pages`` up mark bucket padding (dropped).

    The ids are distinct (allocated pages, then distinct padding ids), so the scatter declares them unique: XLA's GPU
    scatter then stores plainly instead of a compare-and-swap loop per bf16 element."""
    return pool.at[:, page_ids].set(page_vectors.astype(pool.dtype), mode="drop", unique_indices=True)


_write_pages = jax.jit(_scatter_pages, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def _set_slot(table: AdapterTable, slot, pages, rank, a_off, b_off, scale) -> AdapterTable:
    """Overwrite one slot's rows of the adapter table (slot is traced, so this compiles once)."""
    return table._replace(
        pages=table.pages.at[slot].set(pages),
        rank=table.rank.at[slot].set(rank),
        a_off=table.a_off.at[slot].set(a_off),
        b_off=table.b_off.at[slot].set(b_off),
        scale=table.scale.at[slot].set(scale),
    )


def max_adapter_vectors(config: ModelConfig, max_rank: int) -> int:
    """Worst-case vectors of one adapter in one layer: all modules adapted at ``max_rank``."""
    per_rank = sum(sum(config.module_dims(m)) for m in MODULES) // config.head_dim
    return max_rank * per_rank


class PagedPool:
    """Owns the pool array, its page allocator and the device adapter table.

    Size it with ``num_pages`` or a ``memory_bytes`` budget (exactly one; per device under ``tp``). ``max_rank``
    bounds the pages one adapter may take (``max_pages``, the width of ``table.pages``); ``max_slots`` is how many
    adapters can be resident. ``vec`` is the width of a pool row as adapter rows hold it (head_dim, times N under
    ``tp``); ``page_bytes`` counts a page on every device.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        page_size: int,
        max_slots: int,
        max_rank: int,
        num_pages: int | None = None,
        memory_bytes: int | None = None,
        dtype=jnp.bfloat16,
        tp: TensorParallel | None = None,
    ):
        if (num_pages is None) == (memory_bytes is None):
            raise ValueError("give exactly one of num_pages and memory_bytes")
        if page_size < 1 or max_slots < 1 or max_rank < 1:
            raise ValueError(f"page_size, max_slots, max_rank must be >= 1 (got {page_size}, {max_slots}, {max_rank})")
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.num_layers = config.num_hidden_layers
        self.tp, self.shards = tp, AdapterShards(config, tp)
        n_dev = self.shards.n
        self.vec = config.head_dim * n_dev
        self.page_size = int(page_size)
        self.page_rows = 2 * config.num_key_value_heads // n_dev * self.page_size
        self.page_bytes = self.num_layers * self.page_rows * self.vec * self.dtype.itemsize
        # One token's K and V in every layer: what a live KV token costs.
        self.kv_token_bytes = self.page_bytes // self.page_size
        if num_pages is None:
            num_pages = int(memory_bytes) // (self.page_bytes // n_dev)
        if num_pages < 1:
            raise ValueError(f"pool needs at least one page ({self.page_bytes} bytes); got {num_pages} pages")
        self.num_pages = int(num_pages)
        self.pool_bytes = self.num_pages * self.page_bytes

        self.max_slots = int(max_slots)
        self.max_rank = int(max_rank)
        self.max_pages = math.ceil(self.shards.max_vectors(self.max_rank) / self.page_rows)

        self.allocator = PageAllocator(self.num_pages)
        shape = (self.num_layers, self.num_pages, self.page_rows, self.vec)
        n_layers, n_mod, n_slots = self.num_layers, len(MODULES), self.max_slots
        table_shapes = AdapterTable(pages=((n_slots, self.max_pages), jnp.int32),
                                    rank=((n_slots, n_layers, n_mod), jnp.int32),
                                    a_off=((n_slots, n_layers, n_mod), jnp.int32),
                                    b_off=((n_slots, n_layers, n_mod), jnp.int32),
                                    scale=((n_slots, n_layers, n_mod), jnp.float32))
        if tp is None:  # committed to the device, as every step's outputs are: warm-up compiles what serving runs
            device = jax.devices()[0]
            self.array: jax.Array = jnp.zeros(shape, self.dtype, device=device)
            self.table: AdapterTable = AdapterTable(*(jnp.zeros(s, d, device=device) for s, d in table_shapes))
            self._write_pages = _write_pages
        else:  # pages sharded by their vector lanes, the table replicated, page scatters local to each device
            self.array = tp.zeros(shape, self.dtype, POOL_SPEC)
            self.table = AdapterTable(*(tp.zeros(s, d) for s, d in table_shapes))
            self._write_pages = jax.jit(tp.local_fn(_scatter_pages, (POOL_SPEC, P(), POOL_SPEC), POOL_SPEC),
                                        donate_argnums=0)
        # host mirror: which projections each slot's adapter targets (any layer), so a step can skip the LoRA kernels
        # of projections no adapter in its batch targets
        self.slot_modules = np.zeros((n_slots, n_mod), bool)
        self.kv_tokens_live = 0  # tokens actually stored in KV pages; the engine keeps this current
        self._adapters: dict[str, ResidentAdapter] = {}
        self._free_slots: list[int] = list(range(self.max_slots))  # a heap: lowest slot first

    # ---- adapters -------------------------------------------------------------------------------------------

    @property
    def vectors_per_rank(self) -> np.ndarray:
        """int64[len(MODULES)]: pool vectors one unit of rank of each module costs (per device under ``tp``)."""
        return self.shards.vectors_per_rank

    def shard_rows(self, rows: AdapterRows) -> AdapterRows:
        """Rows of the whole model (``to_pool_rows``) in this pool's layout: each device's share side by side
        under ``tp`` (``AdapterShards.shard_rows``), the same rows without. Thread-safe."""
        return self.shards.shard_rows(rows)

    def stage(self, rows: AdapterRows, *, block: bool = True) -> StagedPages:
        """Copy ``rows`` to the device, padded to its page bucket, ready for :meth:`load_adapter`.

        Thread-safe (numpy and ``jax.device_put`` only, no pool state), so IO threads can stage while the engine
        runs a step. ``block`` waits until the copy is on the device, so a done future means a cheap load.
        """
        n_pages = rows.pages_needed(self.page_rows)
        bucket = self.page_bucket(n_pages)
        host = np.zeros((self.num_layers, bucket * self.page_rows, self.vec), self.dtype)
        host[:, : rows.num_vectors] = rows.vectors
        vectors = jax.device_put(host.reshape(self.num_layers, bucket, self.page_rows, self.vec),
                                 None if self.tp is None else self.tp.pool_sharding)  # each device its lanes
        if block:
            vectors.block_until_ready()
        return StagedPages(bucket, n_pages, vectors)

    def load_adapter(self, name: str, rows: AdapterRows, staged: StagedPages | None = None) -> int:
        """Make ``rows`` resident: allocate pages anywhere, scatter the vectors, fill a table slot; returns the slot.

        ``staged`` (from :meth:`stage` of these same ``rows``) skips the host copy and transfer; without it the rows
        are staged here, on the calling thread.

        Raises :class:`OutOfSlots` / :class:`OutOfPages` (pool, table and books unchanged) when there is no room.
        """
        if name in self._adapters:
            raise ValueError(f"adapter {name!r} is already resident (slot {self._adapters[name].slot})")
        expect = (self.num_layers, self.vec)
        if rows.vectors.ndim != 3 or (rows.vectors.shape[0], rows.vectors.shape[2]) != expect:
            raise ValueError(f"adapter {name!r}: vectors {rows.vectors.shape} are not [L, n, V] with (L, V)={expect}")
        if rows.rank.shape != (self.num_layers, len(MODULES)):
            raise ValueError(f"adapter {name!r}: rank table {rows.rank.shape} is not [L, {len(MODULES)}]")
        if rows.max_rank > self.max_rank:
            raise ValueError(f"adapter {name!r}: rank {rows.max_rank} exceeds the pool's max_rank {self.max_rank}")
        n_pages = rows.pages_needed(self.page_rows)
        if n_pages > self.max_pages:
            raise ValueError(f"adapter {name!r} needs {n_pages} pages; the table holds at most {self.max_pages}")
        if staged is not None:
            want = (self.num_layers, self.page_bucket(n_pages), self.page_rows, self.vec)
            if (staged.n_pages != n_pages or staged.bucket != want[1] or tuple(staged.vectors.shape) != want
                    or staged.vectors.dtype != self.dtype):
                raise ValueError(f"adapter {name!r}: staged pages ({staged.n_pages} pages, {staged.vectors.shape} "
                                 f"{staged.vectors.dtype}) do not match its rows ({n_pages} pages, {want} "
                                 f"{self.dtype})")
        if not self._free_slots:
            raise OutOfSlots(f"all {self.max_slots} adapter slots are taken; unload one before loading {name!r}")

        pages = self.allocator.alloc(n_pages, (ADAPTER, name))  # raises OutOfPages with nothing changed
        try:
            if n_pages:
                if staged is None:
                    staged = self.stage(rows, block=False)
                self.array = self._write_pages(self.array, self._page_ids(pages, staged.bucket), staged.vectors)
            slot = self._free_slots[0]
            page_row = np.zeros(self.max_pages, np.int32)
            page_row[:n_pages] = pages
            self.table = _set_slot(self.table, np.int32(slot), page_row, rows.rank, rows.a_off, rows.b_off, rows.scale)
        except BaseException:
            self.allocator.free(pages)
            raise
        heapq.heappop(self._free_slots)
        self.slot_modules[slot] = (np.asarray(rows.rank) > 0).any(axis=0)
        self._adapters[name] = ResidentAdapter(name, slot, tuple(pages), rows.total_vectors)
        return slot

    def unload_adapter(self, name: str) -> None:
        """Free the adapter's pages and slot; its table rows are zeroed so a stale slot index contributes nothing."""
        res = self._adapters.pop(name, None)
        if res is None:
            raise KeyError(f"adapter {name!r} is not resident")
        zeros_i = np.zeros((self.num_layers, len(MODULES)), np.int32)
        self.table = _set_slot(
            self.table,
            np.int32(res.slot),
            np.zeros(self.max_pages, np.int32),
            zeros_i,
            zeros_i,
            zeros_i,
            np.zeros((self.num_layers, len(MODULES)), np.float32),
        )
        self.allocator.free(res.pages, (ADAPTER, name))
        self.slot_modules[res.slot] = False
        heapq.heappush(self._free_slots, res.slot)

    def slot_of(self, name: str) -> int:
        """Table slot of a resident adapter (KeyError if it is not resident)."""
        try:
            return self._adapters[name].slot
        except KeyError:
            raise KeyError(f"adapter {name!r} is not resident") from None

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def resident_adapters(self) -> dict[str, int]:
        """Name -> slot of every resident adapter, in load order."""
        return {name: res.slot for name, res in self._adapters.items()}

    def adapter_pages(self, name: str) -> tuple[int, ...]:
        return self._adapters[name].pages

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def can_load(self, rows: AdapterRows) -> bool:
        """Whether a slot and enough pages are free for ``rows`` right now."""
        return bool(self._free_slots) and self.allocator.can_alloc(rows.pages_needed(self.page_rows))

    # ---- KV -------------------------------------------------------------------------------------------------

    def alloc_kv_pages(self, n: int, owner: Hashable | None = None) -> list[int]:
        """Pages for KV of sequence ``owner`` (raises :class:`OutOfPages`, nothing taken, when short)."""
        return self.allocator.alloc(n, KV if owner is None else (KV, owner))

    def free_kv_pages(self, pages: Iterable[int], owner: Hashable | None = None) -> None:
        """Return KV pages; refuses adapter pages (and, with ``owner``, other sequences' pages) before freeing any."""
        pages = list(pages)
        for p in pages:
            current = self.allocator.owner_of(p)
            if current is not None and owner_kind(current) != KV:
                raise ForeignPage(f"page {p} belongs to {current!r}, not to the KV cache")
        self.allocator.free(pages, None if owner is None else (KV, owner))

    def can_alloc(self, n: int) -> bool:
        return self.allocator.can_alloc(n)

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    # ---- accounting -----------------------------------------------------------------------------------------

    def stats(self, kv_tokens_live: int | None = None) -> dict[str, float | int]:
        """Page split and live bytes for metrics; ``kv_tokens_live`` defaults to the ``kv_tokens_live`` attribute."""
        counts = self.allocator.counts()
        tokens = self.kv_tokens_live if kv_tokens_live is None else int(kv_tokens_live)
        if not 0 <= tokens <= counts[KV] * self.page_size:
            raise ValueError(f"{tokens} live KV tokens cannot fit in {counts[KV]} KV pages of {self.page_size}")
        kv_live = tokens * self.kv_token_bytes
        adapter_live = sum(r.total_vectors for r in self._adapters.values()) * self.vec * self.dtype.itemsize
        live = kv_live + adapter_live
        return {
            "num_pages": self.num_pages,
            "page_bytes": self.page_bytes,
            "pool_bytes": self.pool_bytes,
            "pages_kv": counts[KV],
            "pages_adapter": counts[ADAPTER],
            "pages_free": counts["free"],
            "kv_fraction": counts[KV] / self.num_pages,
            "adapter_fraction": counts[ADAPTER] / self.num_pages,
            "kv_tokens_live": tokens,
            "kv_live_bytes": kv_live,
            "adapter_live_bytes": adapter_live,
            "live_bytes": live,
            "utilisation": live / self.pool_bytes,
            "num_adapters": len(self._adapters),
            "max_slots": self.max_slots,
        }

    # ---- helpers --------------------------------------------------------------------------------------------

    def page_bucket(self, n_pages: int) -> int:
        """Pages per scatter call: next power of two (capped at ``max_pages``) so compiles stay few."""
        return min(next_pow2(n_pages), self.max_pages)

    def _page_ids(self, pages: list[int], bucket: int) -> np.ndarray:
        """Page ids for one scatter, padded to ``bucket`` with distinct out-of-range ids (see _scatter_pages)."""
        page_ids = self.num_pages + np.arange(bucket, dtype=np.int32)
        page_ids[: len(pages)] = pages
        return page_ids
