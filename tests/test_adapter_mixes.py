"""Adapter mixes (issue 16 item 6): several adapters with weights served as one, equal to PEFT's
``add_weighted_adapter(..., combination_type="cat")``; built from host rows, cached, validated, served over HTTP."""

from __future__ import annotations

import dataclasses
import math
import re

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
import torch
from hf_reference import hf_model, rel_err
from peft import PeftModel
from random_lora import random_adapter
from server_fixtures import BASE_NAME, start_server

from slora_jax.engine.adapter_store import AdapterInUse
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.lora.errors import AdapterError
from slora_jax.lora.mixes import MAX_MIX_PARTS, MAX_MIX_WEIGHT, MixSource, canonical_parts, mix_adapter, mix_name
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


def peft_cat_model(model_dir, adapter_dirs, names, weights) -> PeftModel:
    """HF Llama + PEFT with its own cat mix of ``names`` (in this order) active."""
    model = PeftModel.from_pretrained(hf_model(model_dir), str(adapter_dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    model.add_weighted_adapter(list(names), list(weights), "mix", combination_type="cat")
    model.set_adapter("mix")
    return model.eval()


def peft_cat_logits(model_dir, adapter_dirs, names, weights, prompts) -> list[np.ndarray]:
    model = peft_cat_model(model_dir, adapter_dirs, names, weights)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].numpy() for p in prompts]


def peft_cat_generate(model_dir, adapter_dirs, names, weights, prompt, n) -> list[int]:
    """Greedy continuation (exactly ``n`` tokens, EOS ignored) under PEFT's cat mix."""
    model = peft_cat_model(model_dir, adapter_dirs, names, weights)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


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


# ---------------------------------------------------------------- the mix itself (plain numpy reference)

@pytest.mark.parametrize("parts, match", [
    ({}, "at least one"),
    ({f"a{i}": 1.0 for i in range(MAX_MIX_PARTS + 1)}, f"at most {MAX_MIX_PARTS}"),
    ({"a": 0.0}, "non-zero"),
    ({"a": float("nan")}, "finite"),
    ({"a": float("inf")}, "finite"),
    ({"a": 0.5, "b": -MAX_MIX_WEIGHT * 1.01}, "magnitude"),
    ({"a": True}, "number"),
    ({"a": "0.5"}, "number"),
    ({"": 1.0}, "non-empty"),
])
def test_bad_parts_are_refused_with_the_reason(parts, match):
    with pytest.raises(ValueError, match=match):
        canonical_parts(parts)


def test_mix_name_depends_on_the_parts_and_weights_not_their_order():
    rng = np.random.default_rng()
    w = rng.uniform(0.1, 2.0, size=3)
    a = canonical_parts({"x": w[0], "y": w[1], "z": -w[2]})
    b = canonical_parts({"z": -w[2], "x": w[0], "y": w[1]})
    assert a == b and mix_name(a) == mix_name(b) and mix_name(a).startswith("mix:")
    assert [n for n, _ in a] == ["x", "y", "z"]
    nudged = canonical_parts({"x": np.nextafter(w[0], 3.0), "y": w[1], "z": -w[2]})
    others = {mix_name(nudged), mix_name(canonical_parts({"x": w[0], "y": w[1]})),
              mix_name(canonical_parts({"x": w[0], "y": w[1], "w": -w[2]}))}
    assert mix_name(a) not in others and len(others) == 3


def test_mix_adapter_is_the_weighted_sum_of_its_parts(tiny_cfg):
    """Per (layer, projection): the mix's update equals sum_i w_i * scale_i * A_i @ B_i over the parts adapting it
    (a plain float64 reference), at rank = the sum of those parts' ranks, with scale 1."""
    rng = np.random.default_rng()
    parts = [(random_adapter(tiny_cfg, rng, f"p{i}", ranks=(1, 3, 8), p_absent=0.4), float(w))
             for i, w in enumerate(rng.uniform(-2, 2, size=3))]
    mixed = mix_adapter(parts, "m")
    keys = set().union(*(a.modules for a, _ in parts))
    assert set(mixed.modules) == keys
    for key in keys:
        present = [(a.modules[key], w) for a, w in parts if key in a.modules]
        ref = sum(w * m.scale * (m.a.astype(np.float64) @ m.b.astype(np.float64)) for m, w in present)
        got = mixed.modules[key]
        assert got.rank == sum(m.rank for m, _ in present) and got.scale == 1.0
        np.testing.assert_allclose(got.scale * (got.a.astype(np.float64) @ got.b), ref, rtol=1e-5,
                                   atol=1e-5 * np.abs(ref).max())


def test_mix_rank_is_the_sum_and_is_refused_above_the_maximum(tiny_cfg):
    rng = np.random.default_rng()
    a, b = (random_adapter(tiny_cfg, rng, n, ranks=(4, 12)) for n in "ab")
    rows = {n: to_pool_rows(ad, tiny_cfg, np.float32) for n, ad in (("a", a), ("b", b))}
    source = MixSource(canonical_parts({"a": 1.0, "b": 0.5}), lambda n: rows[n].rank, rows.__getitem__)
    total = rows["a"].rank + rows["b"].rank
    np.testing.assert_array_equal(source.rank_table("m", tiny_cfg, int(total.max())), total)
    with pytest.raises(AdapterError, match=f"rank {int(total.max())} at layer .* above this server's maximum LoRA "
                                           f"rank {int(total.max()) - 1}"):
        source.rank_table("m", tiny_cfg, int(total.max()) - 1)

    def rows_of(name):
        if name not in rows:
            raise AdapterError(name, "is not registered")
        return rows[name]

    missing = MixSource(canonical_parts({"a": 1.0, "gone": 0.5}), lambda n: rows[n].rank, rows_of)
    with pytest.raises(AdapterError, match="its part 'gone': is not registered"):
        missing.load_rows("m", tiny_cfg, 64, np.float32)


# ---------------------------------------------------------------- the engine: same kernels, cached, dropped with parts

# One bucket each and the reference backend keep warm-up short on CPU; test_mixes_run_on_the_pallas_kernels runs
# the kernels.
ENGINE = EngineConfig(max_batch_size=4, min_decode_bucket=4, max_prefill_tokens=64, min_prefill_bucket=64,
                      max_prefill_seqs=4, max_model_len=64, page_size=4, max_lora_rank=32, max_loras=3, num_pages=160,
                      dtype="float32", backend="reference")
ENGINE_MIXES = [  # PEFT's order (a plain part first); every rank sum within max_lora_rank 32
    (("r8-all7", "layer1-only", "r4-qkvo"), (0.8, -0.6, 1.1)),
    (("r4-qkvo", "r16-rslora"), (0.7, 0.3)),
]


@pytest.fixture(scope="module")
def engine(tiny_dir, adapter_dirs):
    eng = Engine.from_model_dir(tiny_dir, ENGINE, adapters=adapter_dirs, progress=False)
    eng.warmup(progress=False)
    return eng


def _prompt(rng, vocab, lo=3, hi=20):
    return [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(lo, hi)))]


def test_engine_serves_mixes_equal_to_peft_with_no_compile(engine, tiny_dir, adapter_dirs):
    """Mixes batched with plain adapters and the base model through the pool (3 slots for 4 adapters: evictions and
    reloads) equal PEFT's cat mixes token for token; nothing compiles after warm-up."""
    rng = np.random.default_rng()
    compiles = engine.compiles_since_warmup()
    mixes = [engine.register_mix(dict(zip(n, w, strict=True))) for n, w in ENGINE_MIXES]
    adapters = [mixes[0], "r32-qv", mixes[1], None, mixes[0], "r8-all7", mixes[1]]
    prompts = [_prompt(rng, engine.cfg.vocab_size) for _ in adapters]
    outs = engine.generate(prompts, adapters, SamplingParams(max_tokens=10, **GREEDY))
    assert engine.compiles_since_warmup() == compiles
    for adapter, prompt, tokens in zip(adapters, prompts, outs, strict=True):
        if adapter in mixes:
            names, weights = ENGINE_MIXES[mixes.index(adapter)]
            assert tokens == peft_cat_generate(tiny_dir, adapter_dirs, names, weights, prompt, 10), adapter
    assert engine.pool.stats()["pages_kv"] == 0


def test_mixes_run_on_the_pallas_kernels(tiny_dir, adapter_dirs):
    """The same kernels serve a mix (rank = the sum of its parts' ranks) as any adapter: PEFT's tokens."""
    ecfg = dataclasses.replace(ENGINE, backend="pallas", max_batch_size=2, min_decode_bucket=2, max_prefill_seqs=2)
    eng = Engine.from_model_dir(tiny_dir, ecfg, adapters=adapter_dirs, progress=False)
    rng = np.random.default_rng()
    mixes = [eng.register_mix(dict(zip(n, w, strict=True))) for n, w in ENGINE_MIXES]
    prompts = [_prompt(rng, eng.cfg.vocab_size, 5, 12) for _ in mixes]
    outs = eng.generate(prompts, mixes, SamplingParams(max_tokens=6, **GREEDY))
    for (names, weights), prompt, tokens in zip(ENGINE_MIXES, prompts, outs, strict=True):
        assert tokens == peft_cat_generate(tiny_dir, adapter_dirs, names, weights, prompt, 6), names


def test_a_repeated_mix_reuses_its_adapter(engine):
    rng = np.random.default_rng()
    w = float(rng.uniform(0.2, 1.5))
    name = engine.register_mix({"r4-qkvo": w, "r8-all7": 0.25})
    built = engine.mixes.registered
    assert engine.register_mix({"r8-all7": 0.25, "r4-qkvo": w}) == name  # any order: the same mix
    assert engine.mixes.registered == built
    for _ in range(2):
        engine.generate([_prompt(rng, engine.cfg.vocab_size)], [name], SamplingParams(max_tokens=3, **GREEDY))
        assert engine.register_mix({"r4-qkvo": w, "r8-all7": 0.25}) == name
    assert engine.mixes.registered == built
    assert engine.store.host.describe([name])[name]["reads"][0] == 1  # built from its parts once, then cached
    assert name in engine.store and name not in engine.adapter_names()  # served, but not listed as a model
    (state,) = [s for s in engine.adapter_states() if s["name"] == name]
    assert state["rank"] == 4 + 8 and len(state["targets"]) == 7


def test_mix_requests_are_refused_with_the_reason(engine):
    with pytest.raises(KeyError, match="'no-such' does not exist"):
        engine.register_mix({"r4-qkvo": 1.0, "no-such": 0.5})
    with pytest.raises(AdapterError, match="rank 36 at layer 0 q_proj .* above this server's maximum LoRA rank 32"):
        engine.register_mix({"r4-qkvo": 1.0, "r32-qv": 0.5})
    name = engine.register_mix({"r4-qkvo": 0.5})
    with pytest.raises(ValueError, match="is itself a mix"):
        engine.register_mix({name: 1.0, "r4-qkvo": 0.5})
    with pytest.raises(ValueError, match="finite"):
        engine.register_mix({"r4-qkvo": float("nan")})


def test_unregistering_a_part_drops_its_mixes(engine, adapter_dirs):
    rng = np.random.default_rng()
    engine.register_adapter("part-x", adapter_dirs["r4-qkvo"])
    name = engine.register_mix({"part-x": 0.9, "r8-all7": 0.4})
    other = engine.register_mix({"r8-all7": 0.4, "r16-rslora": 0.2})  # not built from part-x: stays
    rid = engine.add_request(_prompt(rng, engine.cfg.vocab_size), name, SamplingParams(max_tokens=30, **GREEDY))
    while engine.requests[rid].status.name != "RUNNING":
        engine.step()
    with pytest.raises(AdapterInUse):  # a running request uses the part, through its mix
        engine.unregister_adapter("part-x")
    assert "part-x" in engine.store and name in engine.store
    engine.abort(rid)
    engine.unregister_adapter("part-x")
    assert "part-x" not in engine.store and name not in engine.store and name not in engine.mixes
    assert other in engine.store
    engine.register_adapter("part-x", adapter_dirs["r16-rslora"])  # another adapter under the old name
    built = engine.mixes.registered
    assert engine.register_mix({"part-x": 0.9, "r8-all7": 0.4}) == name
    assert engine.mixes.registered == built + 1  # rebuilt from the new part, not the old mix's rows
    assert engine.store.host.describe([name])[name]["rank"] == 16 + 8
    engine.unregister_adapter("part-x")


def test_an_adapter_is_not_unregistered_while_a_request_waits_for_it(engine, adapter_dirs):
    """A waiting (or preempted) request holds no pin, yet it must finish on the adapter it asked for (as vLLM's queued
    requests keep theirs): the unload is refused, whether the request names the adapter or a mix of it, and a
    refused unload drops none of the part's mixes (they once went before the refusal). Names in the mixes' namespace
    cannot be taken by an adapter."""
    rng = np.random.default_rng()
    engine.register_adapter("part-w", adapter_dirs["r4-qkvo"])
    mix = engine.register_mix({"part-w": 0.7, "r8-all7": 0.3})
    for adapter in ("part-w", mix):
        rid = engine.add_request(_prompt(rng, engine.cfg.vocab_size), adapter, SamplingParams(max_tokens=4, **GREEDY))
        assert engine.requests[rid].status.name == "WAITING"
        via = "" if adapter == "part-w" else f" through its mix {mix!r}"
        with pytest.raises(AdapterInUse, match=f"'part-w' is in use{via}: 1 request.* not finished"):
            engine.unregister_adapter("part-w")
        assert "part-w" in engine.store and mix in engine.store and mix in engine.mixes
        while engine.requests[rid].status.name != "FINISHED":
            engine.step()
        assert engine.requests[rid].finish_reason == "length" and len(engine.requests[rid].output_ids) == 4
        engine.release(rid)
    engine.unregister_adapter("part-w")
    assert "part-w" not in engine.store and mix not in engine.store and mix not in engine.mixes
    with pytest.raises(ValueError, match="kept for adapter mixes"):
        engine.register_adapter(mix, adapter_dirs["r4-qkvo"])
    assert mix not in engine.store


def test_old_unused_mixes_are_pruned_but_never_a_queued_or_recent_one(engine):
    rng = np.random.default_rng()
    names = [engine.register_mix({"r4-qkvo": float(w)}) for w in rng.uniform(0.1, 0.9, size=3)]
    saved = engine.mixes.max_mixes, engine.mixes.grace_s
    try:
        engine.mixes.max_mixes, engine.mixes.grace_s = 1, 1e9  # all asked for just now: none may go
        rid = engine.add_request(_prompt(rng, engine.cfg.vocab_size), names[0], SamplingParams(max_tokens=2))
        assert all(n in engine.store for n in names)
        engine.mixes.grace_s = 0.0
        rid2 = engine.add_request(_prompt(rng, engine.cfg.vocab_size), names[1], SamplingParams(max_tokens=2))
        # names[0] and names[1] have queued requests; every other mix goes
        assert engine.mixes.names() == names[:2] and names[2] not in engine.store
        engine.abort(rid)
        engine.abort(rid2)
    finally:
        engine.mixes.max_mixes, engine.mixes.grace_s = saved


@pytest.mark.skipif(len(jax.devices()) < 2, reason="tensor parallelism needs 2 devices (CPU: forced host devices)")
def test_mixes_are_refused_under_tensor_parallelism(tiny_dir, adapter_dirs):
    """A sharded pool's host rows are each device's share, not the whole model's rows a mix is built from: 400-able
    ValueError at once rather than a load failure later."""
    ecfg = dataclasses.replace(ENGINE, tensor_parallel_size=2, max_staged_adapters=4)
    eng = Engine.from_model_dir(tiny_dir, ecfg, adapters={"r4-qkvo": adapter_dirs["r4-qkvo"]}, progress=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        eng.register_mix({"r4-qkvo": 0.5})
    assert not eng.mixes.names() and eng.adapter_names() == ["r4-qkvo"]


# ---------------------------------------------------------------- over HTTP, through the real openai client

HTTP_MIX = {"ad-000": 0.7, "ad-002": -0.4}  # r4 on q,k,v,o + r16 on all 7 projections (server_fixtures)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("mix-server"), n_adapters=6)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def test_http_mix_equals_peft_in_completions_and_chat(client, srv):
    dirs = {n: srv.adapter_dir / n for n in HTTP_MIX}
    prompt = [int(t) for t in np.random.default_rng().integers(3, 500, size=9)]
    want = peft_cat_generate(srv.model_dir, dirs, tuple(HTTP_MIX), tuple(HTTP_MIX.values()), prompt, 8)
    r = client.completions.create(model=BASE_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"adapters": HTTP_MIX, "ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want and r.model == BASE_NAME
    messages = [{"role": "user", "content": "Mix two adapters, please."}]
    body = dict(model="ad-002", messages=messages, max_tokens=8, temperature=0,
                extra_body={"adapters": {"ad-002": -0.4, "ad-000": 0.7}, "ignore_eos": True, "return_token_ids": True})
    full = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert full.model == "ad-002"
    tok = srv.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    want = peft_cat_generate(srv.model_dir, dirs, tuple(HTTP_MIX), tuple(HTTP_MIX.values()), prompt_ids, 8)
    assert full.choices[0].model_extra["token_ids"] == want


def test_http_mix_is_cached_listed_and_counted_under_the_mixes_label(client, srv, http):
    name = srv.engine.register_mix(HTTP_MIX)  # thread-safe: the name the server uses
    built = srv.engine.mixes.registered
    for order in (HTTP_MIX, dict(reversed(HTTP_MIX.items()))):
        client.completions.create(model=BASE_NAME, prompt="Hello", max_tokens=2, extra_body={"adapters": order})
    assert srv.engine.mixes.registered == built
    (state,) = [a for a in http.get("/v1/adapters").json()["data"] if a["name"] == name]
    assert state["load_seconds"]["host"]["count"] == 1 and state["rank"] == 4 + 16
    assert name not in [m.id for m in client.models.list().data]
    text = http.get("/metrics").text  # every mix under one label: new weights use up no adapter's own label
    assert 'slora_adapter_requests_total{adapter="mix"}' in text and f'adapter="{name}"' not in text


@pytest.mark.parametrize("body, status, match", [
    ({"model": "ad-001", "adapters": HTTP_MIX}, 400, "model must be the base model"),
    ({"adapters": {"ad-000": 1.0, "nope": 0.5}}, 404, "'nope' does not exist"),
    ({"adapters": {"ad-000": 1.0, "ad-003": 0.5}}, 400, "rank 36 at layer 0 q_proj .* maximum LoRA rank 32"),
    ({"adapters": {"ad-000": 0.0}}, 400, "non-zero"),
    ({"adapters": {"ad-000": "0.5"}}, 400, "adapters.ad-000"),
    ({"adapters": {"ad-000": True}}, 400, "adapters.ad-000"),
    ({"adapters": {}}, 400, "at least one"),
    ({"adapters": {f"ad-00{i}": 0.1 for i in range(6)} | {f"x{i}": 1.0 for i in range(3)}}, 400, "at most 8"),
    ({"adapters": ["ad-000"]}, 400, "adapters"),
])
def test_http_bad_mixes_are_refused_with_the_reason(http, body, status, match):
    for path in ("/v1/completions", "/v1/chat/completions"):
        payload = {"model": BASE_NAME, "max_tokens": 2, **body}
        payload |= {"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
        r = http.post(path, json=payload)
        assert r.status_code == status, r.text
        assert re.search(match, r.json()["error"]["message"]), r.text
    ok = http.post("/v1/completions", json={"model": BASE_NAME, "prompt": "Hi", "max_tokens": 2,
                                            "adapters": {"ad-001": 0.5}})
    assert ok.status_code == 200, ok.text


def test_http_requests_refused_for_other_reasons_register_no_mix(http, srv):
    """A mix is registered only once the rest of the request passed its checks: refused requests, each naming a new
    mix, once left every one registered (past max_mixes, with no bound)."""
    rng = np.random.default_rng()
    built = srv.engine.mixes.registered
    for path in ("/v1/completions", "/v1/chat/completions"):
        for bad in ({"temperature": -1}, {"max_tokens": -3}, {"guided_regex": "(("}, {"n": 0}):
            payload = {"model": BASE_NAME, "max_tokens": 2, "adapters": {"ad-000": float(rng.uniform(0.1, 2.0)),
                                                                           "ad-001": 1.0}, **bad}
            payload |= {"prompt": "Hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "Hi"}]}
            r = http.post(path, json=payload)
            assert r.status_code == 400, (bad, r.text)
    assert srv.engine.mixes.registered == built


def test_http_non_finite_weights_and_mixes_of_mixes_are_refused(http, srv):
    for raw in ("NaN", "Infinity", "-Infinity", "1e400"):
        r = http.post("/v1/completions", content=f'{{"model": "{BASE_NAME}", "prompt": "Hi", "max_tokens": 2, '
                                                 f'"adapters": {{"ad-000": {raw}}}}}',
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"], r.text
    name = srv.engine.register_mix({"ad-001": 0.5})
    r = http.post("/v1/completions", json={"model": BASE_NAME, "prompt": "Hi", "adapters": {name: 1.0}})
    assert r.status_code == 400 and "is itself a mix" in r.json()["error"]["message"]


def test_http_unloading_a_part_unloads_its_mixes(client, http, srv):
    mix = {"ad-004": 0.5, "ad-005": 1.5}
    client.completions.create(model=BASE_NAME, prompt="Hi", max_tokens=2, extra_body={"adapters": mix})
    name = srv.engine.register_mix(mix)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ad-005"}).status_code == 200
    assert name not in {a["name"] for a in http.get("/v1/adapters").json()["data"]}
    with pytest.raises(openai.NotFoundError, match="ad-005"):
        client.completions.create(model=BASE_NAME, prompt="Hi", max_tokens=2, extra_body={"adapters": mix})
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ad-005", "lora_path": str(srv.adapter_dir / "ad-005")})
    assert r.status_code == 200, r.text
    client.completions.create(model=BASE_NAME, prompt="Hi", max_tokens=2, extra_body={"adapters": mix})
    assert name in {a["name"] for a in http.get("/v1/adapters").json()["data"]}


def test_a_part_whose_failure_may_pass_is_a_503_through_a_mix_too():
    """A part whose read failed in a way that may pass (a disk away: ``retry_after_s`` set) answers 503 with
    Retry-After, as the adapter itself would; a part's lasting failure stays a 400."""
    from types import SimpleNamespace

    from slora_jax.serve.protocol import APIError
    from slora_jax.serve.request_builder import RequestBuilder

    def builder(error):
        def register_mix(parts):
            raise error

        engine = SimpleNamespace(cfg=SimpleNamespace(vocab_size=64, eos_token_id=[2]), register_mix=register_mix)
        return RequestBuilder(engine, BASE_NAME, None, max_prompt_chars=100, threads=1)

    with pytest.raises(APIError) as err:
        builder(AdapterError("part-a", "its weights file is gone", 30.0)).mix_for(BASE_NAME, {"part-a": 1.0})
    assert err.value.status == 503 and err.value.retry_after_s == 30.0 and "part-a" in err.value.message
    with pytest.raises(APIError) as err:
        builder(AdapterError("part-a", "rank 99 above the maximum")).mix_for(BASE_NAME, {"part-a": 1.0})
    assert err.value.status == 400 and err.value.param == "adapters"
