"""Adapter reads in worker processes (engine/read_workers.py): the rows equal an in-process read bit for bit, an
adapter's faults come back as its AdapterError (the worker keeps serving), a dead worker is replaced and its read
retried in-process, and a store reading through workers serves the same pool contents."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from store_helpers import assert_holds

from slora_jax.engine.read_workers import ReadWorkers, WorkerLost
from slora_jax.lora.errors import RETRY_AFTER_S, AdapterError, AdapterNotAllowed
from slora_jax.lora.peft import load_peft_adapter
from slora_jax.lora.sources import PeftDirSource
from slora_jax.tools import synth

TABLES = ("rank", "a_off", "b_off", "scale", "layer_num_vectors")


@pytest.fixture(scope="module")
def workers():
    w = ReadWorkers(2)
    yield w
    w.close()


def _adapter(tmp_path, cfg, rng, name="a", **kw):
    kw = {"rank": int(rng.choice([2, 4, 8])), "seed": int(rng.integers(2**31)),
          "targets": tuple(rng.choice(["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], 3,
                                      replace=False)), **kw}
    return synth.write_adapter(tmp_path / name, cfg, **kw)


def _same_rows(got, want):
    assert got.vectors.dtype == want.vectors.dtype and got.vectors.shape == want.vectors.shape
    assert np.array_equal(got.vectors.view(np.uint8), want.vectors.view(np.uint8))  # bit for bit
    for k in TABLES:
        g, w = getattr(got, k), getattr(want, k)
        assert g.dtype == w.dtype and np.array_equal(g, w), k


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_rows_from_a_worker_equal_an_in_process_read(workers, tmp_path, tiny_cfg, rng, dtype):
    path = _adapter(tmp_path, tiny_cfg, rng)
    source = PeftDirSource(path)
    want = source.load_rows("a", tiny_cfg, 16, dtype)
    got = workers.read(source, "a", tiny_cfg, 16, dtype)
    assert got.name == "a"
    _same_rows(got, want)
    assert not list(workers._dir.iterdir())  # the transfer file is gone


def test_an_adapters_fault_is_its_error_and_the_worker_keeps_serving(workers, tmp_path, tiny_cfg, rng):
    bad = _adapter(tmp_path, tiny_cfg, rng, "bad", rank=8)
    with pytest.raises(AdapterError, match=r"rank 8 \(r\) is above the configured maximum 4") as e:
        workers.read(PeftDirSource(bad), "bad", tiny_cfg, 4, np.float32)
    assert e.value.adapter == "bad"
    corrupt = _adapter(tmp_path, tiny_cfg, rng, "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(os.urandom(200))
    with pytest.raises(AdapterError, match="'corrupt'") as e:
        workers.read(PeftDirSource(corrupt), "corrupt", tiny_cfg, 16, np.float32)
    assert e.value.retry_after_s is None  # a corrupt file stays corrupt
    gone = _adapter(tmp_path, tiny_cfg, rng, "gone")
    (gone / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="missing adapter_model.safetensors") as e:  # may be back later
        workers.read(PeftDirSource(gone), "gone", tiny_cfg, 16, np.float32)
    assert e.value.retry_after_s == RETRY_AFTER_S and e.value.adapter == "gone"
    cfg_path = corrupt / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "r": -3}))
    with pytest.raises(AdapterError):
        workers.read(PeftDirSource(corrupt), "corrupt", tiny_cfg, 16, np.float32)
    # a file outside the allowed dirs: the same class as an in-process read raises (HTTP 403)
    outside = _adapter(tmp_path / "out", tiny_cfg, rng, "x")
    with pytest.raises(AdapterNotAllowed):
        workers.read(PeftDirSource(outside, allowed_roots=(tmp_path / "allowed",)), "x", tiny_cfg, 16, np.float32)
    good = _adapter(tmp_path, tiny_cfg, rng, "good")
    _same_rows(workers.read(PeftDirSource(good), "good", tiny_cfg, 16, np.float32),
               PeftDirSource(good).load_rows("good", tiny_cfg, 16, np.float32))


def test_a_dead_worker_is_replaced(tmp_path, tiny_cfg, rng):
    w = ReadWorkers(1)
    try:
        path = _adapter(tmp_path, tiny_cfg, rng)
        assert not w._all  # started by the first read, not before
        w.read(PeftDirSource(path), "a", tiny_cfg, 16, np.float32)
        first = w._all[0]
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=30)
        with pytest.raises(WorkerLost):
            w.read(PeftDirSource(path), "a", tiny_cfg, 16, np.float32)
        assert first not in w._all
        _same_rows(w.read(PeftDirSource(path), "a", tiny_cfg, 16, np.float32),
                   PeftDirSource(path).load_rows("a", tiny_cfg, 16, np.float32))
        assert len(w._all) == 1 and w._all[0] is not first  # its replacement
    finally:
        w.close()
    assert not w._dir.exists() and first.proc.poll() is not None and not w._all
    with pytest.raises(WorkerLost, match="closed"):
        w.read(PeftDirSource(path), "a", tiny_cfg, 16, np.float32)


def test_concurrent_reads_each_get_their_own_rows(workers, tmp_path, tiny_cfg, rng):
    paths = {f"c{i}": _adapter(tmp_path, tiny_cfg, rng, f"c{i}") for i in range(6)}
    got, errors = {}, []

    def read(name):
        try:
            got[name] = workers.read(PeftDirSource(paths[name]), name, tiny_cfg, 16, np.float32)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(n,)) for n in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and set(got) == set(paths)
    for name, path in paths.items():
        _same_rows(got[name], PeftDirSource(path).load_rows(name, tiny_cfg, 16, np.float32))


def test_a_store_reading_in_workers_holds_the_adapters_and_records_failures(make_store, tmp_path, tiny_cfg, rng):
    store = make_store(read_processes=2)
    names = [f"s{i}" for i in range(3)]
    for name in names:
        store.register(name, _adapter(tmp_path, tiny_cfg, rng, name, rank=4))
    bad = _adapter(tmp_path, tiny_cfg, rng, "late-bad", rank=4)
    store.register("late-bad", bad)
    (bad / "adapter_model.safetensors").write_bytes(os.urandom(100))  # broken after registration: found at read
    for name in names:
        store.acquire(name)
        assert_holds(store, name, load_peft_adapter(tmp_path / name, tiny_cfg, name))
        store.release(name)
    with pytest.raises(AdapterError, match="late-bad"):
        store.acquire("late-bad")
    deadline = time.monotonic() + 30
    while "late-bad" not in store.host.errors() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "late-bad" in store.host.errors()
    workers_dir = store.host._reader._dir
    store.close()
    assert not workers_dir.exists()


class CrashingSource(PeftDirSource):
    """A PEFT dir whose read kills the reading process (what a file crafted to crash a parser would do)."""

    def load_rows(self, name, model_cfg, max_rank, dtype):
        os._exit(7)


class HangingSource(PeftDirSource):
    """A PEFT dir whose read never ends (what a file crafted to make a parser spin would do)."""

    def load_rows(self, name, model_cfg, max_rank, dtype):
        time.sleep(3600)


def test_a_read_that_hangs_is_stopped_and_fails_as_the_adapters_error(tmp_path, tiny_cfg, rng, monkeypatch):
    """The read fails after the timeout as the adapter's error; the worker is killed and the next read gets a fresh
    one. (The worker imports this module to unpickle the source: tests/ goes on its path.)"""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    w = ReadWorkers(1, timeout_s=120)  # a fresh worker's imports count in its first read: slow on a loaded CI box
    try:
        good = _adapter(tmp_path, tiny_cfg, rng, "good")
        w.read(PeftDirSource(good), "good", tiny_cfg, 16, np.float32)
        first = w._all[0]
        w.timeout_s = 3.0  # only the hanging read runs under the short timeout, in the worker already started
        t0 = time.monotonic()
        with pytest.raises(AdapterError, match="longer than 3 s") as e:
            w.read(HangingSource(good), "stuck", tiny_cfg, 16, np.float32)
        assert e.value.adapter == "stuck" and 3 <= time.monotonic() - t0 < 30
        assert e.value.retry_after_s == RETRY_AFTER_S  # a slow disk may recover: read again after a wait
        w.timeout_s = 120.0
        first.proc.wait(timeout=10)  # killed
        _same_rows(w.read(PeftDirSource(good), "good", tiny_cfg, 16, np.float32),
                   PeftDirSource(good).load_rows("good", tiny_cfg, 16, np.float32))
        assert w._all and w._all[0] is not first
    finally:
        w.close()


def test_a_read_that_kills_its_worker_twice_fails_as_the_adapters_error_never_in_process(tmp_path, tiny_cfg, rng,
                                                                                           monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    w = ReadWorkers(1)
    try:
        good = _adapter(tmp_path, tiny_cfg, rng, "good")
        with pytest.raises(AdapterError, match="stopped the reader twice") as e:
            w.load_rows(CrashingSource(good), "boom", tiny_cfg, 16, np.float32)  # not retried in this process
        assert e.value.adapter == "boom"
        _same_rows(w.load_rows(PeftDirSource(good), "good", tiny_cfg, 16, np.float32),
                   PeftDirSource(good).load_rows("good", tiny_cfg, 16, np.float32))
    finally:
        w.close()


def test_rows_that_cannot_be_handed_over_are_read_in_process(tmp_path, tiny_cfg, rng):
    """The transfer dir unusable (a full /dev/shm): not the adapter's fault; ``load_rows`` reads it here instead."""
    w = ReadWorkers(1)
    try:
        good = _adapter(tmp_path, tiny_cfg, rng, "good")
        real, w._dir = w._dir, tmp_path / "gone"  # writes there fail
        with pytest.raises(WorkerLost, match="could not hand"):
            w.read(PeftDirSource(good), "good", tiny_cfg, 16, np.float32)
        _same_rows(w.load_rows(PeftDirSource(good), "good", tiny_cfg, 16, np.float32),
                   PeftDirSource(good).load_rows("good", tiny_cfg, 16, np.float32))
        assert len(w._all) == 1  # the worker was fine and stays
        w._dir = real
    finally:
        w.close()


def test_reads_work_with_descriptors_above_1024(tmp_path, tiny_cfg, rng):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit ({hard}) is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    good = _adapter(tmp_path, tiny_cfg, rng, "good")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    high = []
    try:
        for _ in range(3):  # a descriptor another thread closed meanwhile may be reused: then try again
            w = ReadWorkers(1)
            try:
                _same_rows(w.read(PeftDirSource(good), "good", tiny_cfg, 16, np.float32),
                           PeftDirSource(good).load_rows("good", tiny_cfg, 16, np.float32))
                high.append(w._all[0].proc.stdout.fileno() > 1024)
            finally:
                w.close()
            if high[-1]:
                break
        assert any(high), "the worker's pipe never got a descriptor above 1024"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
