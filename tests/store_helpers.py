"""Shared by the adapter-store and host-tier tests: small fp32 stores, exact read-back of resident adapters through the
DESIGN.md addressing, waits on the IO threads, and a source whose reads wait for a gate."""

from __future__ import annotations

import functools
import threading
import time

import jax.numpy as jnp
import numpy as np
import random_lora

from pallas_kernels.lora_common import virtual_to_physical
from slora_jax.engine.adapter_store import AdapterStore
from slora_jax.engine.pool import PagedPool
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.lora.sources import AdapterSource, InMemorySource
from slora_jax.model.adapter_weights import LoraAdapter
from slora_jax.model.config import MODULES, ModelConfig

PAGE_SIZE = 4  # tiny model: page_rows = 2 * 2 kv heads * 4 = 16 vectors
MAX_RANK = 16
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
# Pages per adapter in the tiny model: rank r on q,k,v,o takes 28 r vectors per layer -> r4: 7 pages, r8: 14 pages.

random_adapter = functools.partial(random_lora.random_adapter, targets=QKVO)  # S-LoRA's targets unless told


def rank4_adapters(cfg: ModelConfig, rng, names) -> tuple[dict[str, LoraAdapter], int]:
    """Rank-4 q,k,v,o adapters named after ``names`` and the host bytes of one's rows (all the same size), for
    budgets counted in adapters."""
    adapters = {n: random_adapter(cfg, rng, n, ranks=(4,)) for n in names}
    return adapters, to_pool_rows(next(iter(adapters.values())), cfg, np.float32).nbytes


def logged_rng(test_name: str) -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"{test_name}: seed {seed}")  # shown on failure, to replay
    return np.random.default_rng(seed)


def seed_of(rng) -> int:
    return int(rng.integers(2**31))


class StoreMaker:
    """Makes small fp32 stores (few slots / pages, so eviction happens) and closes them all on exit."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.stores = cfg, []

    def __call__(self, num_pages=256, max_slots=4, host_budget_bytes=1 << 30, **kw) -> AdapterStore:
        pool = PagedPool(self.cfg, page_size=PAGE_SIZE, max_slots=max_slots, max_rank=MAX_RANK, num_pages=num_pages,
                         dtype=jnp.float32)
        store = AdapterStore(self.cfg, pool, host_budget_bytes=host_budget_bytes, max_rank=MAX_RANK, dtype=np.float32,
                             **kw)
        self.stores.append(store)
        return store

    def __enter__(self) -> StoreMaker:
        return self

    def __exit__(self, *exc) -> None:
        for store in self.stores:
            store.close()


def assert_holds(store: AdapterStore, name: str, adapter: LoraAdapter) -> None:
    """The pool, read through the slot's page list and offsets (DESIGN.md addressing), holds exactly ``adapter``."""
    pool, cfg = store.pool, store.model_cfg
    arr = np.asarray(pool.array)
    slot = pool.slot_of(name)
    pages = np.asarray(pool.table.pages)[slot]
    rank, scale = np.asarray(pool.table.rank)[slot], np.asarray(pool.table.scale)[slot]
    a_off, b_off = np.asarray(pool.table.a_off)[slot], np.asarray(pool.table.b_off)[slot]
    vec = cfg.head_dim
    for layer in range(cfg.num_hidden_layers):
        for m, mod in enumerate(MODULES):
            want = adapter.modules.get((layer, mod))
            if want is None:
                assert rank[layer, m] == 0 and scale[layer, m] == 0, (name, layer, mod)
                continue
            r, (d_in, d_out) = want.rank, cfg.module_dims(mod)
            assert rank[layer, m] == r and scale[layer, m] == np.float32(want.scale), (name, layer, mod)
            for off, width, expect in ((a_off[layer, m], d_in, want.a.T), (b_off[layer, m], d_out, want.b)):
                page, row = virtual_to_physical(pages, off + np.arange(r * width // vec), pool.page_rows)
                np.testing.assert_array_equal(arr[layer, page, row].reshape(r, width), expect)


def wait_host(store: AdapterStore, *names: str) -> None:
    for name in names:
        store.host.fetch(name).result(timeout=30)


def wait_stagings(store: AdapterStore, n: int) -> None:
    deadline = time.monotonic() + 30
    while store.stats()["stagings"] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()["stagings"] >= n


def record_stage_threads(store: AdapterStore) -> list[str]:
    threads, stage = [], store.pool.stage

    def traced(rows, **kw):
        threads.append(threading.current_thread().name)
        return stage(rows, **kw)

    store.pool.stage = traced
    return threads


class GatedSource(AdapterSource):
    """An in-memory adapter whose read waits for a gate: an IO worker that is busy for as long as the test wants."""

    def __init__(self, adapter: LoraAdapter, gate: threading.Event):
        self.inner, self.gate = InMemorySource(adapter), gate

    def rank_table(self, name, model_cfg, max_rank):
        return self.inner.rank_table(name, model_cfg, max_rank)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        assert self.gate.wait(30)
        return self.inner.load_rows(name, model_cfg, max_rank, dtype)
