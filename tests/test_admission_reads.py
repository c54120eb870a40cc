"""Admission around adapter reads (``admit_while_loading``): a request whose adapter host memory cannot keep is not
starved, and a slow read at the head of the queue does not hold up a request behind it when nothing runs. And what
admission counts: only the prefix-cache matches of sequences it admits.

Pool, store and scheduler only (no model): tokens are fed by hand, as the engine would after each step."""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from random_lora import random_adapter
from store_helpers import GatedSource

from slora_jax.engine.adapter_store import AdapterStore
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import RequestRejected
from slora_jax.engine.pool import PagedPool
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.scheduler import Scheduler
from slora_jax.engine.sequence import Sequence, Status
from slora_jax.lora.errors import AdapterError
from slora_jax.lora.sources import AdapterSource, InMemorySource

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def _scheduler(cfg, host_budget_bytes=1 << 30, max_host_adapters=None, max_model_len=200, num_pages=128, **kw):
    pool = PagedPool(cfg, page_size=4, max_slots=3, max_rank=16, num_pages=num_pages, dtype=jnp.float32)
    store = AdapterStore(cfg, pool, host_budget_bytes=host_budget_bytes, max_rank=16, dtype=np.float32,
                         max_host_adapters=max_host_adapters)
    ecfg = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=max_model_len,
                        page_size=4, max_lora_rank=16, max_loras=3, num_pages=num_pages, dtype="float32",
                        backend="reference", **{"admit_while_loading": True, **kw})
    return store, Scheduler(ecfg, pool, store)


def _step(sch) -> None:
    """One step as the engine runs it, with a token for every row."""
    plan = sch.schedule()
    if plan is None:
        return
    if plan.kind == "prefill":
        sch.on_prefilled(plan.seqs)
    for seq in plan.seqs:
        seq.num_cached = len(seq.all_ids)
        seq.output_ids.append(5)
        if seq.length_done:
            sch.finish(seq, "length")


def _seq(rng, adapter, max_tokens):
    return Sequence(prompt_ids=rng.integers(3, 60, size=8).tolist(), adapter=adapter,
                    sampling=SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("budget,max_host", [(1 << 30, None), (1000, None), (1 << 30, 0)],
                         ids=["kept", "larger-than-the-budget", "no-host-rows"])
def test_an_adapter_host_memory_cannot_keep_is_admitted_after_its_first_read(tiny_cfg, budget, max_host):
    """Was: such an adapter never counted as ready, so while anything else ran the request waited (a base request
    of 150 tokens: 120 steps) and every step read the adapter again."""
    rng = np.random.default_rng()
    store, sch = _scheduler(tiny_cfg, budget, max_host)
    try:
        store.register("a0", random_adapter(tiny_cfg, rng, "a0", ranks=(4,), targets=QKVO))
        base, want = _seq(rng, None, 150), _seq(rng, "a0", 4)
        sch.add(base)
        admitted_at = None
        for step in range(60):
            if step == 1:
                sch.add(want)
            _step(sch)
            if want.status != Status.WAITING and admitted_at is None:
                admitted_at = step
            if admitted_at is None:  # let the IO thread finish the read it started (memory: milliseconds)
                deadline = time.monotonic() + 5
                while store.host.stats()["host_loads"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.005)
        assert admitted_at is not None and admitted_at <= 4, admitted_at
        assert base.status == Status.RUNNING  # it was admitted beside the long base request
        assert store.host.stats()["host_loads"] <= 2  # the background read, and the load's own when not kept
    finally:
        store.close()


def test_a_slow_read_at_the_head_does_not_hold_up_the_request_behind_it(tiny_cfg):
    """With nothing running, the head's adapter still being read and a base request behind it: admission takes the
    base request at once (was: the engine thread waited for the read). With nothing else left, it waits."""
    rng = np.random.default_rng()
    store, sch = _scheduler(tiny_cfg)
    gate = threading.Event()
    safety = threading.Timer(30, gate.set)  # a blocking admission fails the asserts instead of hanging the run
    safety.start()
    try:
        store.register("slow", GatedSource(random_adapter(tiny_cfg, rng, "slow", ranks=(4,), targets=QKVO), gate))
        slow, base = _seq(rng, "slow", 4), _seq(rng, None, 4)
        sch.add(slow)
        sch.add(base)
        t0 = time.monotonic()
        plan = sch.schedule()
        assert time.monotonic() - t0 < 5 and not gate.is_set()
        assert plan.kind == "prefill" and plan.seqs == [base] and slow.status == Status.WAITING
        sch.on_prefilled(plan.seqs)
        for _ in range(4):
            base.num_cached = len(base.all_ids)
            base.output_ids.append(5)
            if base.length_done:
                sch.finish(base, "length")
            else:
                sch.schedule()
        assert base.status == Status.FINISHED and slow.status == Status.WAITING
        threading.Timer(0.3, gate.set).start()
        plan = sch.schedule()  # nothing else to run: admission waits for the read
        assert plan.seqs == [slow] and slow.status == Status.RUNNING
    finally:
        safety.cancel()
        gate.set()
        store.close()


def test_prefix_cache_counts_only_the_matches_of_admitted_sequences(tiny_cfg):
    """A request that matches cached pages but waits for room (its admission undone every step) counts nothing
    until it is admitted; then its pages count once (was: every attempt counted its hits and misses)."""
    rng = np.random.default_rng()
    store, sch = _scheduler(tiny_cfg, num_pages=16, max_model_len=48, prefix_cache=True)
    try:
        prefix = rng.integers(3, 60, size=12).tolist()  # three full pages
        first = Sequence(prompt_ids=prefix + [5], adapter=None, sampling=SamplingParams(max_tokens=1))
        sch.add(first)
        _step(sch)
        assert first.status == Status.FINISHED and sch.prefix_cache.num_pages == 3
        hog = Sequence(prompt_ids=rng.integers(3, 60, size=40).tolist(), adapter=None,
                       sampling=SamplingParams(max_tokens=8))
        sch.add(hog)
        _step(sch)
        base = dict(sch.prefix_cache.stats())
        late = Sequence(prompt_ids=prefix + [6], adapter=None, sampling=SamplingParams(max_tokens=20))
        sch.add(late)
        for _ in range(4):
            _step(sch)
            assert late.status == Status.WAITING  # no room while the hog runs
        stats = sch.prefix_cache.stats()
        assert (stats["hit_pages"], stats["miss_pages"]) == (base["hit_pages"], base["miss_pages"])
        while late.status == Status.WAITING:
            _step(sch)
        stats = sch.prefix_cache.stats()
        assert stats["hit_pages"] - base["hit_pages"] == 3 and stats["miss_pages"] == base["miss_pages"]
    finally:
        store.close()


def test_a_request_whose_resident_adapter_would_leave_too_few_pages_waits_without_pinning_it(tiny_cfg):
    """A resident adapter nobody pins counts as evictable room; pinning it for a request takes that room away.
    Admission now counts that before it pins (was: it pinned the adapter, a store "hit", found too few pages and let
    go, every step), and admits the request once the pages are there."""
    rng = np.random.default_rng()
    store, sch = _scheduler(tiny_cfg, num_pages=24, max_model_len=48)
    try:
        store.register("a0", random_adapter(tiny_cfg, rng, "a0", ranks=(4,), targets=QKVO))
        warm = _seq(rng, "a0", 1)
        sch.add(warm)
        _step(sch)
        assert warm.status == Status.FINISHED and store.is_resident("a0") and not store.pin_count("a0")
        hog = Sequence(prompt_ids=rng.integers(3, 60, size=40).tolist(), adapter=None,
                       sampling=SamplingParams(max_tokens=8))
        sch.add(hog)
        _step(sch)
        _step(sch)  # its first decode takes one more page
        late = Sequence(prompt_ids=rng.integers(3, 60, size=8).tolist(), adapter="a0",
                        sampling=SamplingParams(max_tokens=20))
        assert sch.worst_case_pages(late) <= sch.obtainable_pages()  # fits only if a0's pages could be evicted
        assert sch.worst_case_pages(late) + store.adapter_pages("a0") > sch.obtainable_pages()
        sch.add(late)
        hits = store.stats()["hits"]
        for _ in range(4):
            _step(sch)
            assert late.status == Status.WAITING and store.stats()["hits"] == hits
        while late.status == Status.WAITING:
            _step(sch)
        assert store.stats()["hits"] == hits + 1 and late.status == Status.RUNNING
    finally:
        store.close()


class BrokenWeights(AdapterSource):
    """An adapter whose config and shapes pass at registration and whose weights fail at first use."""

    def __init__(self, adapter):
        self.inner = InMemorySource(adapter)

    def rank_table(self, name, model_cfg, max_rank):
        return self.inner.rank_table(name, model_cfg, max_rank)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        raise AdapterError(name, "has non-finite weights (NaN or inf)")


@pytest.mark.parametrize("while_loading", [False, True])
def test_a_request_whose_adapter_fails_at_first_use_on_an_idle_server_fails_once(tiny_cfg, while_loading):
    """With nothing running admission tries twice (the second pass waits for reads); the request whose adapter
    failed in the first pass was failed again in the second: two final outputs for one request."""
    rng = np.random.default_rng()
    store, sch = _scheduler(tiny_cfg, admit_while_loading=while_loading)
    try:
        store.register("bad", BrokenWeights(random_adapter(tiny_cfg, rng, "bad", ranks=(4,), targets=QKVO)))
        seq = _seq(rng, "bad", 4)
        sch.add(seq)
        failed = []
        for _ in range(3):
            assert sch.schedule() is None
            failed += sch.take_failed()
            for s, _msg, _kind in failed:
                if s.status != Status.FINISHED:
                    sch.finish(s, "error")
        assert [(s, kind) for s, _msg, kind in failed] == [(seq, "adapter")] and "non-finite" in failed[0][1]
        assert not sch.waiting and seq.status == Status.FINISHED
    finally:
        store.close()


def test_unused_cached_prefix_pages_go_before_a_resident_adapter(tiny_cfg):
    """Loading an adapter for admission takes free pages, then unused cached prefix pages, and only then evicts an
    adapter (recomputing a prefix is cheaper than reading an adapter again; was: adapters went first)."""
    rng = np.random.default_rng()
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,), targets=QKVO) for n in ("a0", "a1")}
    probe, _ = _scheduler(tiny_cfg)
    probe.register("a0", adapters["a0"])
    pages = probe.adapter_pages("a0")
    probe.close()
    cached = 3  # the first request's prompt: three full pages, kept by the cache after it ends
    store, sch = _scheduler(tiny_cfg, num_pages=2 * pages + cached - 1, max_model_len=48, prefix_cache=True)
    try:
        for name, adapter in adapters.items():
            store.register(name, adapter)
        first = Sequence(prompt_ids=rng.integers(3, 60, size=4 * cached).tolist() + [5], adapter="a0",
                         sampling=SamplingParams(max_tokens=1))
        sch.add(first)
        while first.status != Status.FINISHED:
            _step(sch)
        assert store.is_resident("a0") and sch.prefix_cache.evictable_pages == cached
        assert sch.pool.num_free_pages == pages - 1  # a1 does not fit in the free pages alone
        late = Sequence(prompt_ids=rng.integers(3, 60, size=3).tolist(), adapter="a1",
                        sampling=SamplingParams(max_tokens=1))
        sch.add(late)
        _step(sch)
        assert late.status != Status.WAITING and store.is_resident("a1")
        assert store.is_resident("a0"), "a resident adapter was evicted while unused cached pages were left"
        assert sch.prefix_cache.stats()["evicted"] >= 1
    finally:
        store.close()


def test_a_prompt_that_cannot_fit_without_max_tokens_blames_the_prompt(tiny_cfg):
    """Without max_tokens the server picks it; a prompt that leaves no room in the pool is the prompt's fault (was:
    "lower max_tokens", naming a field the client never sent)."""
    store, sch = _scheduler(tiny_cfg, num_pages=8, max_model_len=48)  # the pool holds 32 tokens
    try:
        assert sch.check_request(20, None, None) == 12
        with pytest.raises(RequestRejected, match="shorten the prompt") as err:
            sch.check_request(32, None, None)
        assert err.value.param == "prompt"
        with pytest.raises(RequestRejected, match="lower max_tokens") as err:
            sch.check_request(20, 13, None)
        assert err.value.param == "max_tokens"
    finally:
        store.close()
