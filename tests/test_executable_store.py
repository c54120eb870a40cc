"""The executable store: a restart (a fresh process) loads every warm-up step from disk, traces none, compiles
nothing after warm-up, donates the pool as the jitted step does, and gives the same tokens as the cold start; a code
change misses cleanly; a truncated, corrupt or foreign entry is dropped with a warning and compiled again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from store_helpers import logged_rng

from slora_jax.engine import executable_store
from slora_jax.engine.executable_store import ExecutableStore

ECFG = dict(max_batch_size=4, max_prefill_tokens=32, max_prefill_seqs=2, max_model_len=32, page_size=4,
            max_lora_rank=8, max_loras=2, num_pages=64, dtype="float32", backend="reference", min_prefill_bucket=16,
            decode_lora_variants=False)

# One start: warm up with the store on, serve fixed requests, report what warm-up loaded / traced / compiled, what
# serving traced and compiled, whether a step donated the pool in place, and the tokens. argv: model dir, adapter
# dir, cache dir, engine config (JSON), requests (JSON), "edited" to simulate a code change.
START = textwrap.dedent("""
    import json, sys
    from slora_jax.engine import compile_counter, executable_store, step_runner
    cache = compile_counter.enable_persistent_cache(sys.argv[3])
    store = executable_store.enable(cache / "executables")
    if sys.argv[6] == "edited":
        executable_store.source_digest = lambda: "the code changed"
    traces = [0]
    forward = step_runner.paged_forward
    def counting(*a, **k):
        traces[0] += 1
        return forward(*a, **k)
    step_runner.paged_forward = counting
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    from slora_jax.engine.sampling import SamplingParams
    engine = Engine.from_model_dir(sys.argv[1], EngineConfig(**json.loads(sys.argv[4])),
                                   adapters={"a": sys.argv[2]}, progress=False)
    engine.warmup(progress=False)
    warm_traces, traces[0] = traces[0], 0
    pointers = lambda a: [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
    old = engine.pool.array
    pointer = pointers(old)
    ids = [engine.add_request(p, a, SamplingParams(**s)) for p, a, s in json.loads(sys.argv[5])]
    engine.step()  # one prefill: the pool it was given is donated and updated in place
    donated = dict(deleted=old.is_deleted(), in_place=pointers(engine.pool.array) == pointer)
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].extend(out.new_token_ids)
    print(json.dumps(dict(stats=engine.runner.warmup_stats, warm_traces=warm_traces, serve_traces=traces[0],
                          compiles_after=engine.compiles_since_warmup(), donated=donated,
                          tokens=[got[i] for i in ids], saved=store.saved, dropped=store.dropped,
                          cache_served=store.cache_served)))
""")


def _requests(vocab: int) -> str:
    rng = logged_rng("executable store requests")
    prompt = lambda: [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(3, 12)))]  # noqa: E731
    return json.dumps([
        (prompt(), None, dict(max_tokens=5, temperature=0.0)),
        (prompt(), "a", dict(max_tokens=5, temperature=0.9, seed=int(rng.integers(1 << 30)))),
        (prompt(), "a", dict(max_tokens=3, temperature=0.0, prompt_logprobs=1, presence_penalty=0.5))])


def _start(tiny_dir, adapter, cache, requests: str, edited: bool = False, env_extra: dict | None = None,
           **ecfg) -> tuple[dict, str]:
    env = dict(os.environ, SLORA_JAX_COMPILE_WORKERS="2", **(env_extra or {}))
    env.pop(executable_store.ENV_SWITCH, None)
    out = subprocess.run([sys.executable, "-c", START, str(tiny_dir), str(adapter), str(cache),
                          json.dumps(dict(ECFG, **ecfg)),
                          requests, "edited" if edited else "-"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(scope="module")
def cold(tiny_dir, tiny_cfg, adapter_dirs, tmp_path_factory):
    """A cold start (empty cache) and what it stored."""
    cache = tmp_path_factory.mktemp("cold") / "xla"
    requests = _requests(tiny_cfg.vocab_size)
    report, _ = _start(tiny_dir, adapter_dirs["r8-all7"], cache, requests)
    return dict(report=report, cache=cache, requests=requests, adapter=adapter_dirs["r8-all7"])


def _restart(tiny_dir, cold, tmp_path, edited: bool = False, spoil=None,
             env_extra: dict | None = None) -> tuple[dict, str, list]:
    cache = tmp_path / "xla"
    shutil.copytree(cold["cache"], cache)
    entries = sorted((cache / "executables").glob("*.exe"))
    if spoil:
        spoil(entries)
    report, stderr = _start(tiny_dir, cold["adapter"], cache, cold["requests"], edited, env_extra)
    return report, stderr, entries


def test_the_cold_start_stores_every_step(cold):
    r = cold["report"]
    steps = r["stats"]["steps"]
    assert r["stats"]["loaded"] == 0 and r["warm_traces"] >= steps and r["saved"] == steps, r
    assert len(list((cold["cache"] / "executables").glob("*.exe"))) == steps
    assert not list((cold["cache"] / "executables").glob("*.tmp"))
    assert r["compiles_after"] == 0 and r["donated"] == dict(deleted=True, in_place=True), r


def test_a_restart_loads_every_step_traces_none_and_serves_the_same_tokens(tiny_dir, cold, tmp_path):
    r, _, _ = _restart(tiny_dir, cold, tmp_path)
    steps = r["stats"]["steps"]
    assert r["stats"]["loaded"] == steps and r["stats"]["ahead_compiles"] == r["stats"]["run_compiles"] == 0, r
    assert r["warm_traces"] == 0 and r["serve_traces"] == 0 and r["compiles_after"] == 0, r
    assert r["saved"] == r["dropped"] == 0
    assert r["donated"] == dict(deleted=True, in_place=True), r  # the loaded step donates the pool as jit did
    assert r["tokens"] == cold["report"]["tokens"] and all(r["tokens"])


@pytest.mark.skipif(jax.device_count() < 2, reason="needs two devices (CPU runs make four; one GPU has one)")
def test_a_tensor_parallel_restart_loads_its_steps_onto_the_mesh(tiny_dir, tiny_cfg, adapter_dirs, tmp_path):
    """Two of the host's devices (the conftest makes 4), in mesh order: a loaded step must run on exactly those."""
    requests = _requests(tiny_cfg.vocab_size)
    runs = [_start(tiny_dir, adapter_dirs["r8-all7"], tmp_path / "xla", requests, tensor_parallel_size=2)[0]
            for _ in range(2)]
    cold, warm = runs
    steps = cold["stats"]["steps"]
    assert cold["saved"] == steps and warm["stats"]["loaded"] == steps and warm["warm_traces"] == 0, runs
    assert warm["serve_traces"] == 0 and warm["compiles_after"] == 0 and warm["tokens"] == cold["tokens"], runs
    assert warm["donated"] == dict(deleted=True, in_place=True), warm  # every device's shard updated in place


def test_a_code_change_misses_cleanly(tiny_dir, cold):
    """The store misses; JAX's persistent cache serves the compiles, and with the switch off (the CPU default)
    those executables are not stored again (re-serialized, XLA:CPU's failed at the next start's first run: "Function
    ... not found"), so a second start of the changed code serves the same tokens too. In the cold start's own cache
    dir: JAX's cache keys hold its path (XLA's autotune cache dir is in the compile options), so a copy would miss."""
    store = cold["cache"] / "executables"
    before = sorted(store.glob("*.exe"))
    off = {executable_store.STORE_CACHE_SERVED_SWITCH: "0"}
    runs = [_start(tiny_dir, cold["adapter"], cold["cache"], cold["requests"], edited=True, env_extra=off)
            for _ in range(2)]
    (r, stderr), (again, _) = runs
    steps = r["stats"]["steps"]
    assert r["stats"]["loaded"] == 0 and r["warm_traces"] >= steps and r["dropped"] == 0, r
    assert r["stats"]["ahead_cache_hits"] == steps and r["saved"] == 0, r["stats"]
    assert "executable store" not in stderr  # a miss is not a warning
    assert sorted(store.glob("*.exe")) == before
    for run in (r, again):
        assert run["tokens"] == cold["report"]["tokens"] and run["compiles_after"] == 0, run


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA:CPU fails this (the switch's comment says how)")
def test_steps_from_jax_cache_stored_on_request_load_and_run_at_the_next_start(tiny_dir, cold, tmp_path):
    """``SLORA_JAX_STORE_CACHE_SERVED=1``: with the store emptied, a start takes every step from JAX's persistent
    cache (a copy of the dir hits on the GPU) and stores it; the start after it loads them all, traces nothing and
    serves the cold start's tokens. Passing here on the GPU (H200, jax 0.11.2) is why the switch defaults on there."""
    switch = {}  # the GPU default
    first, _, _ = _restart(tiny_dir, cold, tmp_path, spoil=lambda entries: [e.unlink() for e in entries],
                           env_extra=switch)
    second, _ = _start(tiny_dir, cold["adapter"], tmp_path / "xla", cold["requests"], env_extra=switch)
    runs = (first, second)
    steps = first["stats"]["steps"]
    assert first["stats"]["loaded"] == 0 and first["stats"]["ahead_cache_hits"] == steps, first["stats"]
    assert first["saved"] == steps and first["cache_served"] == 0, first
    assert second["stats"]["loaded"] == steps and second["warm_traces"] == 0 and second["serve_traces"] == 0, second
    for run in runs:
        assert run["tokens"] == cold["report"]["tokens"] and run["compiles_after"] == 0, run


def test_truncated_and_corrupt_entries_are_dropped_with_a_warning_and_compiled_again(tiny_dir, cold, tmp_path):
    rng = logged_rng("spoiled entries")
    spoiled = {}

    def spoil(entries):
        truncated, flipped = rng.choice(len(entries), size=2, replace=False)
        data = entries[truncated].read_bytes()
        entries[truncated].write_bytes(data[: int(rng.integers(1, len(data)))])
        data = bytearray(entries[flipped].read_bytes())
        data[int(rng.integers(len(executable_store.FORMAT) + 32, len(data)))] ^= 0xFF
        entries[flipped].write_bytes(bytes(data))
        spoiled.update(truncated=entries[truncated], flipped=entries[flipped], size=len(data))

    r, stderr, entries = _restart(tiny_dir, cold, tmp_path, spoil=spoil)
    steps = r["stats"]["steps"]
    # compiled again: by XLA, then stored again; or served by JAX's persistent cache (the copied cache hits on the
    # GPU, not on XLA:CPU), then not stored (the step runner says why) and the spoiled entry is gone, not kept
    assert r["stats"]["loaded"] == steps - 2 and r["dropped"] == 2 and r["saved"] + r["cache_served"] == 2, r
    assert stderr.count("executable store: dropping") == 2 and "corrupt or truncated" in stderr
    assert r["tokens"] == cold["report"]["tokens"] and r["compiles_after"] == 0
    for e in (spoiled["truncated"], spoiled["flipped"]):
        assert not e.exists() or e.stat().st_size > len(executable_store.FORMAT) + 32, e
    assert sum(e.exists() for e in entries) == steps - r["cache_served"]


# ---------------------------------------------------------------- the store on its own (in this process)
def _tiny_step():
    fn = jax.jit(lambda pool, x: (pool + x.sum(), (x * 2).sum()), donate_argnums=(0,))
    rng = np.random.default_rng()
    pool = jax.device_put(jnp.asarray(rng.standard_normal(256), jnp.float32), jax.devices()[0])
    x = rng.standard_normal(8).astype(np.float32)
    return fn, pool, x


def test_an_entry_for_other_inputs_or_of_garbage_is_dropped(tmp_path, caplog):
    store = ExecutableStore(tmp_path)
    fn, pool, x = _tiny_step()
    assert store.save("key a", fn.lower(pool, x).compile())
    loaded = store.load("key a", (pool, x), jax.devices()[:1])
    want = np.asarray(pool) + x.sum()
    got, _ = loaded(pool, x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)  # sums in another order
    assert pool.is_deleted()  # donated through the loaded executable
    shutil.copy(store.path("key a"), store.path("key b"))  # a hash collision or a copied file
    assert store.load("key b", (got, x), jax.devices()[:1]) is None and not store.path("key b").exists()
    assert "written for other inputs" in caplog.text
    store.path("key c").write_bytes(os.urandom(100))
    assert store.load("key c", (got, x), jax.devices()[:1]) is None and not store.path("key c").exists()
    assert store.load("key a", (got, x, x), jax.devices()[:1]) is None  # called with another argument tree
    assert "argument tree" in caplog.text and store.dropped == 3
    assert store.load("never saved", (got, x), jax.devices()[:1]) is None and store.dropped == 3  # a plain miss


def test_an_unserializable_step_is_not_saved_and_nothing_raises(tmp_path, caplog):
    store = ExecutableStore(tmp_path)
    assert not store.save("key", object())
    assert "cannot save" in caplog.text and not list(tmp_path.iterdir())


class _HoldsACall:
    """Stands in for a compiled step whose HLO holds ``target`` (only ``as_text`` is asked before serializing)."""

    def __init__(self, target: str):
        self.target = target

    def as_text(self) -> str:
        return f'%c = bf16[8] custom-call(bf16[8] %x), custom_call_target="{self.target}", api_version=4'


def test_a_step_holding_a_mosaic_gpu_call_is_not_stored(tmp_path, caplog):
    """Such an executable loads only in the process that compiled it (H200, session 20): storing it would only
    make every restart drop it again."""
    store = ExecutableStore(tmp_path)
    caplog.set_level("INFO", logger=executable_store.__name__)
    assert not store.save("key", _HoldsACall("mosaic_gpu_v2"))
    assert store.process_bound == 1 and store.saved == 0 and not list(tmp_path.iterdir())
    assert "mosaic_gpu_v2" in caplog.text and "only in this process" in caplog.text
    fn, pool, x = _tiny_step()  # a step without one is stored as before
    assert store.save("plain", fn.lower(pool, x).compile()) and store.path("plain").exists()
    assert executable_store.process_bound_call(_HoldsACall("some_other_target")) is None


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiles a Mosaic GPU kernel for this GPU")
def test_a_real_mosaic_gpu_step_is_recognised_and_not_stored(tmp_path):
    """The check reads the HLO the GPU compiler really leaves: the prefill attention's Mosaic kernel, compiled."""
    from pallas_kernels import backends
    if not backends.mosaic_prefill_platform():
        pytest.skip("needs a Hopper GPU with Mosaic GPU")
    from pallas_kernels.prefill_attention_mgpu import paged_prefill_attention_mosaic
    avals = (jax.ShapeDtypeStruct((300, 8, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 40, 64, 128), jnp.bfloat16),
             jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((3, 20), jnp.int32),
             jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.int32))
    compiled = jax.jit(lambda *a: paged_prefill_attention_mosaic(*a, page_size=16, num_kv_heads=2, sm_scale=0.1)
                       ).trace(*avals).lower().compile()
    assert executable_store.process_bound_call(compiled) is not None
    store = ExecutableStore(tmp_path)
    assert not store.save("mosaic step", compiled) and store.process_bound == 1 and not list(tmp_path.iterdir())


def test_the_switch_turns_the_store_off(tmp_path, monkeypatch):
    monkeypatch.setenv(executable_store.ENV_SWITCH, "0")
    assert executable_store.enable(tmp_path) is None and executable_store.active() is None
    monkeypatch.delenv(executable_store.ENV_SWITCH)
    try:
        assert executable_store.enable(tmp_path).root == tmp_path and executable_store.active() is not None
    finally:
        executable_store.disable()
