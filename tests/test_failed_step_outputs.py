"""After a step raises, what the server does next (abort the hurt requests, keep stepping) ends each of them exactly
once and leaves the next requests unhurt.

Two ways it once went wrong: a request the scheduler had already marked as failed, then aborted, got a second final
output on the next step; and a step whose batch was all aborted was still read back, so its device error was raised
again, failing the next step and its new requests too.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.sequence import Status

GREEDY = dict(temperature=0.0, ignore_eos=True)
ADAPTERS = ("r4-qkvo", "r8-all7")
ECFG = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=48, page_size=4,
                    max_lora_rank=32, max_loras=3, num_pages=256, dtype="float32", backend="reference")


def _engine(tiny_dir, adapter_dirs, ecfg=ECFG) -> Engine:
    return Engine.from_model_dir(tiny_dir, ecfg, adapters={a: adapter_dirs[a] for a in ADAPTERS}, progress=False)


def _prompt(rng, vocab) -> list[int]:
    return [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(3, 14)))]


def _serve(eng, finals) -> None:
    """Step until idle; every output error-free, each request's final output recorded once in ``finals``."""
    for _ in range(100):
        if not eng.has_unfinished():
            return
        for out in eng.step():
            assert out.error is None, out.error
            if out.finished:
                assert out.request_id not in finals, f"a second final output: {out}"
                finals[out.request_id] = out
    raise AssertionError("the engine does not terminate")


def test_a_failed_request_aborted_before_its_failure_was_reported_ends_once(tiny_dir, adapter_dirs, monkeypatch):
    """Early abort takes a request past its deadline out of the queue, then admission raises (a device error): the
    step raises before the request's failure is reported. The server aborts it (its one final output); the next
    step must not end it again. A request waiting beside it is served as if alone."""
    eng = _engine(tiny_dir, adapter_dirs, dataclasses.replace(ECFG, early_abort=True))
    rng = np.random.default_rng()
    sp = SamplingParams(max_tokens=5, **GREEDY)
    late_prompt, prompt = _prompt(rng, eng.cfg.vocab_size), _prompt(rng, eng.cfg.vocab_size)
    expected = eng.generate([prompt], [ADAPTERS[1]], sp)[0]
    got: list = []
    late = eng.add_request(late_prompt, ADAPTERS[0], sp, first_token_slo_s=1e-4, on_output=got.append)
    other = eng.add_request(prompt, ADAPTERS[1], sp)
    time.sleep(0.01)  # the deadline passes before the next schedule
    real_admit = eng.scheduler._admit

    def admit_failing():
        raise RuntimeError("INTERNAL: admission failed (simulated)")

    monkeypatch.setattr(eng.scheduler, "_admit", admit_failing)
    with pytest.raises(RuntimeError, match="simulated"):
        eng.step()
    assert got == []  # its failure was not reported yet
    monkeypatch.setattr(eng.scheduler, "_admit", real_admit)
    assert eng.abort(late)
    assert [(o.finished, o.finish_reason) for o in got] == [(True, "abort")]
    finals: dict = {}
    _serve(eng, finals)
    assert len(got) == 1 and late not in finals, got
    assert eng.requests[other].output_ids == expected and finals[other].finish_reason == "length"
    assert eng.pool.stats()["pages_kv"] == 0 and all(eng.store.pin_count(a) == 0 for a in ADAPTERS)


class _FailedOnDevice:
    """A step's output whose computation failed on the device: reading it raises (as a jax.Array does)."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("INTERNAL: the step failed on the device (simulated)")


def test_a_step_whose_batch_was_aborted_is_not_read_back(tiny_dir, adapter_dirs, monkeypatch):
    """A decode fails on the device; the step after it (queued behind it, fed its tokens) fails too. Reading the
    first back raises; the server aborts the running batch. The second, whose every request is now aborted, must not
    be read back: its error would fail the next step, and with it a new request that has nothing to do with it."""
    eng = _engine(tiny_dir, adapter_dirs)
    rng = np.random.default_rng()
    sp = SamplingParams(max_tokens=8, **GREEDY)
    hurt_prompt, prompt = _prompt(rng, eng.cfg.vocab_size), _prompt(rng, eng.cfg.vocab_size)
    expected = eng.generate([prompt], [ADAPTERS[1]], sp)[0]
    hurt = eng.add_request(hurt_prompt, ADAPTERS[0], sp)
    eng.step()  # its prefill queued
    real_decode = eng.runner.decode

    def decode_failing_on_device(params, pool, table, items, prev_tokens=None, lora="all"):
        if isinstance(prev_tokens, _FailedOnDevice):
            prev_tokens = None  # a real step would take the failed tokens and fail too
        _, pool = real_decode(params, pool, table, items, prev_tokens, lora=lora)
        return _FailedOnDevice(), pool

    monkeypatch.setattr(eng.runner, "decode", decode_failing_on_device)
    eng.step()  # the failing decode queued, the prefill read back
    with pytest.raises(RuntimeError, match="simulated"):
        eng.step()  # the next decode queued behind it; reading the failed one raises
    monkeypatch.setattr(eng.runner, "decode", real_decode)
    for rid in eng.running_request_ids():  # what the server's engine loop does after a failed step
        assert eng.abort(rid)
    assert eng.requests[hurt].status == Status.FINISHED
    fresh = eng.add_request(prompt, ADAPTERS[1], sp)
    finals: dict = {}
    _serve(eng, finals)
    assert eng.requests[fresh].output_ids == expected and finals[fresh].finish_reason == "length"
    assert eng.pool.stats()["pages_kv"] == 0 and all(eng.store.pin_count(a) == 0 for a in ADAPTERS)
