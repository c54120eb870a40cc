"""The kernel backend table: complete entries, one signature per role, clear errors, and a forward that really calls
through it (a counting backend wrapping the references must see every role and give the reference's logits)."""

from __future__ import annotations

import collections
import dataclasses
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backends
from pallas_kernels.backends import KernelBackend, default_tiles, get_backend
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.pool import PagedPool
from slora_jax.engine.step_runner import StepItem, StepRunner, device_batch
from slora_jax.lora.peft import load_peft_adapter
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.model.loader import load_params
from slora_jax.model.paged import paged_forward

# How paged.py calls each role: (positional argument count, keyword names). Every entry must accept exactly this.
ROLE_CALLS = {
    "bgmv_shrink": (7, ("interpret",)),
    "bgmv_expand": (8, ("interpret",)),
    "bgmv_lora": (9, ("interpret",)),
    "sgmv_shrink": (8, ("interpret",)),
    "sgmv_expand": (9, ("interpret",)),
    "decode_attention": (5, ("page_size", "num_kv_heads", "sm_scale", "interpret")),
    "decode_attention_rope": (8, ("page_size", "num_heads", "num_kv_heads", "sm_scale", "interpret")),
    "prefill_attention": (6, ("tile_map", "block_q", "page_size", "num_kv_heads", "sm_scale", "interpret")),
    "write_kv": (6, ()),
}


def test_roles_are_the_calls_the_forward_makes():
    assert set(backends.ROLES) == set(ROLE_CALLS)


@pytest.mark.parametrize("name", backends.backend_names())
def test_every_backend_fills_every_role_with_the_role_signature(name):
    backend = get_backend(name)
    for role, (n_args, kwargs) in ROLE_CALLS.items():
        fn = getattr(backend, role)
        assert callable(fn), (name, role)
        inspect.signature(fn).bind(*range(n_args), **dict.fromkeys(kwargs))  # TypeError if the role does not fit


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="no-such-backend") as err:
        get_backend("no-such-backend")
    for known in ("reference", "pallas", "pallas-triton"):
        assert known in str(err.value)
    with pytest.raises(ValueError, match="reference"):
        EngineConfig(num_pages=8, backend="no-such-backend").with_platform_defaults("cpu")


def test_registering_a_taken_name_needs_replace():
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(dataclasses.replace(get_backend("reference")))


def test_default_tiles_per_platform():
    gpu = dict(lora_block_t=64, attn_block_q=128, min_prefill_bucket=128, min_decode_bucket=4,
               decode_rope_in_attention=True, prefill_mid_buckets_from=512, decode_mid_buckets_from=128)
    cpu = dict(lora_block_t=16, attn_block_q=16, min_prefill_bucket=16, min_decode_bucket=1,
               decode_rope_in_attention=False, prefill_mid_buckets_from=0, decode_mid_buckets_from=0)
    for name in ("pallas", "pallas-triton", "reference"):
        assert default_tiles(name, "gpu") == gpu
        assert default_tiles(name, "cpu") == cpu
        assert default_tiles(name, "tpu") == cpu  # no entry: the CPU settings
    for name in backends.backend_names():
        assert set(default_tiles(name, "cpu")) == set(cpu)


def test_decode_buckets_start_at_the_platform_default_unless_set():
    """On a GPU a lone sequence decodes in a 4-row step (XLA's 1-row GEMMs stream o and down at 57-64% of the copy
    bandwidth on the H200, 4-row ones at 87-91%); on the CPU from 1 row; a set value wins on either."""
    ecfg = EngineConfig(max_batch_size=64)
    assert ecfg.with_platform_defaults("gpu").decode_buckets == (4, 8, 16, 32, 64)
    assert ecfg.with_platform_defaults("cpu").decode_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert dataclasses.replace(ecfg, min_decode_bucket=1).with_platform_defaults("gpu").decode_buckets[0] == 1
    assert dataclasses.replace(ecfg, max_batch_size=2).with_platform_defaults("gpu").decode_buckets == (4,)


def test_midpoint_buckets_on_the_gpu_from_where_padding_rows_cost_flops():
    """The GPU's buckets add 3/2 of each power of two from 512 prefill rows and 128 decode rows (S1's ~520-token
    prefills ran in 1024 rows); a midpoint that does not fill whole tiles is left out; 0 turns them off."""
    ecfg = EngineConfig(max_batch_size=512, max_prefill_tokens=4096, max_model_len=4096)
    gpu = ecfg.with_platform_defaults("gpu")
    assert gpu.prefill_buckets == (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert gpu.decode_buckets == (4, 8, 16, 32, 64, 128, 192, 256, 384, 512)
    assert ecfg.with_platform_defaults("cpu").prefill_buckets == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    off = dataclasses.replace(ecfg, prefill_mid_buckets_from=0, decode_mid_buckets_from=0).with_platform_defaults("gpu")
    assert off.prefill_buckets == (128, 256, 512, 1024, 2048, 4096) and off.decode_buckets[-2:] == (256, 512)
    coarse = dataclasses.replace(ecfg, prefill_mid_buckets_from=64, attn_block_q=64).with_platform_defaults("gpu")
    assert coarse.prefill_buckets[:4] == (128, 192, 256, 384)  # 96 (of 64) is not whole 64-row tiles: left out
    with pytest.raises(ValueError, match="decode_mid_buckets_from"):
        dataclasses.replace(ecfg, decode_mid_buckets_from=-1).validate()


@pytest.fixture
def counting_backend():
    """A backend whose roles are the references, counting their calls; registered for this test only."""
    calls = collections.Counter()
    reference = get_backend("reference")

    def counted(role):
        fn = getattr(reference, role)

        def call(*args, **kwargs):
            calls[role] += 1
            return fn(*args, **kwargs)

        return call

    backend = KernelBackend(name="counting-test", tiles=reference.tiles,
                            **{role: counted(role) for role in backends.ROLES})
    backends.register_backend(backend)
    try:
        yield backend.name, calls
    finally:
        backends.unregister_backend(backend.name)


def _prefill_then_decode(cfg, params, pool, items, backend, rope_in_attention=True):
    """Logits of one prefill step and one decode step (one new token per sequence), on a copy of the pool."""
    ecfg = EngineConfig(max_batch_size=4, max_prefill_tokens=32, max_prefill_seqs=4, max_model_len=32, page_size=4,
                        max_lora_rank=32, max_loras=4, num_pages=128, dtype="float32", backend=backend,
                        decode_rope_in_attention=rope_in_attention)
    runner = StepRunner(cfg, ecfg)
    batch, _ = runner.build_prefill(items)
    prefill, arr = paged_forward(cfg, runner.prefill_spec, params, jnp.array(pool.array), pool.table,
                                 device_batch(batch))
    nxt = np.asarray(jnp.argmax(prefill, axis=-1))
    steps = [StepItem([int(nxt[j])], len(it.tokens), it.pages, it.adapter_slot, None, 0, 0)
             for j, it in enumerate(items)]
    batch, _, _ = runner.build_decode(steps)
    decode, _ = paged_forward(cfg, runner.decode_spec, params, arr, pool.table, device_batch(batch))
    return np.asarray(prefill), np.asarray(decode)


def test_forward_calls_every_role_through_the_table(tiny_dir, adapter_dirs, counting_backend):
    name, calls = counting_backend
    cfg, params = load_params(tiny_dir, dtype=jnp.float32, progress=False)
    pool = PagedPool(cfg, page_size=4, max_slots=4, max_rank=32, num_pages=128, dtype=jnp.float32)
    adapter = "r8-all7"
    pool.load_adapter(adapter, to_pool_rows(load_peft_adapter(adapter_dirs[adapter], cfg), cfg))
    items = []
    for slot, prompt in ((-1, [5, 9, 14]), (pool.slot_of(adapter), [7, 3, 11, 20, 4])):
        items.append(StepItem(prompt, 0, pool.alloc_kv_pages(-(-(len(prompt) + 1) // 4)), slot, None, 0, 0))

    got = _prefill_then_decode(cfg, params, pool, items, name)
    # on one device decode runs each group through bgmv_lora and attends with decode_attention_rope; bgmv_shrink,
    # bgmv_expand and decode_attention serve tensor parallelism (and decode_rope_in_attention=False)
    assert set(calls) == set(backends.ROLES) - {"bgmv_shrink", "bgmv_expand", "decode_attention"}, calls
    want = _prefill_then_decode(cfg, params, pool, items, "reference")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    calls.clear()  # the three-step decode (tensor parallelism's, and the interpret-mode default)
    unfused = _prefill_then_decode(cfg, params, pool, items, name, rope_in_attention=False)
    assert calls["decode_attention"] and "decode_attention_rope" not in calls, calls
    np.testing.assert_allclose(unfused[1], want[1], rtol=1e-5, atol=1e-5)
