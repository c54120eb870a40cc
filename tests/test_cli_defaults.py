"""Defaults of ``python -m slora_jax.serve`` that size the engine: a batch can hold as many different adapters as it
has rows unless --max-loras says otherwise, and the engine built from the flags has that many slots."""

from __future__ import annotations

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
