"""Defaults of ``python -m slora_jax.serve`` that size the engine: a batch can hold as many different adapters as it
has rows unless --max-loras says otherwise, and the engine built from the flags has that many slots."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.serve.cli import batch_from_pool, batch_size, build_engine, build_parser, max_loras


@pytest.mark.parametrize("on_gpu,rows", [(True, 256), (False, 64)])
def test_adapter_slots_follow_the_batch_unless_set(on_gpu, rows):
    """A GPU's default batch is an upper bound the pool lowers; a batch the flags give is kept as given."""
    args = build_parser().parse_args([])
    assert batch_size(args, on_gpu) == rows and max_loras(args, rows) == rows
    assert batch_from_pool(args, on_gpu) == on_gpu
    args = build_parser().parse_args(["--max-batch-size", "48", "--max-loras", "5"])
    assert batch_size(args, on_gpu) == 48 and max_loras(args, 48) == 5
    assert not batch_from_pool(args, on_gpu)


@pytest.mark.parametrize("pool_tokens,bound,rows", [
    (208_000, 512, 512),  # a 7B model's pool on the H200: the bound
    (104_000, 512, 256),  # an 80 GB card: 406 rows' worth, down to the power of two below
    (65_536, 512, 256),  # exactly 256 tokens a row
    (65_535, 512, 128),
    (2_048, 512, 64),  # a small pool: never below 64
    (2_048, 48, 48),  # a bound below 64 stays
    (10**7, 512, 512),
])
def test_batch_from_pool_is_a_power_of_two_with_its_tokens_a_row(pool_tokens, bound, rows):
    ecfg = EngineConfig(max_batch_size=bound, batch_from_pool=True).with_platform_defaults("gpu")
    ecfg = ecfg.with_batch_from_pool(pool_tokens)
    assert ecfg.max_batch_size == rows and ecfg.decode_buckets[-1] >= rows > ecfg.decode_buckets[-2]
    assert EngineConfig(max_batch_size=bound).with_batch_from_pool(pool_tokens).max_batch_size == bound  # off


@pytest.mark.parametrize("num_pages,rows", [(128, 64), (2048, 128)])
def test_the_engine_lowers_its_batch_to_its_pool_and_serves(tiny_dir, num_pages, rows):
    """16-token pages: 128 pages hold 2048 tokens (8 rows' worth, raised to 64), 2048 pages 32768 (128 rows). The
    scheduler, the step's buckets and the sampler's rows all follow the lowered batch, and a request is served."""
    ecfg = EngineConfig(max_batch_size=512, batch_from_pool=True, num_pages=num_pages, max_model_len=64,
                        max_prefill_tokens=64, max_loras=4, max_lora_rank=8, dtype="float32")
    engine = Engine.from_model_dir(tiny_dir, ecfg, progress=False)
    try:
        assert engine.ecfg.max_batch_size == rows and engine.scheduler.ecfg.max_batch_size == rows
        assert engine.runner.ecfg.decode_buckets[-1] == rows
        assert engine.runner.penalty_state.counts.shape[0] == rows
        out = engine.generate([[3, 5, 7]], sampling=SamplingParams(temperature=0, max_tokens=3))
        assert len(out[0]) == 3
    finally:
        engine.store.close()


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


def test_a_gpu_server_without_a_batch_flag_takes_its_batch_from_the_pool(tiny_dir, monkeypatch):
    """The server's GPU default end to end (the platform check patched; CPU kernels): 128 pages of 16 tokens lower
    the server's bound (256 rows) to 64 rows, the slots stay at the bound, and --max-batch-size is kept as given."""
    from slora_jax.serve import cli

    monkeypatch.setattr(cli, "_on_gpu", lambda: True)
    base = ["--model", str(tiny_dir), "--num-pages", "128", "--max-model-len", "64", "--no-warmup",
            "--no-compilation-cache", "--backend", "reference", "--dtype", "float32"]
    engine, _, _ = build_engine(build_parser().parse_args(base))
    try:
        assert engine.ecfg.batch_from_pool and engine.ecfg.max_batch_size == 64
        assert engine.pool.max_slots == cli.GPU_BATCH_BOUND == 256
    finally:
        engine.store.close()
    engine, _, _ = build_engine(build_parser().parse_args(base + ["--max-batch-size", "200"]))
    try:
        assert not engine.ecfg.batch_from_pool and engine.ecfg.max_batch_size == 200
    finally:
        engine.store.close()


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


def test_no_mid_buckets_turns_the_platform_midpoints_off(tiny_dir, monkeypatch):
    """The platform's midpoint buckets (GPU: from 512 prefill rows and 128 decode rows; patched in here over the CPU
    tiles) reach the engine unless --no-mid-buckets, which sets both to 0 (powers of two only)."""
    import slora_jax.engine.config as engine_config

    cpu_tiles = engine_config.default_tiles

    def tiles_with_mids(backend, platform):
        # 16-row tiles and buckets from 16, so the 48-row midpoint exists on any platform (the GPU's tiles are larger)
        return {**cpu_tiles(backend, platform), "prefill_mid_buckets_from": 32, "decode_mid_buckets_from": 4,
                "lora_block_t": 16, "attn_block_q": 16, "min_prefill_bucket": 16}

    monkeypatch.setattr(engine_config, "default_tiles", tiles_with_mids)
    base = ["--model", str(tiny_dir), "--num-pages", "128", "--max-model-len", "64", "--max-batch-size", "8",
            "--no-warmup", "--no-compilation-cache", "--backend", "reference", "--dtype", "float32"]
    for flags, mids, prefill, decode in (([], (32, 4), 48, 6), (["--no-mid-buckets"], (0, 0), None, None)):
        engine, _, _ = build_engine(build_parser().parse_args(base + flags))
        try:
            ecfg = engine.runner.ecfg
            assert (ecfg.prefill_mid_buckets_from, ecfg.decode_mid_buckets_from) == mids, flags
            assert (prefill in ecfg.prefill_buckets) if prefill else all(b & (b - 1) == 0 for b in ecfg.prefill_buckets)
            assert (decode in ecfg.decode_buckets) if decode else all(b & (b - 1) == 0 for b in ecfg.decode_buckets)
        finally:
            engine.store.close()


def test_adapter_dir_skips_subdirs_whose_names_no_client_could_use(tiny_dir, tiny_cfg, tmp_path, caplog):
    """A subdir's name is the adapter's model name: one that is not UTF-8 (a lone surrogate once made every
    listing a 500), holds a control character, is the base model's or a mix's is skipped with its reason; the rest
    register."""
    import os

    from slora_jax.serve.cli import register_adapters
    from slora_jax.tools import synth

    good = ["ad-1", "caf\u00e9"]
    bad = [b"bad\xff", b"new\nline", b"tiny", b"mix:evil"]
    for raw in [os.fsencode(n) for n in good] + bad:
        synth.write_adapter(Path(os.fsdecode(os.fsencode(tmp_path) + b"/" + raw)), tiny_cfg, rank=4, seed=1)
    ecfg = EngineConfig(max_batch_size=4, num_pages=64, max_model_len=64, max_prefill_tokens=64, max_loras=4,
                        max_lora_rank=8, dtype="float32")
    engine = Engine.from_model_dir(tiny_dir, ecfg, progress=False)
    try:
        register_adapters(engine, "tiny", {}, [tmp_path])
        assert sorted(engine.adapter_names()) == sorted(good)
        assert "4 of 6 adapters" in caplog.text
        for name in ("bad\\udcff", "new\\nline", "base model", "mixes"):
            assert name in caplog.text, name
    finally:
        engine.store.close()
