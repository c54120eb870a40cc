"""A bfloat16 pool takes a BF16 adapter file's bits as they are (no float32 round trip): the rows must be exactly
the float32 route's, and every value check must refuse what that route refuses, with the same reason."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from slora_jax.lora.peft import AdapterError, load_peft_adapter
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.lora.sources import PeftDirSource
from slora_jax.model.config import MODULES
from slora_jax.tools import synth

WEIGHTS = "adapter_model.safetensors"
BF16 = ml_dtypes.bfloat16


def _write(path, cfg, **kw):
    seed = int(np.random.default_rng().integers(1 << 30))
    return synth.write_adapter(path, cfg, **{"rank": 4, "seed": seed, "dtype": BF16, **kw})


def _float32_route(path, cfg, dtype):
    """What a read did before: every tensor to float32, then laid out."""
    return to_pool_rows(load_peft_adapter(path, cfg), cfg, dtype)


def _edit(path, edit):
    found = load_file(str(path / WEIGHTS))
    edit(found)
    save_file(found, str(path / WEIGHTS))


def _key(layer, module, which="A"):
    parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{which}.weight"


@pytest.mark.parametrize("targets", [MODULES[:4], MODULES], ids=["qkvo", "all7"])
def test_bf16_rows_are_bit_identical_to_the_float32_route(tmp_path, tiny_cfg, targets):
    path = _write(tmp_path / "a", tiny_cfg, targets=targets, rank=8)
    assert all(t.dtype == BF16 for t in load_file(str(path / WEIGHTS)).values())
    fast = PeftDirSource(path).load_rows("a", tiny_cfg, 16, BF16)
    slow = _float32_route(path, tiny_cfg, BF16)
    assert fast.vectors.dtype == BF16 and fast.vectors.shape == slow.vectors.shape
    np.testing.assert_array_equal(fast.vectors.view(np.uint16), slow.vectors.view(np.uint16))
    for table in ("rank", "a_off", "b_off", "scale", "layer_num_vectors"):
        np.testing.assert_array_equal(getattr(fast, table), getattr(slow, table))
    assert np.abs(fast.vectors.astype(np.float32)).max() > 0  # real weights, not an empty layout


def test_a_file_mixing_dtypes_takes_the_float32_route_where_it_must(tmp_path, tiny_cfg):
    path = _write(tmp_path / "a", tiny_cfg)
    _edit(path, lambda t: t.update({_key(1, "k_proj", "B"): t[_key(1, "k_proj", "B")].astype(np.float32)}))
    fast = PeftDirSource(path).load_rows("a", tiny_cfg, 16, BF16)
    np.testing.assert_array_equal(fast.vectors.view(np.uint16),
                                  _float32_route(path, tiny_cfg, BF16).vectors.view(np.uint16))


def _poison(value, module="k_proj", which="A"):
    def edit(t):
        x = t[_key(1, module, which)].astype(np.float32)
        x.flat[np.random.default_rng().integers(x.size)] = value
        t[_key(1, module, which)] = x.astype(BF16)
    return edit


def _fill(value, module="v_proj", which="B"):
    def edit(t):
        t[_key(1, module, which)] = np.full(t[_key(1, module, which)].shape, value, BF16)
    return edit


@pytest.mark.parametrize("edit, fragment", [
    (_poison(np.nan), "non-finite"),
    (_poison(np.inf), "non-finite"),
    (_poison(-np.inf, "q_proj", "B"), "non-finite"),
    (_poison(-np.nan, "o_proj"), "non-finite"),
    (_fill(1e20), "overflow"),
    (_fill(3e38, "v_proj", "A"), "overflow"),
], ids=["nan", "inf", "neg-inf-in-b", "neg-nan", "1e20-b", "3e38-a"])
def test_bad_bf16_values_are_refused_with_the_float32_routes_reason(tmp_path, tiny_cfg, edit, fragment):
    path = _write(tmp_path / "a", tiny_cfg)
    _edit(path, edit)
    with pytest.raises(AdapterError) as slow:
        _float32_route(path, tiny_cfg, BF16)
    with pytest.raises(AdapterError) as fast:
        PeftDirSource(path).load_rows("a", tiny_cfg, 16, BF16)
    module = next(m for m in MODULES if m in fast.value.reason)  # the reason names the module, as the slow one
    assert fragment in fast.value.reason and fragment in slow.value.reason and module in slow.value.reason


@pytest.mark.parametrize("spread", [False, True], ids=["one-entry-loads", "whole-column-refused"])
def test_a_gain_the_peaks_cannot_settle_is_summed_exactly(tmp_path, tiny_cfg, spread):
    """The peaks bound the gain by ``|s| * d_in * peak_a * r * peak_b``; where that bound is above the limit
    (sqrt of bf16's largest, ~1.8e19) the exact column sums decide. One large entry in A keeps the exact gain at
    1e18 (loads; the bound alone would refuse it); the same entry over A's whole row gives d_in times that
    (refused)."""
    path = _write(tmp_path / "a", tiny_cfg)
    a_key, b_key = _key(1, "v_proj", "A"), _key(1, "v_proj", "B")
    scale = load_peft_adapter(path, tiny_cfg).modules[(1, "v_proj")].scale
    found = load_file(str(path / WEIGHTS))
    a = np.full(found[a_key].shape, 1e-3, np.float32)  # lora_A [r, d_in]: a = A^T, column sums run over d_in
    b = np.full(found[b_key].shape, 1e-3, np.float32)  # lora_B [d_out, r]
    x = 1e9
    if spread:
        a[0, :] = x
    else:
        a[0, 0] = x
    b[0, 0] = 1e18 / (abs(scale) * x)
    found[a_key], found[b_key] = a.astype(BF16), b.astype(BF16)
    save_file(found, str(path / WEIGHTS))
    d_in, r = a.shape[1], a.shape[0]
    assert abs(scale) * d_in * x * r * float(b.max()) > 1.9e19  # the bound alone cannot settle it
    if spread:
        with pytest.raises(AdapterError) as slow:
            _float32_route(path, tiny_cfg, BF16)
        with pytest.raises(AdapterError) as fast:
            PeftDirSource(path).load_rows("a", tiny_cfg, 16, BF16)
        assert "overflow" in fast.value.reason and fast.value.reason == slow.value.reason
    else:
        fast = PeftDirSource(path).load_rows("a", tiny_cfg, 16, BF16)
        np.testing.assert_array_equal(fast.vectors.view(np.uint16),
                                      _float32_route(path, tiny_cfg, BF16).vectors.view(np.uint16))
