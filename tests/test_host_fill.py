"""HostFill: every registered adapter read into host memory in the background, into free room only (never evicting),
behind the engine's own reads, skipping failed adapters, picking up later registrations, ending with the store; and
the server starts it unless --no-host-fill."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from store_helpers import GatedSource, random_adapter, rank4_adapters, wait_host

from slora_jax.engine.host_fill import HostFill
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.lora.sources import PeftDirSource
from slora_jax.serve.cli import build_engine, build_parser


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def in_host(store, names):
    return {n for n in names if store.host.has_rows(n)}


def test_fill_reads_what_fits_and_never_evicts(make_store, tiny_cfg, rng):
    adapters, size = rank4_adapters(tiny_cfg, rng, "abcdef")
    store = make_store(host_budget_bytes=int(3.5 * size))
    for name, adapter in adapters.items():
        store.register(name, adapter)
    wait_host(store, "e")  # a demand read first: the fill must leave it there
    fill = HostFill(store.host, idle_s=0.05).start()
    assert fill.complete.wait(30)
    held = in_host(store, adapters)
    assert "e" in held and len(held) == 3, held  # 3 fit the budget; nothing was pushed out for the fill
    stats = store.stats()
    assert stats["host_evictions"] == 0 and stats["host_bytes"] <= stats["host_budget_bytes"]
    assert fill.filled == 2
    rows = store.host.rows_now(sorted(held - {"e"})[0])  # what the fill read is the adapter itself
    name = rows.name
    np.testing.assert_array_equal(rows.vectors, to_pool_rows(adapters[name], tiny_cfg, np.float32).vectors)
    fill.close()


def test_fill_rows_never_push_out_rows_a_request_used(make_store, tiny_cfg, rng):
    """A fill read that lands after a request's read took its room is dropped, not kept by evicting; fill rows sit
    at the cold end of the LRU, so a request's read evicts them first."""
    gate = threading.Event()
    adapters, size = rank4_adapters(tiny_cfg, rng, "abcde")
    store = make_store(host_budget_bytes=int(2.5 * size))
    store.register("a", adapters["a"])
    store.register("b", GatedSource(adapters["b"], gate))  # the fill's read of b waits at the gate
    store.register("c", adapters["c"])
    wait_host(store, "a")
    [held] = store.host.read_ahead(["b"], cold=True)
    wait_host(store, "c")  # a request's read fills the room b's read counted on
    gate.set()
    held.result(timeout=30)
    assert in_host(store, "abc") == {"a", "c"} and store.stats()["host_evictions"] == 0
    assert store.stats()["host_fill_dropped"] == 1
    store.register("d", adapters["d"])
    store.register("e", adapters["e"])
    store.unregister("c")
    [cold] = store.host.read_ahead(["d"], cold=True)
    cold.result(timeout=30)
    assert in_host(store, "ad") == {"a", "d"}
    wait_host(store, "e")  # over budget: the fill's d goes before the request's a
    assert in_host(store, "ade") == {"a", "e"}


def test_a_request_joining_a_fill_read_keeps_its_rows(make_store, tiny_cfg, rng):
    gate = threading.Event()
    adapters, size = rank4_adapters(tiny_cfg, rng, "ab")
    store = make_store(host_budget_bytes=int(1.5 * size))
    store.register("a", adapters["a"])
    store.register("b", GatedSource(adapters["b"], gate))
    [held] = store.host.read_ahead(["b"], cold=True)
    wanted = store.host.fetch("b")  # a request for b while the fill reads it: kept as any read's, evicting if need be
    wait_host(store, "a")
    gate.set()
    wanted.result(timeout=30)
    assert held is wanted and in_host(store, "ab") == {"b"}


def test_fill_picks_up_later_registrations_and_room(make_store, tiny_cfg, rng):
    adapters, size = rank4_adapters(tiny_cfg, rng, "abc")
    store = make_store(host_budget_bytes=int(2.5 * size))
    store.register("a", adapters["a"])
    fill = HostFill(store.host, idle_s=0.02).start()
    try:
        wait_for(lambda: in_host(store, "a") == {"a"})
        store.register("b", adapters["b"])
        store.register("c", adapters["c"])
        wait_for(lambda: len(in_host(store, "abc")) == 2)
        time.sleep(0.2)
        assert len(in_host(store, "abc")) == 2 and store.stats()["host_evictions"] == 0  # full: no churn
        store.unregister("a")  # room again
        wait_for(lambda: in_host(store, "bc") == {"b", "c"})
    finally:
        fill.close()


def test_fill_waits_while_other_reads_are_in_flight(make_store, tiny_cfg, rng):
    gate = threading.Event()
    store = make_store()
    store.register("slow", GatedSource(random_adapter(tiny_cfg, rng, "slow", ranks=(4,)), gate))
    store.register("other", random_adapter(tiny_cfg, rng, "other", ranks=(4,)))
    demand = store.host.fetch("slow")  # an engine read that holds an IO thread
    fill = HostFill(store.host, max_reads=1, busy_reads=1, poll_s=0.01, idle_s=0.02).start()
    try:
        time.sleep(0.3)
        assert not store.host.has_rows("other") and fill.filled == 0  # it stays behind the read in flight
        gate.set()
        demand.result(timeout=30)
        assert fill.complete.wait(30)
        assert store.host.has_rows("other") and fill.filled == 1
    finally:
        gate.set()
        fill.close()


def test_fill_tries_a_failing_read_once(make_store, tiny_cfg, rng, adapter_dirs, tmp_path):
    """A read that fails and may pass (the weights file gone) expires from the failure record after a wait; the
    fill does not read it again then (each pass would), a request does."""
    import shutil

    from slora_jax.engine.host_records import Failures

    now = [0.0]
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dirs["r4-qkvo"], broken)
    store = make_store()
    store.host._errors = Failures(clock=lambda: now[0])
    store.register("broken", PeftDirSource(broken))
    store.register("good", random_adapter(tiny_cfg, rng, "good", ranks=(4,)))
    (broken / "adapter_model.safetensors").unlink()  # fails at read, not at registration
    fill = HostFill(store.host, idle_s=0.02).start()
    try:
        assert fill.complete.wait(30)
        assert store.host.has_rows("good") and not store.host.has_rows("broken")
        assert store.host.error_of("broken").retry_after_s is not None and store.stats()["load_errors"] == 1
        now[0] += 3600  # the failure expired: the next use reads again
        assert store.host.error_of("broken") is None
        time.sleep(0.3)  # several idle passes
        assert store.stats()["load_errors"] == 1
        with pytest.raises(Exception, match="broken"):
            store.host.fetch("broken").result(timeout=30)
        assert store.stats()["load_errors"] == 2
    finally:
        fill.close()


def test_fill_ends_when_the_store_closes(make_store, tiny_cfg, rng):
    store = make_store()
    store.register("a", random_adapter(tiny_cfg, rng, "a", ranks=(4,)))
    fill = HostFill(store.host, idle_s=0.02).start()
    assert fill.complete.wait(30)
    store.close()
    fill._thread.join(5)
    assert not fill._thread.is_alive()


def test_fill_rejects_bad_settings(make_store):
    store = make_store()
    for bad in (dict(max_reads=0), dict(max_reads=3, busy_reads=2), dict(poll_s=0), dict(idle_s=-1)):
        with pytest.raises(ValueError):
            HostFill(store.host, **bad)


@pytest.mark.parametrize("flag,filled", [([], True), (["--no-host-fill"], False)])
def test_the_server_fills_host_memory_unless_told_not_to(tiny_dir, adapter_dirs, tmp_path, flag, filled):
    root = tmp_path / "adapters"
    root.mkdir()
    for name in ("r4-qkvo", "r8-all7"):
        (root / name).symlink_to(adapter_dirs[name], target_is_directory=True)
    args = ["--model", str(tiny_dir), "--adapter-dir", str(root), "--num-pages", "128", "--max-model-len", "64",
            "--no-warmup", "--no-compilation-cache", *flag]
    engine, _, _ = build_engine(build_parser().parse_args(args))
    try:
        names = ("r4-qkvo", "r8-all7")
        if filled:
            wait_for(lambda: in_host(engine.store, names) == set(names))
        else:
            time.sleep(0.3)
            assert in_host(engine.store, names) == set()
    finally:
        engine.store.close()


def test_engine_process_start_up_passes_over_the_fills_events():
    """With the fill on, the engine process may send adapter events before "ready"; start-up takes the ready facts
    (a "failed" still fails it)."""
    import multiprocessing

    from slora_jax.serve.engine_client import EngineClient

    class Alive:
        def is_alive(self):
            return True

    mine, theirs = multiprocessing.Pipe()
    theirs.send([("event", "a", "host_read", 0.1)])
    theirs.send([("event", "b", "host_read", 0.2), ("ready", {"pid": 7}), ("status", 0, 0, 0, None, None)])
    assert EngineClient._wait_ready(mine, Alive(), 10) == {"pid": 7}
    theirs.send([("event", "a", "host_read", 0.1)])
    theirs.send([("failed", "ValueError: bad flag")])
    with pytest.raises(RuntimeError, match="could not start: ValueError: bad flag"):
        EngineClient._wait_ready(mine, Alive(), 10)


def test_ray_replicas_do_not_fill_unless_asked():
    """Replicas share one host: each filling host memory with every adapter would multiply it by the replicas."""
    from slora_jax.serve.cli import host_fill

    parse = build_parser().parse_args
    assert host_fill(parse([])) and not host_fill(parse(["--no-host-fill"]))
    assert not host_fill(parse(["--ray"])) and host_fill(parse(["--ray", "--host-fill"]))
