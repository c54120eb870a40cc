"""The serving forward (unified pool: paged KV + adapters in pages) equals HF + PEFT, for both backends.

The Pallas backend runs in interpret mode here; each row of one batch names its own adapter, stored in the pool on
pages scattered by earlier loads and unloads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_logits, rel_err

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.pool import PagedPool
from slora_jax.engine.step_runner import StepItem, StepRunner, device_batch
from slora_jax.lora.peft import load_peft_adapter
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.model.loader import load_params
from slora_jax.model.paged import paged_forward

# On a GPU float32 dots run as TF32 (XLA's default, and Triton's for tl.dot): about 1e-3 relative.
TOL = 2e-3 if jax.default_backend() == "gpu" else 1e-4


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_paged_prefill_and_decode_logits_match_peft(tiny_dir, adapter_dirs, backend):
    cfg, params = load_params(tiny_dir, dtype=jnp.float32, progress=False)
    ecfg = EngineConfig(max_batch_size=8, max_prefill_tokens=128, max_prefill_seqs=8, max_model_len=64, page_size=4,
                        max_lora_rank=32, max_loras=6, num_pages=512, dtype="float32", backend=backend)
    pool = PagedPool(cfg, page_size=4, max_slots=12, max_rank=32, num_pages=1024, dtype=jnp.float32)
    rng = np.random.default_rng()
    names = list(adapter_dirs)
    # churn: load and unload so that the adapters we keep sit on scattered pages
    for name in rng.permutation(names):
        pool.load_adapter("tmp-" + name, to_pool_rows(load_peft_adapter(adapter_dirs[name], cfg), cfg))
        pool.alloc_kv_pages(int(rng.integers(1, 5)))
    for name in rng.permutation(names)[:3]:
        pool.unload_adapter("tmp-" + name)
    for name in names:
        pool.load_adapter(name, to_pool_rows(load_peft_adapter(adapter_dirs[name], cfg), cfg))
    rows = [names[0], None, names[1], names[2], names[3], names[4], names[5], None]
    order = sorted(range(len(rows)), key=lambda i: -1 if rows[i] is None else pool.slot_of(rows[i]))
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, size=int(rng.integers(2, 12)))] for _ in rows]
    items = []
    for i in order:
        n = len(prompts[i]) + 1  # room for one decode token
        pages = pool.alloc_kv_pages(-(-n // 4))
        rng.shuffle(pages)
        slot = -1 if rows[i] is None else pool.slot_of(rows[i])
        items.append(StepItem(prompts[i], 0, pages, slot, None, 0, 0))
    runner = StepRunner(cfg, ecfg)
    batch, _ = runner.build_prefill(items)
    logits, arr = paged_forward(cfg, runner.prefill_spec, params, pool.array, pool.table, device_batch(batch))
    pool.array = arr
    nxt = np.asarray(jnp.argmax(logits, axis=-1))
    for j, i in enumerate(order):
        adapter = adapter_dirs[rows[i]] if rows[i] else None
        ref = hf_logits(tiny_dir, prompts[i] + [int(nxt[j])], adapter)
        assert rel_err(np.asarray(logits[j]), ref[-2]) <= TOL, rows[i]
        items[j] = StepItem([int(nxt[j])], len(prompts[i]), items[j].pages, items[j].adapter_slot, None, 0, 0)
        items[j].ref_next = ref[-1]
    batch, _, _ = runner.build_decode(items)
    logits, _ = paged_forward(cfg, runner.decode_spec, params, pool.array, pool.table, device_batch(batch))
    for j, i in enumerate(order):
        assert rel_err(np.asarray(logits[j]), items[j].ref_next) <= TOL, rows[i]
