"""The step jits carry ``step_compiler_options``: on a GPU, XLA's rematerialization pass is off.

Why: that pass aims at a memory limit below the step's own (donated) arguments, so on the H200 it printed a
"Can't reduce memory use" warning at every step compile and saved nothing (NOTES, session 5 and 14). These tests run
on the CPU: they check that the option names are ones XLA knows (a misspelt one fails the compile) and that the step
jits really pass what ``step_compiler_options`` returns to XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from slora_jax.engine import step_runner
from slora_jax.engine.config import EngineConfig
from slora_jax.engine.pool import PagedPool
from slora_jax.engine.step_runner import StepItem, StepRunner, step_compiler_options
from slora_jax.model.loader import load_params


def test_gpu_steps_compile_without_rematerialization_and_cpu_steps_unchanged():
    assert step_compiler_options("gpu") == {"xla_disable_hlo_passes": "rematerialization"}
    assert step_compiler_options("cpu") == {}


def test_the_gpu_options_are_ones_xla_knows():
    """The same debug options exist on every platform: compiling with them here catches a misspelt name."""
    x = jnp.asarray(np.random.default_rng().standard_normal(8), jnp.float32)
    fn = jax.jit(lambda a: a * 2 + 1, compiler_options=step_compiler_options("gpu"))
    np.testing.assert_allclose(np.asarray(fn(x)), np.asarray(x) * 2 + 1, rtol=1e-6)
    with pytest.raises(Exception, match="xla_no_such_option"):
        jax.jit(lambda a: a + 3, compiler_options={"xla_no_such_option": "1"})(x).block_until_ready()


def _prefill_tokens(cfg, params, options, monkeypatch) -> np.ndarray:
    """Next tokens of one greedy prefill step from a runner whose step jits get ``options``."""
    monkeypatch.setattr(step_runner, "step_compiler_options", lambda platform: dict(options))
    ecfg = EngineConfig(max_batch_size=2, max_prefill_tokens=16, max_prefill_seqs=2, max_model_len=16, page_size=4,
                        max_lora_rank=8, max_loras=2, num_pages=32, dtype="float32", backend="reference")
    runner = StepRunner(cfg, ecfg)
    pool = PagedPool(cfg, page_size=4, max_slots=2, max_rank=8, num_pages=32, dtype=jnp.float32)
    prompt = [int(t) for t in np.random.default_rng(7).integers(1, cfg.vocab_size, 5)]
    item = StepItem(prompt, 0, pool.alloc_kv_pages(2), -1, None, 0, 0)
    tokens, _ = runner.prefill(params, pool.array, pool.table, [item])
    return np.asarray(tokens)


def test_step_jits_pass_the_options_to_xla(tiny_dir, monkeypatch):
    cfg, params = load_params(tiny_dir, dtype=jnp.float32, progress=False)
    with pytest.raises(Exception, match="xla_no_such_option"):
        _prefill_tokens(cfg, params, {"xla_no_such_option": "1"}, monkeypatch)
    plain = _prefill_tokens(cfg, params, {}, monkeypatch)
    no_remat = _prefill_tokens(cfg, params, step_compiler_options("gpu"), monkeypatch)
    np.testing.assert_array_equal(no_remat, plain)
