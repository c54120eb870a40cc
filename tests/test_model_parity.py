"""The functional Llama and the reference batched LoRA forward equal HF transformers + PEFT (float32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_generate, hf_logits, rel_err

from slora_jax.lora.peft import load_peft_adapter
from slora_jax.model.loader import load_params
from slora_jax.model.reference import reference_generate, reference_logits, stack_adapters


def _prompts(rng, lengths, vocab):
    return [[int(t) for t in rng.integers(3, vocab, size=n)] for n in lengths]


@pytest.mark.parametrize("model", ["tiny", "tiny-mha", "tiny-llama3"])
def test_base_logits_match_hf(model_dirs, model):
    cfg, params = load_params(model_dirs[model], dtype=jnp.float32, progress=False)
    rng = np.random.default_rng()
    prompts = _prompts(rng, [1, 7, 13, 70], cfg.vocab_size)  # 70 > 64 exercises llama3's scaled band
    ours = reference_logits(cfg, params, None, prompts, [-1] * len(prompts))
    for prompt, logits in zip(prompts, ours, strict=True):
        assert rel_err(logits, hf_logits(model_dirs[model], prompt)) <= 1e-4


@pytest.fixture(scope="module")
def zoo(tiny_dir, adapter_dirs):
    cfg, params = load_params(tiny_dir, dtype=jnp.float32, progress=False)
    names = list(adapter_dirs)
    adapters = [load_peft_adapter(adapter_dirs[n], cfg) for n in names]
    return cfg, params, names, stack_adapters(cfg, adapters)


def test_mixed_adapter_batch_matches_peft_row_by_row(zoo, tiny_dir, adapter_dirs):
    cfg, params, names, stacked = zoo
    rng = np.random.default_rng()
    rows = [0, 1, -1, 2, 3, 4, 5, -1, 1, 3]  # 10 rows, 6 adapters, 2 base-only rows
    prompts = _prompts(rng, rng.integers(2, 24, size=len(rows)), cfg.vocab_size)
    ours = reference_logits(cfg, params, stacked, prompts, rows)
    for prompt, row, logits in zip(prompts, rows, ours, strict=True):
        adapter_dir = adapter_dirs[names[row]] if row >= 0 else None
        ref = hf_logits(tiny_dir, prompt, adapter_dir)
        assert rel_err(logits, ref) <= 1e-4, names[row] if row >= 0 else "base"
        if row >= 0:  # the adapter must matter, or this comparison proves nothing
            assert rel_err(hf_logits(tiny_dir, prompt), ref) > 1e-3


def test_greedy_generation_matches_peft_generate(zoo, tiny_dir, adapter_dirs):
    cfg, params, names, stacked = zoo
    rng = np.random.default_rng()
    rows = list(range(len(names))) + [-1]
    prompts = _prompts(rng, rng.integers(3, 12, size=len(rows)), cfg.vocab_size)
    ours = reference_generate(cfg, params, stacked, prompts, rows, max_new_tokens=32)
    for prompt, row, tokens in zip(prompts, rows, ours, strict=True):
        adapter_dir = adapter_dirs[names[row]] if row >= 0 else None
        assert tokens == hf_generate(tiny_dir, prompt, 32, adapter_dir), names[row] if row >= 0 else "base"
