"""Edge cases of the engine's host/device overlap: a step's tokens are read back only after the next step is queued.

Every request here is checked against the same request run alone (or against HF PEFT for greedy decoding), and the
page books and adapter pins are audited after every step.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from hf_reference import hf_generate

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.engine.scheduler import RequestRejected
from slora_jax.engine.sequence import Status

GREEDY = dict(temperature=0.0, ignore_eos=True)
ADAPTERS = ("r4-qkvo", "r8-all7")

BIG = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=48, page_size=4,
                   max_lora_rank=32, max_loras=3, num_pages=256, dtype="float32", backend="reference")
# KV for about two full sequences: running several forces preemption by recompute.
TIGHT = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=8, max_model_len=48, page_size=4,
                     max_lora_rank=32, max_loras=2, num_pages=40, dtype="float32", backend="reference")


class CharTokenizer:
    """Each id decodes to ``<id>``: stop strings can name one token's text exactly."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{int(i)}>" for i in ids)


def _make(tiny_dir, adapter_dirs, ecfg):
    return Engine.from_model_dir(tiny_dir, ecfg, adapters={a: adapter_dirs[a] for a in ADAPTERS},
                                 tokenizer=CharTokenizer(), progress=False)


@pytest.fixture(scope="module")
def eng(tiny_dir, adapter_dirs):
    return _make(tiny_dir, adapter_dirs, BIG)


@pytest.fixture(scope="module")
def tight(tiny_dir, adapter_dirs):
    return _make(tiny_dir, adapter_dirs, TIGHT)


def _prompt(rng, vocab, lo=3, hi=14):
    return [int(t) for t in rng.integers(3, vocab, size=int(rng.integers(lo, hi)))]


def _alone(engine, prompt, adapter, sp):
    return engine.generate([prompt], [adapter], sp)[0]


def _audit(engine):
    """Page books balance, live sequences hold disjoint KV pages that they own, pins match running sequences."""
    alloc = engine.pool.allocator
    alloc.check_invariants()
    seen: set[int] = set()
    for seq in engine.requests.values():
        if seq.status == Status.FINISHED or seq.status == Status.WAITING:
            assert not seq.kv_pages, (seq.request_id, seq.status, seq.kv_pages)
            continue
        assert not seen & set(seq.kv_pages), "a KV page is held by two sequences"
        seen |= set(seq.kv_pages)
        for p in seq.kv_pages:
            assert alloc.owner_of(p) == ("kv", seq.request_id)
    assert engine.pool.stats()["pages_kv"] == len(seen)
    pins: dict[str, int] = {}
    for seq in engine.scheduler.running:
        if seq.adapter is not None:
            pins[seq.adapter] = pins.get(seq.adapter, 0) + 1
    for name in ADAPTERS:
        assert engine.store.pin_count(name) == pins.get(name, 0), name
    engine.stats()  # live KV tokens must fit the KV pages


def _drive(engine, schedule=None, aborts=None, max_steps=400):
    """Step until idle, adding ``schedule[step]`` requests and aborting ``aborts[step]`` ids before that step.

    Returns (emitted tokens per id, final outputs per id, request tuples per id). Checks that nothing is emitted after
    a request's final output and that every request gets exactly one final output.
    """
    schedule, aborts = dict(schedule or {}), dict(aborts or {})
    tokens: dict[str, list[int]] = {}
    finals: dict[str, object] = {}
    texts: dict[str, str] = {}
    reqs: dict[str, tuple] = {}
    step = 0
    while schedule or aborts or engine.has_unfinished():
        assert step < max_steps, "the engine does not terminate"
        for prompt, adapter, sp, rid in schedule.pop(step, []):
            engine.add_request(prompt, adapter, sp, request_id=rid)
            reqs[rid] = (prompt, adapter, sp)
            tokens[rid] = []
        for rid in aborts.pop(step, []):
            assert engine.abort(rid), rid
            finals[rid] = "abort"
        for out in engine.step():
            assert out.request_id not in finals, f"output after the final one: {out}"
            tokens[out.request_id].extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if out.finished:
                finals[out.request_id] = out
        _audit(engine)
        step += 1
    assert set(finals) == set(reqs), "a request never got its final output"
    assert engine.pool.stats()["pages_kv"] == 0
    assert all(engine.store.pin_count(a) == 0 for a in ADAPTERS)
    for rid in reqs:
        if finals[rid] != "abort":
            assert tokens[rid] == engine.requests[rid].output_ids
        engine.release(rid)
    return tokens, finals, reqs, texts


# ---------------------------------------------------------------------------------------------------------------------
def test_staggered_prefill_and_decode_interleave_match_alone(eng, tiny_dir, adapter_dirs):
    """Prefills land while decodes are in flight and vice versa; seeded sampling equals the request run alone."""
    rng = np.random.default_rng(0)
    vocab = eng.cfg.vocab_size
    names = [*ADAPTERS, None]
    schedule: dict[int, list] = {}
    for i in range(10):
        sp = (SamplingParams(max_tokens=int(rng.integers(1, 12)), **GREEDY) if i % 3 == 0 else
              SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=1.3, top_k=int(rng.choice([0, 7])),
                             seed=100 + i, ignore_eos=True))
        schedule.setdefault(int(rng.integers(0, 9)), []).append((_prompt(rng, vocab), names[i % 3], sp, f"s{i}"))
    tokens, finals, reqs, _ = _drive(eng, schedule)
    for rid, (prompt, adapter, sp) in reqs.items():
        assert len(tokens[rid]) == sp.max_tokens and finals[rid].finish_reason == "length"
        assert tokens[rid] == _alone(eng, prompt, adapter, sp), rid
        if sp.temperature == 0 and rid == "s0":
            assert tokens[rid] == hf_generate(tiny_dir, prompt, sp.max_tokens, adapter_dirs.get(adapter))


@pytest.mark.parametrize("when", [1, 2, 4])
def test_abort_with_token_in_flight(eng, when):
    """Abort right after the prefill (its token in flight), after the first decode, later: nothing more is emitted,
    pages and pins are returned once, and the other requests are unaffected."""
    rng = np.random.default_rng(when)
    vocab = eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    jobs = [(_prompt(rng, vocab), a, sp, f"a{when}-{i}") for i, a in enumerate([*ADAPTERS, None])]
    tokens, finals, reqs, _ = _drive(eng, {0: jobs}, aborts={when: [f"a{when}-0"]})
    assert finals[f"a{when}-0"] == "abort"
    assert len(tokens[f"a{when}-0"]) == when - 1  # one token per step drained before the abort
    for rid, (prompt, adapter, sp_) in reqs.items():
        if rid != f"a{when}-0":
            assert tokens[rid] == _alone(eng, prompt, adapter, sp_)


def test_abort_after_the_step_that_finished_the_request(eng):
    rng = np.random.default_rng(3)
    rid = eng.add_request(_prompt(rng, eng.cfg.vocab_size), None, SamplingParams(max_tokens=1, **GREEDY))
    outs = eng.step()  # prefill dispatched; nothing read yet
    assert outs == [] and eng.has_unfinished()
    outs = eng.step()  # no plan (max_tokens reached): drains
    assert [o.finished for o in outs] == [True] and not eng.has_unfinished()
    assert not eng.abort(rid)
    eng.release(rid)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_stop_token_with_token_in_flight_is_not_overrun(eng, k):
    """The stop token is the k-th token (k=0: the prefill's); the extra token computed meanwhile is never emitted."""
    rng = np.random.default_rng(10 + k)
    vocab = eng.cfg.vocab_size
    prompt = _prompt(rng, vocab)
    free = _alone(eng, prompt, "r8-all7", SamplingParams(max_tokens=10, **GREEDY))
    stop = free[k]
    sp = SamplingParams(max_tokens=10, stop_token_ids=(stop,), **GREEDY)
    companion = SamplingParams(max_tokens=10, **GREEDY)  # keeps decode steps going after the stop
    jobs = [(prompt, "r8-all7", sp, f"t{k}"), (_prompt(rng, vocab), None, companion, f"c{k}")]
    tokens, finals, reqs, _ = _drive(eng, {0: jobs})
    assert tokens[f"t{k}"] == free[: free.index(stop) + 1]
    assert finals[f"t{k}"].finish_reason == "stop"
    assert len(tokens[f"c{k}"]) == 10


def test_eos_with_token_in_flight(eng):
    rng = np.random.default_rng(21)
    prompt = _prompt(rng, eng.cfg.vocab_size)
    free = _alone(eng, prompt, None, SamplingParams(max_tokens=10, **GREEDY))
    try:
        eng.cfg = dataclasses.replace(eos_cfg := eng.cfg, eos_token_id=(free[3],))
        tokens, finals, _, _ = _drive(eng, {0: [(prompt, None, SamplingParams(max_tokens=10, temperature=0.0),
                                                 "eos")]})
    finally:
        eng.cfg = eos_cfg
    assert tokens["eos"] == free[: free.index(free[3]) + 1]
    assert finals["eos"].finish_reason == "stop"


@pytest.mark.parametrize("k", [0, 4])
def test_stop_string_with_token_in_flight(eng, k):
    rng = np.random.default_rng(30 + k)
    prompt = _prompt(rng, eng.cfg.vocab_size)
    free = _alone(eng, prompt, "r4-qkvo", SamplingParams(max_tokens=10, **GREEDY))
    cut = free.index(free[k])
    sp = SamplingParams(max_tokens=10, stop=(f"<{free[k]}>",), **GREEDY)
    tokens, finals, _, texts = _drive(eng, {0: [(prompt, "r4-qkvo", sp, f"ss{k}")]})
    assert tokens[f"ss{k}"] == free[: cut + 1]
    assert texts[f"ss{k}"] == "".join(f"<{t}>" for t in free[:cut])
    assert finals[f"ss{k}"].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_context_limit_exactly_reached(eng, max_tokens):
    """prompt + max_tokens == max_model_len, alongside a short request: exactly max_tokens, reason "length"."""
    rng = np.random.default_rng(40 + max_tokens)
    vocab = eng.cfg.vocab_size
    long_prompt = _prompt(rng, vocab, BIG.max_model_len - max_tokens, BIG.max_model_len - max_tokens + 1)
    sp = SamplingParams(max_tokens=max_tokens, **GREEDY)
    jobs = [(long_prompt, "r4-qkvo", sp, f"L{max_tokens}"),
            (_prompt(rng, vocab), None, SamplingParams(max_tokens=7, **GREEDY), f"S{max_tokens}")]
    tokens, finals, reqs, _ = _drive(eng, {0: jobs[:1], 1: jobs[1:]})
    assert len(tokens[f"L{max_tokens}"]) == max_tokens
    assert finals[f"L{max_tokens}"].finish_reason == "length"
    for rid, (prompt, adapter, sp_) in reqs.items():
        assert tokens[rid] == _alone(eng, prompt, adapter, sp_)
    with pytest.raises(ValueError):
        eng.add_request(long_prompt + [5], None, sp)


def test_preemption_with_tokens_in_flight_keeps_seeded_tokens(tight, eng):
    """A tight pool preempts sequences whose last token is still on the device: their recompute prefill must see it,
    and seeded sampling must give the very tokens of the request run alone on a roomy engine."""
    rng = np.random.default_rng(50)
    vocab = tight.cfg.vocab_size
    victims_in_flight = []
    preempt = tight.scheduler.preempt

    def spy(seq):
        victims_in_flight.append(seq.inflight >= 0)
        preempt(seq)

    tight.scheduler.preempt = spy
    try:
        jobs = []
        for i in range(6):
            sp = SamplingParams(max_tokens=int(rng.integers(18, 26)), temperature=1.1, top_p=0.95, seed=500 + i,
                                ignore_eos=True)
            if i == 4:  # one stops mid-way (on a token it would otherwise sample)
                alone = _alone(eng, p := _prompt(rng, vocab, 8, 14), None, sp)
                sp = SamplingParams(max_tokens=sp.max_tokens, temperature=1.1, top_p=0.95, seed=500 + i,
                                    ignore_eos=True, stop_token_ids=(alone[12],))
                jobs.append((p, None, sp, f"p{i}"))
                continue
            jobs.append((_prompt(rng, vocab, 8, 14), ["r4-qkvo", None][i % 2], sp, f"p{i}"))
        tokens, finals, reqs, _ = _drive(tight, {0: jobs[:4], 2: jobs[4:]})
    finally:
        del tight.scheduler.preempt
    assert tight.scheduler.num_preemptions > 0 and any(victims_in_flight)
    for rid, (prompt, adapter, sp) in reqs.items():
        assert tokens[rid] == _alone(eng, prompt, adapter, sp), rid


def test_preemption_greedy_matches_peft(tight, tiny_dir, adapter_dirs):
    rng = np.random.default_rng(60)
    vocab = tight.cfg.vocab_size
    before = tight.scheduler.num_preemptions
    jobs = [(_prompt(rng, vocab, 10, 16), ["r4-qkvo", None][i % 2], SamplingParams(max_tokens=24, **GREEDY), f"g{i}")
            for i in range(5)]
    tokens, _, reqs, _ = _drive(tight, {0: jobs})
    assert tight.scheduler.num_preemptions > before
    for rid, (prompt, adapter, sp) in reqs.items():
        assert tokens[rid] == hf_generate(tiny_dir, prompt, sp.max_tokens, adapter_dirs.get(adapter)), rid


def test_stream_and_generate_agree(eng):
    rng = np.random.default_rng(70)
    vocab = eng.cfg.vocab_size
    prompt = _prompt(rng, vocab)
    sp = SamplingParams(max_tokens=9, temperature=1.0, seed=3, ignore_eos=True)
    other = eng.add_request(_prompt(rng, vocab), "r8-all7", SamplingParams(max_tokens=30, **GREEDY))
    eng.step()  # the other request's prefill is in flight when the stream starts
    outs = list(eng.stream(prompt, "r4-qkvo", sp))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    streamed = [t for o in outs for t in o.new_token_ids]
    assert streamed == _alone(eng, prompt, "r4-qkvo", sp)  # generate drives the other request to its end too
    assert eng.requests[other].status == Status.FINISHED and len(eng.requests[other].output_ids) == 30
    eng.release(other)
    assert not eng.has_unfinished() and eng.pool.stats()["pages_kv"] == 0
    assert eng.generate([prompt, prompt], ["r4-qkvo", None], sp)[0] == streamed


def test_batch_size_not_a_power_of_two(tiny_dir, adapter_dirs):
    ecfg = EngineConfig(max_batch_size=6, max_prefill_tokens=64, max_prefill_seqs=2, max_model_len=32, page_size=4,
                        max_lora_rank=32, max_loras=2, num_pages=128, dtype="float32", backend="reference")
    engine = _make(tiny_dir, adapter_dirs, ecfg)
    rng = np.random.default_rng(80)
    prompts = [_prompt(rng, engine.cfg.vocab_size) for _ in range(6)]
    outs = engine.generate(prompts, None, SamplingParams(max_tokens=4, **GREEDY))
    assert [len(o) for o in outs] == [4] * 6


def test_raising_callback_does_not_corrupt_other_requests(tiny_dir, adapter_dirs):
    eng = _make(tiny_dir, adapter_dirs, BIG)  # its own engine: the failure leaves stale state behind
    rng = np.random.default_rng(90)
    vocab = eng.cfg.vocab_size
    sp = SamplingParams(max_tokens=8, **GREEDY)
    prompts = [_prompt(rng, vocab) for _ in range(3)]
    expected = [_alone(eng, p, None, sp) for p in prompts]
    calls = []

    def flaky(out):
        calls.append(out)
        if len(calls) == 2:
            raise RuntimeError("client went away")

    rids = [eng.add_request(p, None, sp, on_output=flaky if i == 0 else None) for i, p in enumerate(prompts)]
    raised = 0
    for _ in range(100):
        if not eng.has_unfinished():
            break
        try:
            eng.step()
        except RuntimeError:
            raised += 1
    assert raised == 1
    got = [eng.requests.pop(r).output_ids for r in rids]
    assert got[1:] == expected[1:]


def _serve_to_the_end(eng, rids, expected) -> None:
    """Step until idle, every step error-free and audited; each request got its tokens alone, nothing is left held."""
    for _ in range(100):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            assert out.error is None, out.error
        _audit(eng)
    assert [eng.requests[r].output_ids for r in rids] == expected
    assert eng.pool.stats()["pages_kv"] == 0 and all(eng.store.pin_count(a) == 0 for a in ADAPTERS)


def test_a_device_error_mid_admission_leaves_no_pages_or_pins(tiny_dir, adapter_dirs):
    """The device fails the second request's adapter load while the first is already taken into the prefill: the
    step raises, both wait again holding nothing (the first once kept its pages and a pin that no abort released),
    and the next steps serve both as if alone."""
    eng = _make(tiny_dir, adapter_dirs, BIG)  # its own engine: its pool load is made to fail
    rng = np.random.default_rng()
    sp = SamplingParams(max_tokens=5, **GREEDY)
    prompts = [_prompt(rng, eng.cfg.vocab_size) for _ in ADAPTERS]
    expected = [_alone(eng, p, a, sp) for p, a in zip(prompts, ADAPTERS, strict=True)]
    eng.store._evict("r8-all7")  # "r4-qkvo" stays resident and unpinned; "r8-all7" must be loaded again
    real, failed = eng.pool.load_adapter, []

    def load_failing_once(name, *args, **kw):
        if name == "r8-all7" and not failed:
            failed.append(name)
            raise RuntimeError("RESOURCE_EXHAUSTED (simulated)")
        return real(name, *args, **kw)

    eng.pool.load_adapter = load_failing_once
    rids = [eng.add_request(p, a, sp) for p, a in zip(prompts, ADAPTERS, strict=True)]
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        eng.step()
    assert failed and all(eng.requests[r].status == Status.WAITING for r in rids)
    _audit(eng)  # no KV pages held by waiting requests, no pins without running ones
    assert eng.pool.stats()["pages_kv"] == 0
    _serve_to_the_end(eng, rids, expected)


@pytest.mark.parametrize("fails", ["prefill", "logprobs"])
def test_a_prefill_that_raises_puts_its_batch_back_to_wait(tiny_dir, adapter_dirs, fails, monkeypatch):
    """The prefill step itself fails (the device, or what is built right after it): its sequences were admitted,
    so they went on running with no prompt K/V and, stepped again, decoded wrong tokens with no error. They wait
    again holding nothing, and the next steps serve them as if alone (a decode already in flight is kept)."""
    eng = _make(tiny_dir, adapter_dirs, BIG)  # its own engine: its runner is made to fail
    rng = np.random.default_rng()
    sp = SamplingParams(max_tokens=6, **GREEDY)
    prompts = [_prompt(rng, eng.cfg.vocab_size) for _ in range(3)]
    adapters = [ADAPTERS[0], None, ADAPTERS[1]]
    expected = [_alone(eng, p, a, sp) for p, a in zip(prompts, adapters, strict=True)]
    first = eng.add_request(prompts[0], adapters[0], sp)  # running, a decode in flight when the prefill fails
    eng.step()
    eng.step()
    calls = []

    def failing_once(real):
        def call(*args, **kw):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("INTERNAL: the prefill failed (simulated)")
            return real(*args, **kw)
        return call

    if fails == "prefill":  # the device step
        monkeypatch.setattr(eng.runner, "prefill", failing_once(eng.runner.prefill))
    else:  # what is built right after it was queued
        from slora_jax.engine import engine as engine_module

        monkeypatch.setattr(engine_module.StepLogprobs, "of_step", failing_once(engine_module.StepLogprobs.of_step))
    rids = [first] + [eng.add_request(p, a, sp) for p, a in zip(prompts[1:], adapters[1:], strict=True)]
    with pytest.raises(RuntimeError, match="prefill failed"):
        eng.step()
    assert [eng.requests[r].status for r in rids[1:]] == [Status.WAITING] * 2
    assert list(eng.scheduler.waiting)[:2] == [eng.requests[r] for r in rids[1:]]  # in order, at the head
    _audit(eng)
    _serve_to_the_end(eng, rids, expected)


def test_a_raising_callback_leaves_no_other_failed_request_unfinished(tiny_dir, adapter_dirs):
    """Requests the engine ends unserved (here: past their first-token deadline under early abort) are each ended
    even when the first one's callback raises; the rest were once left out of the queue with no final output."""
    eng = _make(tiny_dir, adapter_dirs, dataclasses.replace(BIG, early_abort=True))
    rng = np.random.default_rng()
    got = []

    def raising(out):
        got.append(out)
        raise RuntimeError("client went away")

    sp = SamplingParams(max_tokens=4, **GREEDY)
    rids = [eng.add_request(_prompt(rng, eng.cfg.vocab_size), None, sp, first_token_slo_s=1e-4,
                            on_output=raising if i == 0 else got.append) for i in range(3)]
    time.sleep(0.01)  # every deadline passes before the next schedule
    with pytest.raises(RuntimeError, match="client went away"):
        eng.step()
    assert sorted(out.request_id for out in got) == sorted(rids)
    assert all(out.finished and out.error_kind == "deadline" for out in got)
    assert all(eng.requests[r].status == Status.FINISHED for r in rids) and not eng.has_unfinished()
    _audit(eng)


def test_a_failed_request_aborted_before_its_failure_was_reported_ends_once(tiny_dir, adapter_dirs, monkeypatch):
    """Early abort takes a request past its deadline out of the queue, then admission raises (a device error): the
    step raises before the request's failure is reported. The server aborts it (its one final output); the next
    step once ended it again. A request waiting beside it is served as if alone."""
    eng = _make(tiny_dir, adapter_dirs, dataclasses.replace(BIG, early_abort=True))
    rng = np.random.default_rng()
    sp = SamplingParams(max_tokens=5, **GREEDY)
    late_prompt, prompt = _prompt(rng, eng.cfg.vocab_size), _prompt(rng, eng.cfg.vocab_size)
    expected = _alone(eng, prompt, ADAPTERS[1], sp)
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
    _serve_to_the_end(eng, [other], [expected])  # every output error-free: no second end of the late one
    assert len(got) == 1, got


class _FailedOnDevice:
    """A step's output whose computation failed on the device: reading it raises (as a jax.Array does)."""

    def __array__(self, *args, **kwargs):
        raise RuntimeError("INTERNAL: the step failed on the device (simulated)")


def test_a_step_whose_batch_was_aborted_is_not_read_back(tiny_dir, adapter_dirs, monkeypatch):
    """A decode fails on the device; the step after it (queued behind it, fed its tokens) fails too. Reading the
    first back raises; the server aborts the running batch. The second, whose every request is now aborted, must not
    be read back: its error would fail the next step, and with it a new request that has nothing to do with it."""
    eng = _make(tiny_dir, adapter_dirs, BIG)  # its own engine: its runner is made to fail
    rng = np.random.default_rng()
    sp = SamplingParams(max_tokens=8, **GREEDY)
    hurt_prompt, prompt = _prompt(rng, eng.cfg.vocab_size), _prompt(rng, eng.cfg.vocab_size)
    expected = _alone(eng, prompt, ADAPTERS[1], sp)
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
    _serve_to_the_end(eng, [fresh], [expected])


def test_min_tokens_beyond_what_fits_is_refused_naming_it(eng):
    """With max_tokens left to the engine (as many as fit), a min_tokens above that is refused up front; a huge one
    once reached the step's inputs and failed there with an OverflowError."""
    rng = np.random.default_rng()
    prompt = _prompt(rng, eng.cfg.vocab_size)
    room = eng.ecfg.max_model_len - len(prompt)
    for min_tokens in (room + 1, 10**400):
        with pytest.raises(RequestRejected, match="min_tokens") as e:
            eng.add_request(prompt, None, SamplingParams(max_tokens=None, min_tokens=min_tokens))
        assert e.value.param == "min_tokens"
    out = eng.generate([prompt], None, SamplingParams(max_tokens=None, min_tokens=room, **GREEDY))[0]
    assert len(out) == room


def test_abandoned_stream_releases_its_request(eng):
    rng = np.random.default_rng(95)
    gen = eng.stream(_prompt(rng, eng.cfg.vocab_size), "r4-qkvo", SamplingParams(max_tokens=20, **GREEDY))
    next(gen)
    gen.close()
    try:
        assert not eng.has_unfinished()
        assert eng.pool.stats()["pages_kv"] == 0 and eng.store.pin_count("r4-qkvo") == 0
    finally:
        for rid in [r for r, s in eng.requests.items() if s.status != Status.FINISHED]:
            eng.abort(rid)
            eng.release(rid)


def test_seeds_differing_above_32_bits_differ(eng):
    rng = np.random.default_rng(96)
    prompt = _prompt(rng, eng.cfg.vocab_size)
    a, b = (_alone(eng, prompt, None, SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True))
            for s in (5, 5 + 2**32))
    assert a != b


def test_staging_area_smaller_than_the_prefill_head_is_refused():
    from slora_jax.engine.config import EngineConfig

    base = dict(num_pages=64, max_prefill_seqs=16, max_prefill_tokens=2048)
    EngineConfig(**base, max_staged_adapters=0).validate()  # off
    EngineConfig(**base, max_staged_adapters=16).validate()
    with pytest.raises(ValueError, match="max_staged_adapters"):
        EngineConfig(**base, max_staged_adapters=8).validate()


def test_default_pool_is_sized_from_memory_free_after_the_weights():
    from slora_jax.engine.config import CPU_POOL_BYTES, POOL_FRACTION

    rng = np.random.default_rng()
    limit, used = int(rng.integers(40, 140)) << 30, int(rng.integers(1, 30)) << 30
    cfg = EngineConfig(max_batch_size=4, max_prefill_tokens=64, max_model_len=64)
    assert cfg.with_pool_size({"bytes_limit": limit, "bytes_in_use": used}).pool_bytes == int(POOL_FRACTION *
                                                                                            (limit - used))
    assert cfg.with_pool_size(None).pool_bytes == CPU_POOL_BYTES  # the CPU reports no limit
    given = dataclasses.replace(cfg, pool_bytes=1 << 20)
    assert given.with_pool_size({"bytes_limit": limit, "bytes_in_use": used}) is given  # an explicit size wins
