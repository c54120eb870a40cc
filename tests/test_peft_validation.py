"""Every adapter we cannot serve exactly is rejected at load, naming the adapter and the reason; the cheap
register-time check (``peft_ranks``) and the full load apply the same rank rules."""

from __future__ import annotations

import dataclasses
import json
import math

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from slora_jax.lora.peft import AdapterError, load_peft_adapter, peft_ranks, read_adapter_config
from slora_jax.lora.pool_rows import check_adapter_modules
from slora_jax.lora.sources import InMemorySource, PeftDirSource
from slora_jax.model.adapter_weights import LoraAdapter
from slora_jax.model.config import MODULE_INDEX
from slora_jax.tools.synth import write_adapter


@pytest.fixture
def good(tmp_path, tiny_cfg):
    return write_adapter(tmp_path / "good", tiny_cfg, rank=8, seed=int(np.random.default_rng().integers(1 << 30)))


def _edit_config(path, **changes):
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    st = path / "adapter_model.safetensors"
    tensors = load_file(str(st))
    fn(tensors)
    save_file(tensors, str(st))


def _rejects(path, cfg, match, **kw):
    with pytest.raises(AdapterError, match=match) as info:
        load_peft_adapter(path, cfg, name="bad-one", **kw)
    assert "bad-one" in str(info.value)


def test_good_adapter_loads_with_peft_scaling(good, tiny_cfg):
    adapter = load_peft_adapter(good, tiny_cfg)
    assert len(adapter.modules) == 4 * tiny_cfg.num_hidden_layers
    module = adapter.modules[(0, "q_proj")]
    assert module.a.shape == (tiny_cfg.hidden_size, 8) and module.b.shape == (8, tiny_cfg.q_width)
    assert math.isclose(module.scale, 16 / 8)


def test_rejects_dora(good, tiny_cfg):
    _edit_config(good, use_dora=True)
    _rejects(good, tiny_cfg, "DoRA")


def test_rejects_bias(good, tiny_cfg):
    _edit_config(good, bias="lora_only")
    _rejects(good, tiny_cfg, "bias")


def test_rejects_modules_to_save(good, tiny_cfg):
    _edit_config(good, modules_to_save=["lm_head"])
    _rejects(good, tiny_cfg, "modules_to_save")


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_rejects_lora_on_embeddings_or_lm_head(good, tiny_cfg, target):
    _edit_config(good, target_modules=["q_proj", target])
    _rejects(good, tiny_cfg, "not supported")


def test_rejects_embedding_weights_in_file(good, tiny_cfg):
    _edit_tensors(good, lambda t: t.update(
        {"base_model.model.model.embed_tokens.lora_embedding_A": np.ones((8, tiny_cfg.vocab_size), np.float32)}))
    _rejects(good, tiny_cfg, "embeddings")


def test_target_names_a_llama_lacks_match_nothing_and_other_modules_are_refused(good, tiny_cfg):
    """As PEFT: a generic target list's names that no Llama module has are ignored (was: the adapter was refused);
    a Llama module that is not a projection is refused; tensors of a module the model lacks are refused."""
    targets = json.loads((good / "adapter_config.json").read_text())["target_modules"]
    _edit_config(good, target_modules=list(targets) + ["query_key_value", "dense"])
    assert len(load_peft_adapter(good, tiny_cfg).modules) == 4 * tiny_cfg.num_hidden_layers
    _edit_config(good, target_modules=["q_proj", "mlp"])
    _rejects(good, tiny_cfg, "not a linear projection")
    _edit_config(good, target_modules=list(targets) + ["w_pack"])
    key = "base_model.model.model.layers.0.self_attn.w_pack.lora_A.weight"
    _edit_tensors(good, lambda t: t.update({key: np.ones((8, tiny_cfg.hidden_size), np.float32)}))
    _rejects(good, tiny_cfg, "unknown target module in tensor")


def test_rejects_shape_mismatch(good, tiny_cfg):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    _edit_tensors(good, lambda t: t.update({key: np.random.default_rng().standard_normal((tiny_cfg.q_width * 2, 8),
                                                                                         dtype=np.float32)}))
    _rejects(good, tiny_cfg, "do not match the base model")


def test_rejects_rank_above_maximum(good, tiny_cfg):
    _rejects(good, tiny_cfg, "above the configured maximum", max_rank=4)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_rejects_non_finite_weights(good, tiny_cfg, bad):
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"

    def poison(t):
        t[key] = t[key].copy()
        t[key][0, 3] = bad

    _edit_tensors(good, poison)
    _rejects(good, tiny_cfg, "non-finite")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("which", ["a", "b"])
def test_an_in_memory_adapter_with_a_non_finite_weight_is_rejected(good, tiny_cfg, bad, which):
    """The value check alone (no file reader before it): one bad entry in A or in B, anywhere, in any module."""
    adapter = load_peft_adapter(good, tiny_cfg, "good")
    rng = np.random.default_rng()
    key = list(adapter.modules)[int(rng.integers(len(adapter.modules)))]
    mod = adapter.modules[key]
    poisoned = np.array(getattr(mod, which), np.float32)
    poisoned[tuple(int(rng.integers(n)) for n in poisoned.shape)] = bad
    modules = dict(adapter.modules)
    modules[key] = dataclasses.replace(mod, **{which: poisoned})
    source = InMemorySource(LoraAdapter(name="poisoned", modules=modules))
    with pytest.raises(AdapterError, match="non-finite"):
        source.load_rows("poisoned", tiny_cfg, 64, ml_dtypes.bfloat16)
    assert InMemorySource(adapter).load_rows("good", tiny_cfg, 64, ml_dtypes.bfloat16).nbytes > 0


def test_rejects_missing_config(good, tiny_cfg):
    (good / "adapter_config.json").unlink()
    _rejects(good, tiny_cfg, "missing adapter_config.json")


def test_rejects_missing_weights(good, tiny_cfg):
    (good / "adapter_model.safetensors").unlink()
    _rejects(good, tiny_cfg, "missing adapter_model.safetensors")


def test_rejects_unreadable_config(good, tiny_cfg):
    (good / "adapter_config.json").write_text("{not json")
    _rejects(good, tiny_cfg, "unreadable adapter_config.json")


def test_rejects_corrupt_weights(good, tiny_cfg):
    (good / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage-not-a-header")
    _rejects(good, tiny_cfg, "unreadable adapter_model.safetensors")


def test_rejects_missing_directory(tmp_path, tiny_cfg):
    _rejects(tmp_path / "nowhere", tiny_cfg, "not a directory")


def test_rejects_targeted_module_without_weights(good, tiny_cfg):
    _edit_tensors(good, lambda t: [t.pop(k) for k in list(t) if "layers.1.self_attn.k_proj" in k])
    _rejects(good, tiny_cfg, "no weights for targeted")


def test_rejects_layer_beyond_model(good, tiny_cfg):
    _edit_config(good, layers_to_transform=[0, 5])
    _rejects(good, tiny_cfg, "outside the model")


def test_register_check_and_load_agree_on_every_rank(tmp_path, tiny_cfg):
    path = write_adapter(tmp_path / "patterns", tiny_cfg, rank=8, targets=("q_proj", "v_proj", "o_proj", "down_proj"),
                         rank_pattern={"o_proj": 4, r"layers\.1\.self_attn\.q_proj": 16}, layers_to_transform=[1])
    ranks = peft_ranks(read_adapter_config(path, "p"), "p", tiny_cfg, max_rank=16)
    adapter = load_peft_adapter(path, tiny_cfg, max_rank=16)
    assert ranks == {key: mod.rank for key, mod in adapter.modules.items()}
    assert ranks == check_adapter_modules(adapter, tiny_cfg)
    assert ranks[(1, "q_proj")] == 16 and ranks[(1, "o_proj")] == 4 and ranks[(1, "v_proj")] == 8
    table = PeftDirSource(path).rank_table("p", tiny_cfg, 16)
    assert {(int(layer), m): int(table[layer, MODULE_INDEX[m]]) for layer, m in ranks} == ranks
    assert int(table.sum()) == sum(ranks.values())


@pytest.mark.parametrize("rank", ["8", 2.5, True, 0])
def test_rejects_a_rank_that_is_not_a_positive_int_at_register_and_at_load(good, tiny_cfg, rank):
    _edit_config(good, rank_pattern={"q_proj": rank})
    _rejects(good, tiny_cfg, "ranks must be ints >= 1|invalid adapter_config.json")
    with pytest.raises(AdapterError, match="ranks must be ints >= 1|invalid adapter_config.json"):
        PeftDirSource(good).rank_table("bad-one", tiny_cfg, 16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_half_and_double_precision_weights_load_as_their_float32_values(good, tiny_cfg, dtype):
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    reference = load_peft_adapter(good, tiny_cfg)
    _edit_tensors(good, lambda t: t.update({k: v.astype(np_dtype) for k, v in t.items()}))
    adapter = load_peft_adapter(good, tiny_cfg)
    for key, module in reference.modules.items():
        expected = module.a.astype(np_dtype).astype(np.float32)
        np.testing.assert_array_equal(adapter.modules[key].a, expected)
        assert adapter.modules[key].a.dtype == np.float32 and adapter.modules[key].scale == module.scale


def test_a_config_edited_after_its_check_is_checked_again(good, tiny_cfg):
    """Checked configs are remembered by content: the same bytes skip the pattern work, changed bytes do not."""
    assert load_peft_adapter(good, tiny_cfg, max_rank=8).max_rank == 8
    _edit_config(good, lora_alpha=float("nan"))
    _rejects(good, tiny_cfg, "lora_alpha is nan")
    _edit_config(good, lora_alpha=4.0, r=8)
    assert math.isclose(load_peft_adapter(good, tiny_cfg).modules[(1, "q_proj")].scale, 0.5)
    _rejects(good, tiny_cfg, "above the configured maximum 4", max_rank=4)


def test_peft_ranks_refuses_what_is_not_a_config(tiny_cfg):
    for cfg in ([], "LORA", None, {"target_modules": ["q_proj"], "r": [4]}):
        with pytest.raises(AdapterError, match="bad-one"):
            peft_ranks(cfg, "bad-one", tiny_cfg, max_rank=16)
