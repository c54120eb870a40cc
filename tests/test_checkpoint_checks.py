"""Base checkpoints we would serve wrongly are refused, naming why: tensors the config does not describe (they were
placed into larger zero slots and served finite, wrong logits), an untied config with no ``lm_head`` (the embedding
was used in its place), an activation other than SiLU, and a context past Mistral's attention window; a config
without ``rms_norm_eps`` gets HF's default."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from slora_jax.engine.config import EngineConfig
from slora_jax.model.config import ModelConfig
from slora_jax.model.loader import load_params
from slora_jax.model.streaming_loader import stream_params
from slora_jax.tools import synth

LOADERS = {"load_params": load_params, "stream_params": stream_params}


def _model(tmp_path, **changes):
    cfg = synth.preset_config("tiny") | changes
    return synth.write_model(tmp_path / "m", cfg, seed=int(np.random.default_rng().integers(1 << 30)))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("change,tensor,fields", [
    (dict(num_key_value_heads=4), "k_proj", "num_key_value_heads"),  # the file's tensors have 2 KV heads
    (dict(intermediate_size=192), "gate_proj", "intermediate_size"),
    (dict(vocab_size=640), "embed_tokens", "vocab_size"),
])
def test_a_config_that_does_not_describe_the_tensors_is_refused(tmp_path, loader, change, tensor, fields):
    path = _model(tmp_path)
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=rf"{tensor}.*has shape .*config\.json \([^)]*{fields}"):
        LOADERS[loader](path, jnp.float32, progress=False)


@pytest.mark.parametrize("loader", LOADERS)
def test_an_untied_config_without_lm_head_is_refused_and_a_tied_one_loads(tmp_path, loader):
    path = _model(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor 'lm_head.weight'.*tie_word_embeddings is false"):
        LOADERS[loader](path, jnp.float32, progress=False)
    _edit_config(path, tie_word_embeddings=True)
    cfg, params = LOADERS[loader](path, jnp.float32, progress=False)
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(params["embed"]).T)


def test_only_silu_is_served():
    base = synth.preset_config("tiny")
    for act in ("silu", "swish"):
        ModelConfig.from_dict(base | dict(hidden_act=act))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict(base | dict(hidden_act="gelu"))


def test_a_missing_rms_norm_eps_gets_hfs_default():
    from transformers import LlamaConfig, MistralConfig

    base = {k: v for k, v in synth.preset_config("tiny").items() if k != "rms_norm_eps"}
    assert ModelConfig.from_dict(base).rms_norm_eps == LlamaConfig().rms_norm_eps
    assert ModelConfig.from_dict(base | dict(model_type="mistral")).rms_norm_eps == MistralConfig().rms_norm_eps


def test_mistral_context_stops_at_its_sliding_window():
    """Our attention is fully causal: equal to Mistral's only within its window, so a longer context is refused
    (HF's MistralConfig windows at 4096 when the key is absent; null is no window)."""
    from transformers import MistralConfig

    base = synth.preset_config("tiny") | dict(model_type="mistral")
    absent = ModelConfig.from_dict(base)
    assert absent.sliding_window == MistralConfig().sliding_window == 4096
    assert ModelConfig.from_dict(base | dict(sliding_window=None)).sliding_window is None
    assert ModelConfig.from_dict(synth.preset_config("tiny")).sliding_window is None  # llama
    windowed = ModelConfig.from_dict(base | dict(sliding_window=64))
    ecfg = EngineConfig(max_model_len=64, max_prefill_tokens=64)
    assert ecfg.validate(windowed) is ecfg
    with pytest.raises(ValueError, match="max_model_len 65 is above the model's sliding_window \\(64\\)"):
        EngineConfig(max_model_len=65, max_prefill_tokens=65).validate(windowed)
    no_window = ModelConfig.from_dict(base | {"sliding_window": None})
    EngineConfig(max_model_len=65, max_prefill_tokens=65).validate(no_window)
    for bad in (0, -1, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
            ModelConfig.from_dict(base | dict(sliding_window=bad))
