"""HostTier, reached through an AdapterStore: the byte-budgeted host LRU, concurrent and inline reads, read-ahead,
failures (recorded, retried, those that may pass read again after a wait, never poisoning other adapters),
register-time validation, and device staging's bookkeeping (dropped with host rows, on unregister, beyond max_staged;
never crossing names).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from store_helpers import (
    GatedSource,
    assert_holds,
    random_adapter,
    rank4_adapters,
    seed_of,
    wait_host,
    wait_stagings,
)

from slora_jax.engine.adapter_store import AdapterInUse
from slora_jax.engine.host_records import Failures
from slora_jax.lora.errors import RETRY_AFTER_S, rejecting
from slora_jax.lora.mixes import MixSource
from slora_jax.lora.peft import AdapterError, load_peft_adapter
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.lora.synthetic import SyntheticAdapterSource
from slora_jax.tools import synth

# ---- host rows: LRU within budget, concurrent reads, read-ahead ------------------------------------------------------


def test_host_cache_is_lru_within_its_byte_budget(make_store, tiny_cfg, rng):
    adapters, size = rank4_adapters(tiny_cfg, rng, "abcd")
    store = make_store(host_budget_bytes=int(2.5 * size))
    for name, adapter in adapters.items():
        store.register(name, adapter)
    wait_host(store, "a", "b")
    wait_host(store, "a")  # a most recently used
    wait_host(store, "c")  # over budget: b (least recently used) goes
    assert [store.host.has_rows(n) for n in "abcd"] == [True, False, True, False]
    s = store.stats()
    assert (s["in_host"], s["host_bytes"], s["host_evictions"], s["host_loads"], s["host_hits"]) == (2, 2 * size, 1,
                                                                                                      3, 1)
    assert (s["resident"], s["source_only"]) == (0, 2)
    store.acquire("b")  # read again from its source
    assert store.stats()["host_loads"] == 4 and [store.host.has_rows(n) for n in "abc"] == [False, True, True]
    assert_holds(store, "b", adapters["b"])
    assert store.stats()["source_only"] == 2  # a (dropped from host memory) and d

    # Count cap, and an adapter bigger than the whole budget is served but never cached.
    capped = make_store(max_host_adapters=1)
    tiny_budget = make_store(host_budget_bytes=size // 2)
    for name, adapter in adapters.items():
        capped.register(name, adapter)
        tiny_budget.register(name, adapter)
    wait_host(capped, "a", "b")
    assert [capped.host.has_rows(n) for n in "ab"] == [False, True]
    assert tiny_budget.host.fetch("a").result(timeout=30).name == "a"
    assert not tiny_budget.host.has_rows("a") and tiny_budget.stats()["host_too_large"] == 1
    for _ in range(3):  # asked ahead (each step while it waits): no read, whose rows would be thrown away again
        tiny_budget.prefetch(["a"])
    time.sleep(0.2)
    assert tiny_budget.stats()["host_loads"] == 1
    tiny_budget.acquire("a")
    assert_holds(tiny_budget, "a", adapters["a"])


def test_concurrent_host_loads_respect_budget(make_store, tiny_cfg, rng):
    adapters = {f"m{i}": random_adapter(tiny_cfg, rng, f"m{i}", ranks=(4,)) for i in range(16)}
    size = to_pool_rows(adapters["m0"], tiny_cfg, np.float32).nbytes
    store = make_store(host_budget_bytes=3 * size, io_threads=4)
    for name, adapter in adapters.items():
        store.register(name, adapter)
    gate = threading.Event()
    store.register("gated", GatedSource(adapters["m0"], gate))
    gated = store.host.fetch("gated")
    assert store.host.fetch("gated") is gated, "a second fetch while loading must join the first"
    futures = {name: store.host.fetch(name) for name in adapters}
    gate.set()
    gated.result(timeout=30)
    for name, future in futures.items():
        rows = future.result(timeout=30)
        np.testing.assert_array_equal(rows.vectors, to_pool_rows(adapters[name], tiny_cfg, np.float32).vectors)
    s = store.stats()
    assert s["host_loads"] == 17 and s["in_host"] == 3 and s["host_bytes"] == 3 * size and s["loading"] == 0


def test_read_ahead_reads_only_into_free_host_room(make_store, tiny_cfg, rng):
    """Reads for requests deep in the queue never evict the head's cached rows or staged pages, and stop where the
    host tier is full (no read that would be thrown away again)."""
    adapters = {f"a{i}": random_adapter(tiny_cfg, rng, f"a{i}", ranks=(4,)) for i in range(8)}
    store = make_store(num_pages=64, max_slots=1, max_host_adapters=4)
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.acquire("a0")  # the only slot is pinned: the head stays staged, not loaded
    store.prefetch(["a1", "a2"])
    wait_host(store, "a1", "a2")
    wait_stagings(store, 2)
    host_before = store.stats()["in_host"]
    store.read_ahead([f"a{i}" for i in range(3, 8)])  # 4 host slots, 3 taken: one read fits
    deadline = time.monotonic() + 30
    while store.stats()["loading"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = store.stats()
    assert stats["read_aheads"] == 4 - host_before == 1
    assert all(store.host.has_rows(n) for n in ("a1", "a2", "a3")) and stats["host_evictions"] == 0
    assert stats["staged"] == 2
    store.read_ahead(["a4", "a5"])  # full: nothing starts
    assert store.stats()["read_aheads"] == 1

    none = make_store(num_pages=64, max_slots=1, max_host_adapters=0)
    none.register("x", adapters["a0"])
    none.read_ahead(["x"])
    assert none.stats()["read_aheads"] == 0 and none.stats()["host_misses"] == 0


# ---- registry: validation and failures -------------------------------------------------------------------------------


def test_broken_adapters_fail_with_their_reason_and_poison_nothing(make_store, tiny_cfg, tmp_path, rng):
    root = tmp_path / "adapters"
    good = {n: synth.write_adapter(root / n, tiny_cfg, rank=4, seed=seed_of(rng)) for n in ("good1", "good2")}
    bad = synth.write_adapter(root / "corrupt", tiny_cfg, rank=4, seed=seed_of(rng))
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-a-header")
    synth.write_adapter(root / "dora", tiny_cfg, rank=4, extra_config={"use_dora": True})
    (root / "not-an-adapter").mkdir()

    store = make_store(num_pages=64, max_slots=2)
    with pytest.raises(AdapterError, match="'dora'.*DoRA"):
        store.register_dir(root, strict=True)
    store = make_store(num_pages=64, max_slots=2)
    assert store.register_dir(root) == ["corrupt", "dora", "good1", "good2"]
    assert store.host.errors() == {"dora": "DoRA (use_dora) is not supported"}

    with pytest.raises(AdapterError, match="unreadable adapter_model.safetensors") as info:
        store.host.fetch("corrupt").result(timeout=30)
    assert info.value.adapter == "corrupt"
    with pytest.raises(AdapterError, match="unreadable adapter_model.safetensors"):
        store.acquire("corrupt")  # the recorded failure: no second read
    with pytest.raises(AdapterError, match="DoRA"):
        store.acquire("dora")
    with pytest.raises(AdapterError, match="not registered"):
        store.acquire("missing")
    assert store.pages_needed_to_load("corrupt") == 0 and set(store.host.errors()) == {"corrupt", "dora"}
    store.prefetch(["corrupt", "dora", "good2"])  # skips the broken ones, raises nothing

    for name, path in good.items():
        store.acquire(name)
        assert_holds(store, name, load_peft_adapter(path, tiny_cfg))
    s = store.stats()
    assert (s["load_errors"], s["failed"], s["resident"], s["host_loads"]) == (1, 2, 2, 2)

    # Fixed on disk: retry clears the failure and the next use reads it again.
    synth.write_adapter(bad, tiny_cfg, rank=4, seed=seed_of(rng))
    store.host.retry("corrupt")
    store.release("good1")
    store.acquire("corrupt")
    assert_holds(store, "corrupt", load_peft_adapter(bad, tiny_cfg))


def test_register_validates_cheaply_and_loads_check_the_rest(make_store, tiny_cfg, tmp_path, rng):
    store = make_store(num_pages=64)
    too_big = synth.write_adapter(tmp_path / "r32", tiny_cfg, rank=32, seed=seed_of(rng))
    with pytest.raises(AdapterError, match="'r32'.*above the configured maximum 16"):
        store.register("r32", too_big)
    with pytest.raises(AdapterError, match="'gone'.*not a directory"):
        store.register("gone", tmp_path / "nowhere")
    no_weights = synth.write_adapter(tmp_path / "nw", tiny_cfg, rank=4, seed=seed_of(rng))
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="missing adapter_model.safetensors"):
        store.register("nw", no_weights)
    wrong = random_adapter(tiny_cfg, rng, "w")
    wrong.modules[(0, "q_proj")].a = wrong.modules[(0, "q_proj")].a[:32]
    with pytest.raises(AdapterError, match="'w'.*do not match"):
        store.register("w", wrong)
    with pytest.raises(AdapterError, match="rank 32 is outside"):
        store.register("s", SyntheticAdapterSource(tiny_cfg, 32))
    # An adapter bigger than the whole pool can never be served.
    with pytest.raises(AdapterError, match="needs 14 pool pages; the pool has 10"):
        make_store(num_pages=10).register("r8", random_adapter(tiny_cfg, rng, "r8", ranks=(8,)))
    assert store.names() == []

    nan = random_adapter(tiny_cfg, rng, "nan")
    nan.modules[(1, "v_proj")].b[0, 0] = np.nan
    store.register("nan", nan)  # weights are only scanned on load, off the engine thread
    store.register("ok", random_adapter(tiny_cfg, rng, "ok", ranks=(8,)))
    with pytest.raises(AdapterError, match="'nan'.*non-finite"):
        store.acquire("nan")
    store.acquire("ok")
    with pytest.raises(ValueError, match="already registered"):
        store.register("ok", nan)

    with pytest.raises(AdapterInUse):
        store.unregister("ok")
    store.release("ok")
    free = store.pool.num_free_pages
    store.unregister("ok")
    assert "ok" not in store and not store.is_resident("ok") and store.pool.num_free_pages == free + 14
    store.unregister("nan")
    assert store.host.errors() == {} and store.stats()["registered"] == 0
    with pytest.raises(KeyError):
        store.unregister("ok")


# ---- device staging bookkeeping --------------------------------------------------------------------------------------


def test_staged_pages_are_dropped_and_never_cross_names(make_store, tiny_cfg, rng):
    store = make_store(num_pages=128, max_slots=4, max_staged=2)
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4, 8)) for n in "abcd"}
    for name, adapter in adapters.items():
        store.register(name, adapter)

    store.prefetch(["a"])
    wait_host(store, "a")
    assert store.stats()["staged"] == 1
    # Unregister drops it; a new adapter under the same name never picks it up.
    store.unregister("a")
    assert store.stats()["staged"] == 0
    fresh = random_adapter(tiny_cfg, rng, "a", ranks=(2,))
    store.register("a", fresh)
    store.acquire("a")
    assert store.stats()["staged_loads"] == 0
    assert_holds(store, "a", fresh)
    store.release("a")

    # A re-registration while the old staging is pending: the new registration reads and stages afresh.
    store.prefetch(["b"])
    store.unregister("b")
    store.register("b", adapters["c"])
    wait_host(store, "b")
    store.acquire("b")
    assert_holds(store, "b", adapters["c"])
    store.release("b")

    # Bounded: at most max_staged held, the oldest dropped first.
    store.unregister("b")
    store.register("b", adapters["b"])
    store.prefetch(["b", "c", "d"], max_pool_loads=0)
    wait_host(store, "b", "c", "d")
    stats = store.stats()
    assert stats["staged"] <= 2 and stats["staged_dropped"] >= 1
    for name in "bcd":  # each adapter loads its own weights, staged or not
        store.acquire(name)
        assert_holds(store, name, adapters[name])
    assert store.stats()["staged"] == 0


def test_staged_pages_are_dropped_with_their_host_rows(make_store, tiny_cfg, rng):
    adapters = {n: random_adapter(tiny_cfg, rng, n, ranks=(4,)) for n in "ab"}
    store = make_store(num_pages=64, max_slots=2, max_host_adapters=1)
    for name, adapter in adapters.items():
        store.register(name, adapter)
    store.prefetch(["a"])
    wait_host(store, "a")
    assert store.stats()["staged"] == 1
    wait_host(store, "b")  # evicts a's rows from host memory, and with them its staged pages
    assert not store.host.has_rows("a") and store.stats()["staged"] == 0
    store.acquire("a")
    assert store.stats()["staged_loads"] == 0
    assert_holds(store, "a", adapters["a"])

    # Rows too large for the host tier are not staged either (their load reads again).
    small = make_store(num_pages=64, max_slots=2, host_budget_bytes=0)
    small.register("a", adapters["a"])
    small.prefetch(["a"])
    small.host.fetch("a").result(timeout=30)
    assert small.stats()["staged"] == 0
    small.acquire("a")
    assert_holds(small, "a", adapters["a"])


def test_a_read_failure_that_may_pass_is_read_again_after_its_wait(make_store, tiny_cfg, tmp_path, rng):
    """Weights gone since registration (a deploy replacing the file, a disk away): the failure stands for
    ``retry_after_s``, then the next use reads again. A corrupt file's failure stays until retried."""
    root = tmp_path / "adapters"
    flaky = synth.write_adapter(root / "flaky", tiny_cfg, rank=4, seed=seed_of(rng))
    bad = synth.write_adapter(root / "corrupt", tiny_cfg, rank=4, seed=seed_of(rng))
    store = make_store(num_pages=64, max_slots=2)
    assert store.register_dir(root) == ["corrupt", "flaky"] and store.host.errors() == {}
    now = [1000.0]
    store.host._errors._clock = lambda: now[0]  # noqa: SLF001 - the test drives the failure record's clock
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-a-header")
    weights = flaky / "adapter_model.safetensors"
    weights.rename(tmp_path / "away")
    for name, reason in (("flaky", "missing adapter_model.safetensors"), ("corrupt", "unreadable")):
        with pytest.raises(AdapterError, match=reason) as info:
            store.host.fetch(name).result(timeout=30)
        assert (info.value.retry_after_s is not None) == (name == "flaky")
    (tmp_path / "away").rename(weights)  # back, but the failure stands until its wait is over
    now[0] += RETRY_AFTER_S - 1
    with pytest.raises(AdapterError, match="missing"):
        store.acquire("flaky")
    assert set(store.host.errors()) == {"flaky", "corrupt"} and store.stats()["host_loads"] == 0
    now[0] += 2
    assert set(store.host.errors()) == {"corrupt"} and store.pages_needed_to_load("flaky") > 0
    store.acquire("flaky")
    assert_holds(store, "flaky", load_peft_adapter(flaky, tiny_cfg))
    with pytest.raises(AdapterError, match="unreadable"):
        store.acquire("corrupt")
    s = store.stats()
    assert (s["load_errors"], s["failed"], s["host_loads"]) == (2, 1, 1)

    # gone already when registered: registered as failed, and that failure stands (and says so: no retry_after_s)
    late = synth.write_adapter(tmp_path / "late" / "gone", tiny_cfg, rank=4, seed=seed_of(rng))
    (late / "adapter_model.safetensors").unlink()
    assert store.register_dir(late.parent) == ["gone"]
    now[0] += 10 * RETRY_AFTER_S
    with pytest.raises(AdapterError, match="missing") as info:
        store.acquire("gone")
    assert info.value.retry_after_s is None and "gone" in store.host.errors()


def test_files_replaced_after_registration_fail_their_adapter_alone(make_store, tiny_cfg, tmp_path, rng):
    """A directory away for a moment (a deploy swapping it) is a failure that passes, as a missing weights file is
    (it once stood until the adapter was registered again). Files replaced by an adapter of another shape fail that
    adapter until it is retried (admission sizes it by its registration: a bigger one once hung the engine's queue);
    retried, the new files serve."""
    root = tmp_path / "adapters"
    moved = synth.write_adapter(root / "moved", tiny_cfg, rank=4, seed=seed_of(rng))
    grown = synth.write_adapter(root / "grown", tiny_cfg, rank=4, seed=seed_of(rng))
    store = make_store(num_pages=64, max_slots=2)
    assert store.register_dir(root) == ["grown", "moved"]
    now = [1000.0]
    store.host._errors._clock = lambda: now[0]  # noqa: SLF001 - the test drives the failure record's clock
    moved.rename(tmp_path / "away")
    with pytest.raises(AdapterError, match="not a directory") as info:
        store.host.fetch("moved").result(timeout=30)
    assert info.value.retry_after_s is not None
    (tmp_path / "away").rename(moved)
    now[0] += RETRY_AFTER_S + 1
    store.acquire("moved")
    assert_holds(store, "moved", load_peft_adapter(moved, tiny_cfg))

    synth.write_adapter(grown, tiny_cfg, rank=8, seed=seed_of(rng), targets=("q_proj", "v_proj", "down_proj"))
    for _ in range(2):  # and it stands
        with pytest.raises(AdapterError, match="changed shape") as info:
            store.acquire("grown")
        assert info.value.retry_after_s is None
        now[0] += 10 * RETRY_AFTER_S
    assert store.host.pages("grown") == store.host.describe(["grown"])["grown"]["pages"] > 0
    store.host.retry("grown")
    store.acquire("grown")
    assert_holds(store, "grown", load_peft_adapter(grown, tiny_cfg))


def test_failures_expire_only_for_failed_reads_that_may_pass():
    now = [0.0]
    failures = Failures(clock=lambda: now[0])
    failures["invalid"] = AdapterError("invalid", "validation", retry_after_s=5)  # validation: always stands
    failures.record_read("slow", AdapterError("slow", "timed out", retry_after_s=5))
    failures.record_read("corrupt", AdapterError("corrupt", "bad header"))
    assert {n for n, _ in failures.items()} == {"invalid", "slow", "corrupt"} and len(failures) == 3
    assert failures.get("slow").retry_after_s == 5
    now[0] = 3.2  # Retry-After: what is left of the wait, in whole seconds
    assert failures.get("slow").retry_after_s == 2 and failures.get("slow").adapter == "slow"
    now[0] = 4.9
    assert "slow" in failures and failures.get("slow").reason == "timed out" and failures.get("slow").retry_after_s == 1
    now[0] = 5.0
    assert "slow" not in failures and failures.get("slow") is None and len(failures) == 2
    assert failures.pop("corrupt").reason == "bad header" and failures.pop("corrupt", "none") == "none"
    assert [n for n, _ in failures.items()] == ["invalid"] and 42 not in failures


def test_os_errors_are_failures_that_may_pass_and_wrappers_keep_that():
    def unreadable():
        raise PermissionError(13, "Permission denied", "/x/adapter_model.safetensors")

    def corrupt():
        raise ValueError("bad header")

    def passing():
        raise AdapterError("inner", "slow", retry_after_s=7)

    with pytest.raises(AdapterError, match="cannot read /x/adapter_model.safetensors") as info:
        rejecting("a", unreadable)
    assert info.value.retry_after_s == RETRY_AFTER_S and info.value.adapter == "a"
    with pytest.raises(AdapterError, match="invalid adapter") as info:
        rejecting("a", corrupt)
    assert info.value.retry_after_s is None
    with pytest.raises(AdapterError, match="slow") as info:
        rejecting("a", passing)
    assert info.value.retry_after_s == 7 and info.value.adapter == "a"
    with pytest.raises(AdapterError, match="its part 'p': slow") as info:  # a mix's read fails as its part's did
        MixSource._of_part(lambda part: passing(), "p", "mix")  # noqa: SLF001
    assert info.value.retry_after_s == 7 and info.value.adapter == "mix"
