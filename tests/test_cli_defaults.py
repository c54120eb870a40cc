"""Defaults of ``python -m slora_jax.serve`` that size the engine: a batch can hold as many different adapters as it
has rows unless --max-loras says otherwise, and the engine built from the flags has that many slots."""

from __future__ import annotations

import jax
import pytest

from slora_jax.serve.cli import batch_size, build_engine, build_parser, max_loras


@pytest.mark.parametrize("on_gpu,rows", [(True, 256), (False, 64)])
def test_adapter_slots_follow_the_batch_unless_set(on_gpu, rows):
    args = build_parser().parse_args([])
    assert batch_size(args, on_gpu) == rows and max_loras(args, rows) == rows
    args = build_parser().parse_args(["--max-batch-size", "48", "--max-loras", "5"])
    assert batch_size(args, on_gpu) == 48 and max_loras(args, 48) == 5


def test_the_engine_built_from_the_flags_has_one_slot_per_row(tiny_dir):
    args = build_parser().parse_args(["--model", str(tiny_dir), "--max-batch-size", "12", "--num-pages", "128",
                                      "--max-model-len", "64", "--no-warmup", "--no-compilation-cache"])
    engine, _, _ = build_engine(args)
    assert engine.pool.max_slots == engine.ecfg.max_batch_size == 12
    args = build_parser().parse_args(["--model", str(tiny_dir), "--max-batch-size", "12", "--max-loras", "3",
                                      "--num-pages", "128", "--max-model-len", "64", "--no-warmup",
                                      "--no-compilation-cache"])
    engine, _, _ = build_engine(args)
    assert engine.pool.max_slots == 3


def test_adapter_host_memory_and_read_processes_follow_the_host_unless_set(tiny_dir, monkeypatch):
    """Host rows: 40% of the memory available at start unless --adapter-host-gb; reads on the IO threads on CPU
    unless --adapter-read-processes (5 worker processes on an accelerator)."""
    from slora_jax.engine import compile_counter
    from slora_jax.engine.config import resolve_host_budget, resolve_read_processes
    from slora_jax.engine.read_workers import InlineReader, ReadWorkers

    assert resolve_host_budget(None, 100 << 30) == 40 << 30 and resolve_host_budget(None, 1 << 30) == 1 << 30
    assert resolve_host_budget(None, 1 << 50) == 8 << 30 and resolve_host_budget(123, 1 << 40) == 123
    assert resolve_read_processes(None, "cpu") == 0 and resolve_read_processes(None, "gpu") == 5
    assert resolve_read_processes(2, "cpu") == 2
    with pytest.raises(ValueError, match="adapter_read_processes"):
        resolve_read_processes(-1, "gpu")
    monkeypatch.setattr(compile_counter, "available_memory", lambda: 30 << 30)
    base = ["--model", str(tiny_dir), "--num-pages", "128", "--max-model-len", "64", "--no-warmup",
            "--no-compilation-cache"]
    on_cpu = jax.default_backend() == "cpu"
    engine, _, _ = build_engine(build_parser().parse_args(base))
    try:
        assert engine.store.host.host_budget_bytes == 12 << 30
        assert isinstance(engine.store.host._reader, InlineReader if on_cpu else ReadWorkers)
        assert (engine.runner._stable is None) == on_cpu  # stable step inputs: on by default only on a GPU
    finally:
        engine.store.close()
    engine, _, _ = build_engine(build_parser().parse_args(base + ["--adapter-host-gb", "0.5",
                                                                  "--adapter-read-processes", "1"]))
    try:
        assert engine.store.host.host_budget_bytes == 1 << 29 and isinstance(engine.store.host._reader, ReadWorkers)
        assert engine.store.host._reader._n == 1
    finally:
        engine.store.close()
    engine, _, _ = build_engine(build_parser().parse_args(base + ["--stable-step-inputs"]))
    try:
        assert engine.runner._stable is not None
    finally:
        engine.store.close()


def test_available_memory_follows_a_cgroup_limit(tmp_path):
    """A container's memory limit (cgroup v2 or v1) bounds what the host defaults see; "max" is no limit."""
    from slora_jax.engine.compile_counter import _cgroup_room

    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    files = ((str(limit), str(usage)),)
    usage.write_text("3000\n")
    limit.write_text("10000\n")
    assert _cgroup_room(files) == 7000
    limit.write_text("max\n")
    assert _cgroup_room(files) is None
    limit.write_text("2000\n")
    assert _cgroup_room(files) == 0
    assert _cgroup_room(((str(tmp_path / "none"), str(usage)),)) is None
