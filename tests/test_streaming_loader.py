"""The streaming HF loader and the converted-params checkpoint.

Streamed params equal the reference loader's (our layout, cast the same way; at TP2 the tensor-parallel layout of
``TensorParallel.place_params``), from float32 and bfloat16 checkpoints, stacked and per layer. A fresh process
loading a few-hundred-MB checkpoint holds, beyond the params, less than a tenth of the checkpoint plus a fixed
allowance, where the reference loader holds three times the checkpoint. orbax restores what it saved, and only for
the same model and layout.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from slora_jax.model import params_checkpoint
from slora_jax.model.config import ModelConfig
from slora_jax.model.loader import load_params
from slora_jax.model.sharding import TensorParallel
from slora_jax.model.streaming_loader import index_checkpoint, layer_tensor_names, read_header, stream_params
from slora_jax.tools import synth

ROOT = Path(__file__).resolve().parent.parent
needs_2 = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (conftest forces 4 CPU devices)")


def _same(a, b, placement: bool = True) -> bool:
    """Equal values (as float32), dtypes and (with ``placement``) shardings, leaf by leaf."""
    def leaf(x, y):
        placed = not placement or x.sharding.is_equivalent_to(y.sharding, x.ndim)
        return (x.dtype == y.dtype and x.shape == y.shape and placed
                and np.array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32)))
    return all(jax.tree.leaves(jax.tree.map(leaf, a, b)))


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("size", [1, pytest.param(2, marks=needs_2)])
def test_streamed_params_equal_the_reference_loader(model_dirs, stacked, size):
    model_dir = model_dirs["tiny-llama3"]  # tied embeddings: lm_head from the embedding
    cfg, ref = load_params(model_dir, dtype=jnp.bfloat16, progress=False, stacked=stacked)
    tp = TensorParallel.maybe(cfg, size)
    _, ours = stream_params(model_dir, jnp.bfloat16, tp=tp, stacked=stacked, progress=False)
    if tp is not None:
        ref = tp.place_params(ref)
        assert tp.is_placed(ours)
    else:
        ref = jax.device_put(ref, jax.devices()[0])
    assert _same(ours, ref)


@needs_2
def test_bfloat16_checkpoint_streams_its_own_values(tmp_path):
    preset = synth.preset_config("tiny")
    f32 = synth.write_model(tmp_path / "f32", preset, seed=5)
    bf16 = synth.write_model(tmp_path / "bf16", preset, seed=5, dtype=ml_dtypes.bfloat16)
    assert {e.dtype for e in read_header(bf16 / "model.safetensors").values()} == {np.dtype(ml_dtypes.bfloat16)}
    tp = TensorParallel.create(ModelConfig.from_model_dir(f32), 2)
    _, from_f32 = stream_params(f32, jnp.bfloat16, tp=tp, stacked=False, progress=False)
    _, from_bf16 = stream_params(bf16, jnp.bfloat16, tp=tp, stacked=False, progress=False)
    assert _same(from_bf16, from_f32)  # bf16(x) either way: rounding once on the host
    _, widened = stream_params(bf16, jnp.float32, tp=tp, stacked=False, progress=False)
    assert _same(jax.tree.map(lambda x: x.astype(jnp.bfloat16), widened), from_f32)


def test_read_ahead_names_every_layer_tensor_in_the_order_the_layer_reads_them(tiny_dir):
    """The loader reads layer i+1 on a thread while it places layer i: the names it prefetches must be the ones
    the layer then asks for (a wrong name would read twice; a missing one, inline)."""
    from slora_jax.model.streaming_loader import _layer_params

    cfg = ModelConfig.from_model_dir(tiny_dir)
    entries = index_checkpoint(tiny_dir)
    asked = []

    class Placer:
        n = 1

        def place(self, name, shape, local):
            return local(0)

        def place_kernel(self, name, shape, parts_of):
            return parts_of(0)

    def read(name):
        asked.append(name)
        return np.zeros(entries[name].shape, np.float32)

    for i in range(cfg.num_hidden_layers):
        asked.clear()
        _layer_params(cfg, i, read, Placer())
        assert asked == layer_tensor_names(i) and set(asked) <= set(entries)


def test_reader_refuses_broken_files(tmp_path, tiny_dir):
    path = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    with pytest.raises(ValueError, match="dtype I8"):
        read_header(path)
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ValueError, match="8 bytes for shape"):
        read_header(path)
    path.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="implausibly large"):
        read_header(path)
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text((tiny_dir / "config.json").read_text())
    data = (tiny_dir / "model.safetensors").read_bytes()
    (short / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="file ends inside a tensor"):
        stream_params(short, jnp.float32, progress=False)


@needs_2
def test_converted_params_restore_only_for_the_same_model_and_layout(tmp_path, tiny_dir, monkeypatch):
    cache = tmp_path / "converted"
    tp = TensorParallel.create(ModelConfig.from_model_dir(tiny_dir), 2)
    _, first = params_checkpoint.load_serving_params(tiny_dir, jnp.bfloat16, tp=tp, stacked=False, progress=False,
                                                     converted_dir=cache)
    key = params_checkpoint.checkpoint_key(tp, jnp.bfloat16, False)
    assert key == "tp2-bfloat16-unroll" and (cache / key / params_checkpoint.META).exists()

    def no_streaming(*a, **kw):
        raise AssertionError("should have been restored")

    with monkeypatch.context() as m:
        m.setattr(params_checkpoint, "stream_params", no_streaming)
        _, restored = params_checkpoint.load_serving_params(tiny_dir, jnp.bfloat16, tp=2, stacked=False,
                                                            progress=False, converted_dir=cache)
    assert _same(restored, first) and tp.is_placed(restored)
    # another layout is another key (streamed and saved beside it); another model's config is never restored
    _, stacked = params_checkpoint.load_serving_params(tiny_dir, jnp.bfloat16, tp=tp, stacked=True, progress=False,
                                                       converted_dir=cache)
    assert _same(stacked["layers"], jax.tree.map(lambda *xs: jnp.stack(xs), *first["layers"]), placement=False)
    other = ModelConfig.from_dict(dict(synth.preset_config("tiny"), rms_norm_eps=1e-3))
    target = params_checkpoint.param_shapes(other, jnp.bfloat16, tp, stacked=False)
    assert params_checkpoint.restore_params(cache / key, other, key, target) is None


def test_host_memory_while_loading_stays_a_fraction_of_the_checkpoint(tmp_path):
    """A ~340 MB float32 checkpoint in 3 shards (24 layers) and a 2-layer one of the same widths, each loaded as
    bfloat16 onto 2 devices in a fresh process (probe: tests/load_memory_probe.py). The claim is about what *grows*
    with the checkpoint: the big load's staging may exceed the small one's by a tenth of the extra bytes plus the
    layer read ahead. The small load measures what does not grow (the loader's jit compiles, the allocator's arenas,
    the XLA CPU client's thread pools, the replicated embedding); that part differs between hosts (121 MB on the
    2-core box, 154 MB on the 16-core GPU machine, whose fixed 96 MiB allowance broke). The brief's absolute bound
    for real checkpoints, a tenth plus 2 GB, is checked too. The reference loader, as a control, must break both."""
    widths = dict(synth.preset_config("tiny"), vocab_size=8192, hidden_size=512, intermediate_size=1536,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    big = synth.write_model(tmp_path / "big", dict(widths, num_hidden_layers=24), seed=3, shard_bytes=128 << 20)
    small = synth.write_model(tmp_path / "small", dict(widths, num_hidden_layers=2), seed=4, shard_bytes=128 << 20)

    def probe(model_dir, how: str) -> dict:
        # few malloc arenas: with one per thread, what a load leaves resident varies by tens of MB between runs
        env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_ARENA_MAX="2")
        out = subprocess.run([sys.executable, str(ROOT / "tests" / "load_memory_probe.py"), str(model_dir), how],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, f"probe {how!r} failed:\n{out.stderr[-3000:]}"
        return json.loads(out.stdout.strip().splitlines()[-1])

    def growth(how: str) -> tuple[int, int, dict]:
        b, s = probe(big, how), probe(small, how)
        return b["staging_bytes"] - s["staging_bytes"], b["checkpoint_bytes"] - s["checkpoint_bytes"], b

    grew, extra, stream = growth("stream")
    # + one layer: the next layer's tensors are read while this one is placed (~14 MB here)
    bound = extra // 10 + extra // 22
    if grew > bound:  # once more: a host busy with other work (the GPU suite's 14 workers) can add ~50 MB of noise
        grew = min(grew, growth("stream")[0])  # the eager control still grows by 15x the bound
    assert extra > 250 << 20
    assert stream["device_bytes"] >= stream["checkpoint_bytes"] // 2  # bfloat16 params (replicated embeddings twice)
    assert grew <= bound, (grew, bound, stream)
    assert stream["staging_bytes"] <= stream["checkpoint_bytes"] // 10 + (2 << 30)
    eager_grew, _, eager = growth("eager")
    assert eager_grew > 2 * extra > bound, (eager_grew, eager)  # the measurement tells the two loaders apart


@needs_2
def test_kernel_transposes_compile_per_shape_not_per_device(tmp_path):
    """Kernels are transposed on the devices after they land in HF layout: one compile per kernel shape and
    sharding (5 for the tiny model: qkv, o, gate_up, down, lm_head), on 2 devices as on 1 (transposing each device's
    block on its own would compile once per device), and none when the same load runs again."""
    compiled = []
    listening = [True]

    def listen(event, secs, **kwargs):
        if listening[0] and event == "/jax/core/compile/backend_compile_duration" \
                and "_transpose" in str(kwargs.get("fun_name", "")):
            compiled.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        # shapes of its own, so no other test's load has compiled them in this process
        preset = dict(synth.preset_config("tiny"), hidden_size=96, intermediate_size=160, vocab_size=136,
                      num_attention_heads=6, head_dim=16)
        model_dir = synth.write_model(tmp_path / "odd", preset, seed=5)
        cfg = ModelConfig.from_model_dir(model_dir)
        counts = []
        for tp in (TensorParallel.create(cfg, 2), None, TensorParallel.create(cfg, 2)):
            compiled.clear()
            stream_params(model_dir, jnp.bfloat16, tp=tp, stacked=True, progress=False)
            counts.append(len(compiled))
        assert counts == [5, 5, 0], counts  # per device: [10, 0, 0]
    finally:
        listening[0] = False
