"""The tokenizer loads in a thread beside the weights and the warm-up (transformers' import takes seconds of every
start): the engine and the server still get it, and one that fails to load still stops the start with its error."""

from __future__ import annotations

import os
import threading

import pytest

from slora_jax.serve import cli
from slora_jax.tools import tokenizer as tokenizer_module

FLAGS = ["--max-batch-size", "4", "--num-pages", "64", "--max-model-len", "64", "--no-warmup", "--no-compilation-cache",
         "--no-host-fill"]


@pytest.fixture
def model_with_tokenizer(tiny_dir, tiny_cfg, tmp_path):
    """The tiny model's files (linked) plus a tokenizer of its vocabulary."""
    out = tmp_path / "model"
    out.mkdir()
    for f in tiny_dir.iterdir():
        os.symlink(f, out / f.name)
    tokenizer_module.write_tokenizer(out, tiny_cfg.vocab_size)
    return out


def test_the_tokenizer_loads_off_the_main_thread_and_reaches_engine_and_server(model_with_tokenizer, monkeypatch):
    threads = []
    real = tokenizer_module.load_tokenizer

    def recording(model_dir):
        threads.append(threading.current_thread().name)
        return real(model_dir)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", recording)
    args = cli.build_parser().parse_args(["--model", str(model_with_tokenizer), *FLAGS])
    engine, _, server_tokenizer = cli.build_engine(args)
    assert threads[0].startswith("slora-tokenizer") and threads[0] != threading.main_thread().name
    assert engine.tokenizer is not None and server_tokenizer is not None
    text = "hello there"
    assert engine.tokenizer.decode(engine.tokenizer.encode(text, add_special_tokens=False)) == text
    assert server_tokenizer is not engine.tokenizer  # the server's own copy


def test_a_tokenizer_that_fails_to_load_stops_the_start(tiny_dir, monkeypatch):
    def broken(model_dir):
        raise ValueError("tokenizer.json is corrupt")

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", broken)
    with pytest.raises(ValueError, match="corrupt"):
        cli.build_engine(cli.build_parser().parse_args(["--model", str(tiny_dir), *FLAGS]))
