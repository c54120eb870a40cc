"""In-process adapter reads (engine/read_workers.py's InlineReader, what the host tier uses with ``read processes =
0``) under the read timeout: a read that hangs fails as the adapter's error, the IO thread that waited on it goes on
to the next read (so as many hung reads as IO threads starve no healthy adapter), the hung thread ends quietly once
its read returns, and at most ``max_hung`` hung threads exist before reads fail at once."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np
import pytest

from slora_jax.engine.read_workers import InlineReader, ReadWorkers
from slora_jax.lora.errors import RETRY_AFTER_S, AdapterError
from slora_jax.lora.sources import AdapterSource, PeftDirSource
from slora_jax.tools import synth

TABLES = ("rank", "a_off", "b_off", "scale", "layer_num_vectors")
TIMEOUT_S = 0.5  # the test's read timeout (120 s in a server)


class HangingSource(AdapterSource):
    """A PEFT dir whose read blocks until ``gate`` is set (a network file system that does not answer), then reads."""

    def __init__(self, path, gate: threading.Event):
        self.inner, self.gate = PeftDirSource(path), gate

    def rank_table(self, name, model_cfg, max_rank):
        return self.inner.rank_table(name, model_cfg, max_rank)

    def load_rows(self, name, model_cfg, max_rank, dtype):
        self.gate.wait(60)  # bounded, so a broken test cannot leave a thread behind for good
        return self.inner.load_rows(name, model_cfg, max_rank, dtype)


@pytest.fixture
def gate():
    event = threading.Event()
    yield event
    event.set()  # whatever happened, every hung read ends


@pytest.fixture
def adapter_path(tmp_path, tiny_cfg, rng):
    return synth.write_adapter(tmp_path / "a", tiny_cfg, rank=4, seed=int(rng.integers(2**31)),
                               targets=("q_proj", "v_proj"))


def _inline_store(make_store, io_threads=4):
    store = make_store(io_threads=io_threads)
    assert isinstance(store.host._reader, InlineReader)  # read processes = 0: the CPU default
    store.host._reader.timeout_s = TIMEOUT_S
    return store


def _same_rows(got, want):
    assert got.vectors.dtype == want.vectors.dtype and got.vectors.shape == want.vectors.shape
    assert np.array_equal(np.asarray(got.vectors).view(np.uint8), np.asarray(want.vectors).view(np.uint8))
    for k in TABLES:
        g, w = getattr(got, k), getattr(want, k)
        assert g.dtype == w.dtype and np.array_equal(g, w), k


def _timed_out(future, name):
    """The read's error, within a few seconds (without the timeout the future never settles: TimeoutError)."""
    with pytest.raises(AdapterError, match=rf"'{name}': reading it took longer than {TIMEOUT_S:g} s") as e:
        future.result(timeout=10)
    assert e.value.adapter == name and e.value.retry_after_s == RETRY_AFTER_S  # a later retry may succeed


def _wait_unhung(reader, deadline_s=10.0):
    deadline = time.monotonic() + deadline_s
    while reader.hung and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.hung == 0


def test_a_hung_read_fails_as_the_adapters_error_after_the_timeout(make_store, adapter_path, gate):
    store = _inline_store(make_store, io_threads=1)
    store.register("stuck", HangingSource(adapter_path, gate))
    t0 = time.monotonic()
    _timed_out(store.host.fetch("stuck"), "stuck")
    assert TIMEOUT_S <= time.monotonic() - t0 < 8
    assert "longer than" in store.host.errors()["stuck"]  # recorded: requests for it get this error meanwhile
    assert store.host._reader.hung == 1
    with pytest.raises(AdapterError, match="'stuck': reading it took longer"):
        store.acquire("stuck")  # what a request gets


def test_as_many_hung_reads_as_io_threads_do_not_starve_a_healthy_adapter(make_store, adapter_path, gate,
                                                                           tiny_cfg):
    store = _inline_store(make_store, io_threads=4)
    stuck = [f"stuck{i}" for i in range(4)]
    for name in stuck:
        store.register(name, HangingSource(adapter_path, gate))
    store.register("good", adapter_path)
    hung = [store.host.fetch(name) for name in stuck]  # each IO thread takes one
    good = store.host.fetch("good")  # queued behind them
    t0 = time.monotonic()
    try:
        rows = good.result(timeout=10)
    except concurrent.futures.TimeoutError:
        pytest.fail("the healthy adapter's read waited behind the hung ones")
    assert time.monotonic() - t0 < 8
    _same_rows(rows, PeftDirSource(adapter_path).load_rows("good", tiny_cfg, store.host.max_rank, np.float32))
    for name, future in zip(stuck, hung, strict=True):
        _timed_out(future, name)
    assert store.host._reader.hung == 4 and not gate.is_set()  # still hung, not holding IO threads
    store.acquire("good")  # the whole path, into the pool
    store.release("good")


def test_released_reads_end_quietly_and_a_retry_reads_the_adapter(make_store, adapter_path, gate, tiny_cfg,
                                                                 caplog, monkeypatch):
    crashes = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    store = _inline_store(make_store, io_threads=2)
    for name in ("late0", "late1"):
        store.register(name, HangingSource(adapter_path, gate))
    for name in ("late0", "late1"):
        _timed_out(store.host.fetch(name), name)
    reader = store.host._reader
    assert reader.hung == 2
    with caplog.at_level(logging.WARNING, logger="slora_jax.engine.read_workers"):
        gate.set()
        _wait_unhung(reader)
        deadline = time.monotonic() + 10
        while any(t.name.startswith("adapter-read") for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name.startswith("adapter-read")]
    assert not crashes
    # counted by name: the previous test's hung reads (its gate set at its teardown) may end and log meanwhile
    ended = [r.getMessage() for r in caplog.records if "abandoned after the timeout ended" in r.getMessage()]
    assert sum("'late" in m for m in ended) == 2, ended
    assert "late0" in store.host.errors() and not store.host.has_rows("late0")  # late rows are dropped
    store.host.retry("late0")  # the disk is back: a retry reads it
    want = PeftDirSource(adapter_path).load_rows("late0", tiny_cfg, store.host.max_rank, np.float32)
    _same_rows(store.host.fetch("late0").result(timeout=10), want)
    store.acquire("late0")
    store.release("late0")


def test_past_max_hung_reads_fail_at_once_until_the_hung_ones_end(adapter_path, gate, tiny_cfg):
    reader = InlineReader(timeout_s=TIMEOUT_S, max_hung=2)
    for i in range(2):
        with pytest.raises(AdapterError, match="longer than"):
            reader.load_rows(HangingSource(adapter_path, gate), f"stuck{i}", tiny_cfg, 16, np.float32)
    t0 = time.monotonic()
    with pytest.raises(AdapterError, match=r"'good': not read: 2 earlier adapter reads still hang") as e:
        reader.load_rows(PeftDirSource(adapter_path), "good", tiny_cfg, 16, np.float32)
    assert time.monotonic() - t0 < TIMEOUT_S / 2 and e.value.retry_after_s == RETRY_AFTER_S  # no third thread
    gate.set()
    _wait_unhung(reader)
    _same_rows(reader.load_rows(PeftDirSource(adapter_path), "good", tiny_cfg, 16, np.float32),
               PeftDirSource(adapter_path).load_rows("good", tiny_cfg, 16, np.float32))


def test_an_adapters_own_error_still_comes_through(adapter_path, tiny_cfg):
    with pytest.raises(AdapterError, match=r"'big': .*rank 4 .*above the configured maximum 2"):
        InlineReader(timeout_s=TIMEOUT_S).load_rows(PeftDirSource(adapter_path), "big", tiny_cfg, 2, np.float32)


def test_worker_readers_in_process_reads_have_the_timeout_too(adapter_path, gate, tiny_cfg):
    """With read processes, sources that are not PEFT dirs (and reads the workers failed) are read in this process:
    under the workers' timeout too."""
    w = ReadWorkers(1, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(AdapterError, match=rf"'stuck': reading it took longer than {TIMEOUT_S:g} s"):
            w.load_rows(HangingSource(adapter_path, gate), "stuck", tiny_cfg, 16, np.float32)
        assert not w._all  # read in this process: no worker started
    finally:
        w.close()
