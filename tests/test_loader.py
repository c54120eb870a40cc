"""HF checkpoint dirs load into our params: single file and sharded agree; config fields are read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from slora_jax.model.config import ModelConfig
from slora_jax.model.loader import load_params
from slora_jax.tools.synth import write_model


def test_sharded_checkpoint_equals_single_file(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    single = write_model(tmp_path / "single", "tiny", seed=seed)
    sharded = write_model(tmp_path / "sharded", "tiny", seed=seed, shard_bytes=64 * 1024)
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    _, a = load_params(single, dtype=jnp.float32, progress=False)
    _, b = load_params(sharded, dtype=jnp.float32, progress=False)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bf16_params_and_stacked_layers(tiny_dir, tiny_cfg):
    _, params = load_params(tiny_dir, progress=False)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    qkv = params["layers"]["qkv_proj"]["kernel"]
    assert qkv.shape == (tiny_cfg.num_hidden_layers, tiny_cfg.hidden_size, tiny_cfg.q_width + 2 * tiny_cfg.kv_width)


def test_unstacked_layers_equal_the_stacked_ones(tiny_dir, tiny_cfg):
    """For an unrolled layer loop the loader hands out one dict per layer, the same weights as the stack."""
    _, stacked = load_params(tiny_dir, dtype=jnp.float32, progress=False)
    _, layers = load_params(tiny_dir, dtype=jnp.float32, progress=False, stacked=False)
    assert isinstance(layers["layers"], list) and len(layers["layers"]) == tiny_cfg.num_hidden_layers
    for i, layer in enumerate(layers["layers"]):
        for x, y in zip(jax.tree.leaves(layer), jax.tree.leaves(stacked["layers"]), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y)[i])
    for key in ("embed", "norm", "lm_head"):
        for x, y in zip(jax.tree.leaves(layers[key]), jax.tree.leaves(stacked[key]), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_config_reads_llama3_scaling_tied_and_gqa(model_dirs):
    cfg = ModelConfig.from_model_dir(model_dirs["tiny-llama3"])
    assert cfg.tie_word_embeddings and cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 4
    assert ModelConfig.from_model_dir(model_dirs["tiny-mha"]).num_key_value_heads == 4
