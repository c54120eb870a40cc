"""Adapter mixes (issue 16 item 6): several adapters with weights served as one, equal to PEFT's
``add_weighted_adapter(..., combination_type="cat")``; built from host rows, cached, validated, served over HTTP."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import hf_model, rel_err
from peft import PeftModel

from slora_jax.lora.mixes import MixSource, canonical_parts, mix_name
from slora_jax.lora.peft import load_peft_adapter
from slora_jax.lora.pool_rows import adapter_from_rows, to_pool_rows
from slora_jax.model.loader import load_params
from slora_jax.model.reference import reference_logits, stack_adapters

GREEDY = dict(temperature=0.0, ignore_eos=True)

# (PEFT's order, weights). PEFT's mix copies its first part's config (rsLoRA, layers_to_transform), so a plain part
# comes first; ours does not depend on the order. Together they cover: different ranks, a module only some parts
# target (k/o, the MLP), an rsLoRA part, a layers_to_transform part, rank/alpha patterns, negative weights. (PEFT
# refuses a mix where a projection some part targets is adapted by no part in some layer: "No matching LoRAs".)
MIXES = [
    (("r4-qkvo", "r32-qv"), (0.7, 0.3)),
    (("r8-all7", "r16-rslora", "layer1-only"), (1.0, 0.5, -0.4)),
    (("patterns", "r4-qkvo", "r32-qv"), (0.6, 1.3, -0.5)),
]


def _prompts(rng, lengths, vocab):
    return [[int(t) for t in rng.integers(3, vocab, size=n)] for n in lengths]


def peft_cat_logits(model_dir, adapter_dirs, names, weights, prompts) -> list[np.ndarray]:
    """Logits of PEFT's own cat mix of ``names`` (in this order) for each prompt."""
    model = PeftModel.from_pretrained(hf_model(model_dir), str(adapter_dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    model.add_weighted_adapter(list(names), list(weights), "mix", combination_type="cat")
    model.set_adapter("mix")
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in prompts]


def mix_from_host_rows(cfg, adapter_dirs, parts: dict[str, float], max_rank: int = 64):
    """The mix as the engine builds it: MixSource over the parts' fp32 host rows, read back as a LoraAdapter."""
    adapters = {n: load_peft_adapter(adapter_dirs[n], cfg) for n in parts}
    rows = {n: to_pool_rows(a, cfg, np.float32) for n, a in adapters.items()}
    source = MixSource(canonical_parts(parts), lambda n: rows[n].rank, rows.__getitem__)
    name = mix_name(canonical_parts(parts))
    table = source.rank_table(name, cfg, max_rank)
    mixed = source.load_rows(name, cfg, max_rank, np.float32)
    np.testing.assert_array_equal(mixed.rank, table)
    return adapter_from_rows(mixed, cfg)


@pytest.fixture(scope="module")
def fp32_model(tiny_dir):
    return load_params(tiny_dir, dtype=jnp.float32, progress=False)


@pytest.mark.parametrize("names, weights", MIXES)
def test_mix_logits_equal_peft_cat(fp32_model, tiny_dir, adapter_dirs, names, weights):
    cfg, params = fp32_model
    rng = np.random.default_rng()
    prompts = _prompts(rng, [5, 17], cfg.vocab_size)
    mixed = mix_from_host_rows(cfg, adapter_dirs, dict(zip(names, weights, strict=True)))
    ours = reference_logits(cfg, params, stack_adapters(cfg, [mixed]), prompts, [0] * len(prompts))
    refs = peft_cat_logits(tiny_dir, adapter_dirs, names, weights, prompts)
    single = peft_cat_logits(tiny_dir, adapter_dirs, names[:1], weights[:1], prompts)  # the first part alone
    for logits, ref, one in zip(ours, refs, single, strict=True):
        assert rel_err(logits, ref) <= 1e-4
        assert rel_err(one, ref) > 1e-3  # the other parts matter, or this comparison proves nothing


def test_peft_mix_with_an_rslora_first_part_is_scaled_by_sqrt_of_its_rank(fp32_model, tiny_dir, adapter_dirs):
    """PEFT's mix copies its first part's use_rslora, so its own scale is r/sqrt(r) = sqrt(r) for r = the sum of the
    parts' configured ranks instead of 1; ours does not depend on the order (docs/DESIGN.md). Pinned here."""
    cfg, params = fp32_model
    prompts = _prompts(np.random.default_rng(), [9], cfg.vocab_size)
    names, weights = ("r16-rslora", "r4-qkvo"), (0.5, 0.8)
    ref = peft_cat_logits(tiny_dir, adapter_dirs, names, weights, prompts)[0]
    boost = math.sqrt(16 + 4)
    scaled = mix_from_host_rows(cfg, adapter_dirs, {n: w * boost for n, w in zip(names, weights, strict=True)})
    plain = mix_from_host_rows(cfg, adapter_dirs, dict(zip(names, weights, strict=True)))
    ours_scaled, ours_plain = (reference_logits(cfg, params, stack_adapters(cfg, [m]), prompts, [0])[0]
                               for m in (scaled, plain))
    assert rel_err(ours_scaled, ref) <= 1e-4
    assert rel_err(ours_plain, ref) > 1e-3
