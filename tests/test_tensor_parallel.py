"""Tensor parallelism on forced host devices (conftest asks XLA for 4 CPU devices before jax is imported).

The serving forward at TP2 (GQA) and TP4 (MHA) equals TP1 in float32 in both LoRA modes; the engine at TP2 is
token-identical to TP1 and to HF PEFT, agrees across devices and compiles nothing after warm-up; the compiled step
holds exactly the collectives of the design; the step lowers for a 2-GPU CUDA target; adapter shards hold each
device's slices. The jnp reference kernels run most checks; one runs the Pallas kernels (interpret mode) inside the
shard_map. TP1 results are themselves checked against HF PEFT by test_paged_parity.py and test_engine.py.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import hf_generate, rel_err
from random_lora import random_adapter
from store_helpers import logged_rng

from slora_jax.engine.adapter_shards import AdapterShards
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.pool import PagedPool
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.step_runner import StepItem, StepRunner, device_batch
from slora_jax.lora.peft import load_peft_adapter
from slora_jax.lora.pool_rows import to_pool_rows
from slora_jax.model.config import MODULES, ModelConfig
from slora_jax.model.loader import load_params
from slora_jax.model.paged import paged_forward
from slora_jax.model.sharding import TensorParallel, lora_dims
from slora_jax.tools import synth


def needs(n: int):
    return pytest.mark.skipif(len(jax.devices()) < n, reason=f"needs {n} devices (conftest forces 4 on CPU)")



TOL = 1e-5
# max_rank 16: the zoo without its rank-32 adapter (mixed ranks, rsLoRA, patterns, layer subset, partial targets)
ZOO = ("r4-qkvo", "r8-all7", "r16-rslora", "patterns", "layer1-only")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(model_dirs, adapter_dirs, tmp_path_factory):
    """{name: (dir, adapters {name: dir})}: tiny (GQA, runs at TP2) and tiny-mha (runs at TP4)."""
    from conftest import ADAPTER_SPECS

    mha_dir = model_dirs["tiny-mha"]
    mha_cfg = ModelConfig.from_model_dir(mha_dir)
    root = tmp_path_factory.mktemp("mha-adapters")
    mha = {name: synth.write_adapter(root / name, mha_cfg, seed=40 + i, **ADAPTER_SPECS[name])
           for i, name in enumerate(ZOO)}
    return {"tiny": (model_dirs["tiny"], {n: adapter_dirs[n] for n in ZOO}), "tiny-mha": (mha_dir, mha)}


def _forward(model_dir, adapters, prompts, rows, next_tokens, tp=None, backend="reference"):
    """(prefill logits, decode logits) of one mixed batch: row i runs adapter ``rows[i]`` (None: base) on
    ``prompts[i]``, then decodes ``next_tokens[i]`` (None: the prefill's argmax). Pages are scattered by churn."""
    cfg, params = load_params(model_dir, dtype=jnp.float32, progress=False)
    pool = PagedPool(cfg, page_size=4, max_slots=8, max_rank=16, num_pages=512, dtype=jnp.float32, tp=tp)
    rng = np.random.default_rng(0)  # page churn only; inputs come from the caller
    for name in adapters:
        pool.load_adapter(name, pool.shard_rows(to_pool_rows(load_peft_adapter(adapters[name], cfg), cfg)))
        pool.alloc_kv_pages(int(rng.integers(1, 4)))
    pool.unload_adapter(next(iter(adapters)))
    first = next(iter(adapters))
    pool.load_adapter(first, pool.shard_rows(to_pool_rows(load_peft_adapter(adapters[first], cfg), cfg)))
    ecfg = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=8, max_model_len=32, page_size=4,
                        max_lora_rank=16, max_loras=8, num_pages=512, dtype="float32", backend=backend)
    runner = StepRunner(cfg, ecfg, tp=tp)
    order = sorted(range(len(rows)), key=lambda i: -1 if rows[i] is None else pool.slot_of(rows[i]))
    items = [StepItem(prompts[i], 0, pool.alloc_kv_pages(-(-(len(prompts[i]) + 1) // 4)),
                      -1 if rows[i] is None else pool.slot_of(rows[i]), None, 0, 0) for i in order]
    if tp is None:
        fwd = jax.jit(functools.partial(paged_forward, cfg), static_argnums=0)
    else:
        params = tp.place_params(params)
        fwd = jax.jit(tp.wrap_step(lambda spec, p, arr, table, batch: paged_forward(tp.local_cfg, spec, p, arr, table,
                                                                                    batch)), static_argnums=0)
    batch, _ = runner.build_prefill(items)
    prefill, pool.array = fwd(runner.prefill_spec, params, pool.array, pool.table, device_batch(batch))
    prefill = np.asarray(prefill)[: len(items)]
    for j, i in enumerate(order):
        token = int(np.argmax(prefill[j])) if next_tokens[i] is None else next_tokens[i]
        items[j] = StepItem([token], len(prompts[i]), items[j].pages, items[j].adapter_slot, None, 0, 0)
    batch, _, _ = runner.build_decode(items)
    decode, _ = fwd(runner.decode_spec, params, pool.array, pool.table, device_batch(batch))
    back = np.argsort(order)  # rows back in the caller's order
    return prefill[back], np.asarray(decode)[: len(items)][back]


@pytest.fixture(scope="module")
def batches(models):
    """Per model: a mixed batch (every adapter, two base-only rows), fresh random prompts, and its TP1 logits."""
    rng = logged_rng("tensor-parallel batches")
    out = {}
    for name, (model_dir, adapters) in models.items():
        rows = [*adapters, None, None]
        prompts = [[int(t) for t in rng.integers(3, 512, size=int(rng.integers(2, 7)))] for _ in rows]
        prefill, decode = _forward(model_dir, adapters, prompts, rows, [None] * len(rows))
        next_tokens = [int(t) for t in np.argmax(prefill, axis=-1)]
        out[name] = (rows, prompts, next_tokens, prefill, decode)
    return out


@pytest.mark.parametrize("model, size, fully", [
    pytest.param("tiny", 2, False, marks=needs(2)), pytest.param("tiny", 2, True, marks=needs(2)),
    pytest.param("tiny-mha", 4, False, marks=needs(4)), pytest.param("tiny-mha", 4, True, marks=needs(4))])
def test_paged_forward_equals_tp1(models, batches, model, size, fully):
    model_dir, adapters = models[model]
    rows, prompts, next_tokens, prefill1, decode1 = batches[model]
    tp = TensorParallel.create(ModelConfig.from_model_dir(model_dir), size, fully)
    prefill, decode = _forward(model_dir, adapters, prompts, rows, next_tokens, tp=tp)
    for i, row in enumerate(rows):
        assert rel_err(prefill[i], prefill1[i]) <= TOL, ("prefill", row)
        assert rel_err(decode[i], decode1[i]) <= TOL, ("decode", row)


@needs(2)
def test_pallas_kernels_inside_the_shard_map(models, batches):
    """Interpret-mode Pallas under shard_map (check_vma=False), default mode: the fused decode LoRA kernel and the
    prefill shrink / expand on each device's local shapes (the fully sharded mode calls the same shrink / expand)."""
    model_dir, adapters = models["tiny"]
    rows, prompts, next_tokens, prefill1, decode1 = batches["tiny"]
    tp = TensorParallel.create(ModelConfig.from_model_dir(model_dir), 2)
    prefill, decode = _forward(model_dir, adapters, prompts, rows, next_tokens, tp=tp, backend="pallas")
    for i, row in enumerate(rows):
        assert rel_err(prefill[i], prefill1[i]) <= TOL, ("prefill", row)
        assert rel_err(decode[i], decode1[i]) <= TOL, ("decode", row)


def test_split_checks_say_what_cannot_split(tiny_cfg):
    with pytest.raises(ValueError, match="2 KV heads do not split into 4"):
        TensorParallel.create(tiny_cfg, 4)
    odd = dataclasses.replace(tiny_cfg, intermediate_size=80)  # 80 / 2 = 40: not a multiple of head_dim 16
    with pytest.raises(ValueError, match="intermediate size 80 / 2 is not a multiple of head_dim 16"):
        TensorParallel.create(odd, 2)
    with pytest.raises(ValueError, match="4 attention heads do not split into 8"):
        TensorParallel.create(tiny_cfg, 8)
    wide = dataclasses.replace(tiny_cfg, num_attention_heads=16, num_key_value_heads=16, intermediate_size=512)
    too_many = 2 * len(jax.devices())  # splits, but there are not that many devices
    with pytest.raises(ValueError, match=f"needs {too_many} devices; jax sees {len(jax.devices())}"):
        TensorParallel.create(wide, too_many)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0).validate()
    assert TensorParallel.maybe(tiny_cfg, 1) is None


@pytest.mark.parametrize("size, fully", [pytest.param(2, False, marks=needs(2)), pytest.param(2, True, marks=needs(2)),
                                         pytest.param(4, False, marks=needs(4)), pytest.param(4, True, marks=needs(4))])
def test_adapter_shards_hold_each_devices_slices(rng, size, fully):
    cfg = ModelConfig.from_dict(synth.preset_config("tiny-mha"))
    tp = TensorParallel.create(cfg, size, fully)
    adapter = random_adapter(cfg, rng, "a", ranks=(1, 3, 8), p_absent=0.3)
    rows = AdapterShards(cfg, tp).shard_rows(to_pool_rows(adapter, cfg))
    vec = cfg.head_dim
    assert rows.vectors.shape[2] == size * vec
    for (layer, module), mod in adapter.modules.items():
        m, r = MODULES.index(module), mod.a.shape[1]
        d_in, d_out = lora_dims(cfg, size, fully, module)
        assert rows.rank[layer, m] == r
        for d in range(size):
            lanes = rows.vectors[layer, :, d * vec:(d + 1) * vec]
            a_t = lanes[rows.a_off[layer, m]: rows.a_off[layer, m] + r * d_in // vec].reshape(r, d_in)
            b = lanes[rows.b_off[layer, m]: rows.b_off[layer, m] + r * d_out // vec].reshape(r, d_out)
            full_in, full_out = cfg.module_dims(module)
            a_rows = slice(None) if d_in == full_in else slice(d * d_in, (d + 1) * d_in)
            b_cols = slice(None) if d_out == full_out else slice(d * d_out, (d + 1) * d_out)
            np.testing.assert_array_equal(a_t, mod.a[a_rows].T)
            np.testing.assert_array_equal(b, mod.b[:, b_cols])
    if fully:  # every matrix split N ways: each device holds 1/N of the adapter, in as many pages as at TP1
        assert rows.total_vectors * size == to_pool_rows(adapter, cfg).total_vectors


def _tiny_engine(model_dir, adapters, size, fully=False, warm=True, **kw):
    ecfg = EngineConfig(max_batch_size=4, max_prefill_tokens=32, max_prefill_seqs=4, max_model_len=32, page_size=4,
                        max_lora_rank=16, max_loras=3, num_pages=160, dtype="float32", backend="reference",
                        min_prefill_bucket=32, min_decode_bucket=4, decode_lora_variants=False,
                        max_staged_adapters=4, tensor_parallel_size=size, fully_sharded_loras=fully, **kw)
    engine = Engine.from_model_dir(model_dir, ecfg, adapters=adapters, progress=False)
    if warm:
        engine.warmup(progress=False)
    return engine


def _watch_device_agreement(engine) -> list[int]:
    """Checks, as each step returns, that every device produced the same outputs (tokens, logprobs, sampler state);
    returns a list that counts the checked steps."""
    checked, step_fn = [], engine.runner.step_fn

    def spy_step_fn(*a, **kw):
        fn = step_fn(*a, **kw)

        def run(*args):
            out = fn(*args)
            for leaf in jax.tree.leaves(out[:-1]):  # all but the pool, whose shards differ by design
                shards = [np.asarray(s.data) for s in leaf.addressable_shards]
                assert len(shards) == 2 and all(np.array_equal(shards[0], s) for s in shards[1:])
            checked.append(1)
            return out

        return run

    engine.runner.step_fn = spy_step_fn
    return checked


@needs(2)
def test_engine_tp2_matches_tp1_and_peft_without_compiles(models):
    """Mixed adapters with evictions: greedy tokens equal PEFT's and a one-device engine's; sampled rows too run the
    same on both devices; nothing compiles after warm-up. (The LoRA mode changes only the forward, checked above in
    both modes.)"""
    model_dir, adapters = models["tiny"]
    rng = logged_rng("engine tp2")
    tp2 = _tiny_engine(model_dir, adapters, 2)
    checked = _watch_device_agreement(tp2)
    names = [*adapters, None, "r8-all7", None]
    prompts = [[int(t) for t in rng.integers(3, 512, size=int(rng.integers(3, 12)))] for _ in names]
    n = 6
    sampled = [SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=int(rng.integers(1 << 30)))] * 2
    greedy = tp2.generate(prompts, names, SamplingParams(max_tokens=n, **GREEDY))
    tp2.generate(prompts[:2], names[:2], sampled)  # sampled rows: devices must still agree
    assert tp2.store.stats()["evictions"] > 0, "3 slots for 5 adapters should force evictions"
    assert tp2.compiles_since_warmup() == 0
    assert len(checked) > 2 * n
    for ours, prompt, adapter in zip(greedy, prompts, names, strict=True):
        assert ours == hf_generate(model_dir, prompt, n, adapters[adapter] if adapter else None), adapter
    tp1 = _tiny_engine(model_dir, adapters, 1, warm=False)  # compiles only the buckets it runs
    assert tp1.generate(prompts, names, SamplingParams(max_tokens=n, **GREEDY)) == greedy


def _lowerable_step(engine, kind: str, lora: str = "all"):
    """(the jitted step ``kind`` would run, abstract copies of its arguments), captured without running it."""
    captured = {}

    def capture(kind_, lora_="all"):
        fn = StepRunner.step_fn(engine.runner, kind_, lora_)

        def run(*args):
            captured["step"] = (fn, [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                                     if isinstance(a, jax.Array) else a for a in args])
            raise _Captured

        return run

    engine.runner.step_fn = capture
    try:
        with pytest.raises(_Captured):
            if kind == "decode":
                engine.runner.decode(engine.params, engine.pool.array, engine.pool.table, [], lora=lora)
            else:
                engine.runner.prefill(engine.params, engine.pool.array, engine.pool.table, [])
    finally:
        del engine.runner.step_fn
    return captured["step"]


class _Captured(Exception):
    pass


def _tp2_engine(model_dir, fully: bool, **kw) -> Engine:
    """The tiny model at TP2 with its layers unrolled (every layer's collectives appear in the HLO)."""
    dtype = kw.pop("dtype", "float32")
    cfg, params = load_params(model_dir, dtype=jnp.dtype(dtype), progress=False, stacked=False)
    ecfg = EngineConfig(max_batch_size=4, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=64, page_size=4,
                        max_lora_rank=16, max_loras=3, num_pages=64, dtype=dtype, min_decode_bucket=4,
                        layer_loop="unroll", tensor_parallel_size=2, fully_sharded_loras=fully, **kw)
    return Engine(cfg, params, ecfg, interpret=None if ecfg.backend == "reference" else False)


@needs(2)
@pytest.mark.parametrize("fully, per_layer", [(False, {"all": 2}), (True, {"none": 2, "attn": 4, "all": 6})])
def test_compiled_step_has_exactly_the_designed_collectives(tiny_dir, fully, per_layer):
    """Default mode: 2 all-reduces per layer (after o, after down) whatever the adapters (shown for the variant with
    every projection's LoRA). Fully sharded: those 2 plus one all-reduce of the rank-r shrink per projection group
    whose LoRA runs (q,k,v; o; gate,up; down). Nothing else: no all-gather, reduce-scatter or permute."""
    engine = _tp2_engine(tiny_dir, fully, backend="reference", min_prefill_bucket=64)
    for variant, count in per_layer.items():
        fn, args = _lowerable_step(engine, "decode", variant)
        text = fn.lower(*args).compile().as_text()
        ops = re.findall(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\(",
                         text)
        assert Counter(ops) == Counter({"all-reduce": count * engine.cfg.num_hidden_layers}), variant


@needs(2)
@pytest.mark.parametrize("kind, fully", [("decode", False), ("prefill", True)])
def test_step_lowers_for_two_gpus(tiny_dir, kind, fully):
    """The TP2 step with the compiled Triton kernels (interpret=False) exports for CUDA on this CPU-only machine:
    the Pallas calls lower to Triton inside the shard_map, with the designed all-reduces."""
    from jax import export

    engine = _tp2_engine(tiny_dir, fully, dtype="bfloat16", backend="pallas", min_prefill_bucket=64, lora_block_t=64,
                         attn_block_q=64)
    fn, args = _lowerable_step(engine, kind)
    exported = export.export(fn, platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    assert exported.platforms == ("cuda",) and exported.nr_devices == 2
    assert "__gpu$xla.gpu.triton" in text
    per_layer = 6 if fully else 2  # every projection's LoRA runs (decode: the "all" variant)
    assert text.count("stablehlo.all_reduce") == per_layer * engine.cfg.num_hidden_layers
