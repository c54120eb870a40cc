"""Warm-up compiling its steps ahead on threads: every step is compiled before the first run, the runs then compile
nothing, serving after it (echo prefills included) compiles nothing and gives the same tokens as a warm-up one step at
a time; with the persistent cache a restart takes every step from the cache. The thread count follows the cache
switch, the environment override, the cores and the memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from store_helpers import logged_rng

from slora_jax.engine import compile_counter
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.step_runner import compile_with_retries

ECFG = dict(max_batch_size=4, max_prefill_tokens=32, max_prefill_seqs=2, max_model_len=32, page_size=4,
            max_lora_rank=8, max_loras=2, num_pages=64, dtype="float32", backend="reference", min_prefill_bucket=16)


def _requests(rng, vocab: int, adapter: str) -> list:
    prompts = [[int(t) for t in rng.integers(3, vocab, size=int(rng.integers(3, 12)))] for _ in range(3)]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    echo = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    return [(prompts[0], None, greedy), (prompts[1], adapter, greedy), (prompts[2], adapter, echo)]


def _serve(engine, requests) -> list:
    ids = [engine.add_request(p, a, s) for p, a, s in requests]
    got: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens, prompt = got.setdefault(out.request_id, ([], []))
            tokens.extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                prompt.extend((lp.token_id, round(lp.logprob, 4)) if lp else None for lp in out.prompt_logprobs)
    return [got[i] for i in ids]


def test_steps_compiled_ahead_leave_the_runs_nothing_to_compile(tiny_dir, tiny_cfg, adapter_dirs, monkeypatch):
    rng = logged_rng("parallel warm-up")
    requests = _requests(rng, tiny_cfg.vocab_size, "r8-all7")
    served = {}
    for workers in (1, 2):
        monkeypatch.setenv("SLORA_JAX_COMPILE_WORKERS", str(workers))
        ecfg = EngineConfig(**ECFG, decode_lora_variants=workers == 2)  # a fresh jit per engine: compiles again
        engine = Engine.from_model_dir(tiny_dir, ecfg, adapters={"r8-all7": adapter_dirs["r8-all7"]}, progress=False)
        engine.warmup(progress=False)
        stats = engine.runner.warmup_stats
        steps = len(engine.runner.warmup_jobs())
        assert stats["steps"] == steps and stats["workers"] == workers
        if workers == 2:
            assert stats["ahead_compiles"] == steps and stats["run_compiles"] == 0, stats
        else:
            assert stats["ahead_compiles"] == 0 and stats["run_compiles"] == steps, stats
        served[workers] = _serve(engine, requests)
        assert engine.compiles_since_warmup() == 0
    assert served[1] == served[2]
    assert served[2][2][1] and all(tokens for tokens, _ in served[2])  # the echo request got its prompt logprobs


def test_echo_prefills_compile_one_bucket(tiny_dir):
    engine = Engine.from_model_dir(tiny_dir, EngineConfig(**ECFG, decode_lora_variants=False), progress=False)
    jobs = engine.runner.warmup_jobs()
    ecfg = engine.runner.ecfg
    assert [j for j in jobs if j[0] == "prefill_echo"] == [("prefill_echo", ecfg.prefill_buckets[-1], None)]
    assert len(jobs) == len(ecfg.prefill_buckets) + 1 + len(ecfg.decode_buckets)


RESTART = textwrap.dedent("""
    import json, sys
    from slora_jax.engine import compile_counter
    compile_counter.enable_persistent_cache(sys.argv[2])
    from slora_jax.engine.config import EngineConfig
    from slora_jax.engine.engine import Engine
    engine = Engine.from_model_dir(sys.argv[1], EngineConfig(**json.loads(sys.argv[3])), progress=False)
    engine.warmup(progress=False)
    print(json.dumps(engine.runner.warmup_stats))
""")


def test_a_restart_takes_every_step_compiled_ahead_from_the_cache(tiny_dir, tmp_path):
    env = dict(os.environ, SLORA_JAX_COMPILE_WORKERS="2")
    ecfg = json.dumps(dict(ECFG, decode_lora_variants=False))

    def start() -> dict:
        out = subprocess.run([sys.executable, "-c", RESTART, str(tiny_dir), str(tmp_path / "xla"), ecfg],
                             capture_output=True, text=True, env=env, timeout=600, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = start(), start()
    steps = cold["steps"]
    assert cold["ahead_compiles"] == steps and cold["ahead_cache_hits"] == 0 and cold["run_compiles"] == 0, cold
    assert warm["ahead_compiles"] == warm["ahead_cache_hits"] == steps and warm["run_compiles"] == 0, warm


def test_compile_workers_follow_the_cache_the_override_cores_and_memory(monkeypatch):
    monkeypatch.delenv("SLORA_JAX_COMPILE_WORKERS", raising=False)
    monkeypatch.setattr(compile_counter, "persistent_cache_enabled", lambda: False)
    assert compile_counter.compile_workers() == 1  # no cache: one compile at a time, as the runs would
    monkeypatch.setattr(compile_counter, "persistent_cache_enabled", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(compile_counter, "available_memory", lambda: 100 << 30)
    assert compile_counter.compile_workers() == compile_counter.MAX_COMPILE_WORKERS
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert compile_counter.compile_workers() == 3
    monkeypatch.setattr(compile_counter, "available_memory", lambda: 5 << 30)
    assert compile_counter.compile_workers() == 5 // 2
    monkeypatch.setattr(compile_counter, "available_memory", lambda: 1 << 20)
    assert compile_counter.compile_workers() == 1
    monkeypatch.setenv("SLORA_JAX_COMPILE_WORKERS", "6")
    assert compile_counter.compile_workers() == 6
    monkeypatch.setenv("SLORA_JAX_COMPILE_WORKERS", "zero")
    with pytest.raises(ValueError, match="SLORA_JAX_COMPILE_WORKERS"):
        compile_counter.compile_workers()


class _Lowered:
    """A lowered step whose compile fails with the given errors first, then returns its executable (a fresh object)."""

    def __init__(self, errors):
        self.errors, self.calls = list(errors), 0
        self.result = object()

    def compile(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.result


def test_a_compile_that_fails_to_launch_its_tool_is_tried_again_and_others_raise():
    """Session 28: one of 8 compile threads of a 7B server failed with "Failed to launch ptxas" and the server did
    not start. That kind is tried again (up to 3 tries); any other error, and a third failure, still raise."""
    launch = RuntimeError("INTERNAL: Failed to launch ptxas")
    once = _Lowered([launch])
    assert compile_with_retries(once, pause_s=0) is once.result and once.calls == 2
    other = _Lowered([RuntimeError("RESOURCE_EXHAUSTED: out of memory")])
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        compile_with_retries(other, pause_s=0)
    assert other.calls == 1
    always = _Lowered([launch] * 3)
    with pytest.raises(RuntimeError, match="Failed to launch"):
        compile_with_retries(always, pause_s=0)
    assert always.calls == 3
