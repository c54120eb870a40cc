"""``admit_while_loading``: a request whose adapter is still being read does not stall the engine thread while other
requests can run (they are admitted and decode meanwhile); it keeps its place and, once its adapter is in, gets the
tokens it gets with the flag off. With nothing else to run the engine waits for the read as before."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
from store_helpers import GatedSource, logged_rng

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.sampling import SamplingParams
from slora_jax.lora.peft import load_peft_adapter

ECFG = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=48, page_size=4,
                    max_lora_rank=32, max_loras=3, num_pages=256, dtype="float32", backend="reference",
                    admit_while_loading=True)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompt(rng, vocab) -> list[int]:
    return rng.integers(3, vocab, size=int(rng.integers(4, 12))).tolist()


def _engine(tiny_dir, **changes) -> Engine:
    return Engine.from_model_dir(tiny_dir, dataclasses.replace(ECFG, **changes), progress=False)


def _collect(outputs, got: dict) -> None:
    for out in outputs:
        assert out.error is None, out.error
        got.setdefault(out.request_id, []).extend(out.new_token_ids)


@pytest.fixture
def gate():
    gate = threading.Event()
    safety = threading.Timer(60, gate.set)  # a blocking admission must not hang the run: it fails the asserts instead
    safety.start()
    yield gate
    safety.cancel()
    gate.set()


def test_other_requests_run_while_an_adapter_is_read_and_its_tokens_are_unchanged(tiny_dir, tiny_cfg,
                                                                                   adapter_dirs, gate):
    rng = logged_rng("admit while loading")
    adapter = load_peft_adapter(adapter_dirs["r4-qkvo"], tiny_cfg, "slow")
    eng = _engine(tiny_dir)
    eng.register_adapter("slow", GatedSource(adapter, gate))
    got: dict[str, list[int]] = {}
    first = eng.add_request(_prompt(rng, tiny_cfg.vocab_size), None, SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(3):
        _collect(eng.step(), got)
    slow_prompt = _prompt(rng, tiny_cfg.vocab_size)
    slow = eng.add_request(slow_prompt, "slow", SamplingParams(max_tokens=6, **GREEDY))
    behind = eng.add_request(_prompt(rng, tiny_cfg.vocab_size), None, SamplingParams(max_tokens=5, **GREEDY))
    for _ in range(12):  # each step returns: admission passed over the slow request and took the one behind it
        _collect(eng.step(), got)
        assert not gate.is_set(), "a step waited for the adapter's read"
    assert len(got.get(behind, [])) == 5 and not got.get(slow) and len(got[first]) > 5
    assert eng.store.host.stats()["host_misses"] >= 1  # its read was started (and waits on the gate)
    gate.set()
    while eng.has_unfinished():
        _collect(eng.step(), got)
    assert len(got[slow]) == 6 and len(got[first]) == 30

    ref = _engine(tiny_dir, admit_while_loading=False)
    ref.register_adapter("slow", adapter_dirs["r4-qkvo"])
    alone = ref.add_request(slow_prompt, "slow", SamplingParams(max_tokens=6, **GREEDY))
    want: dict[str, list[int]] = {}
    while ref.has_unfinished():
        _collect(ref.step(), want)
    assert got[slow] == want[alone]


def test_with_nothing_else_to_run_the_engine_waits_for_the_read(tiny_dir, tiny_cfg, adapter_dirs, gate):
    rng = np.random.default_rng()
    eng = _engine(tiny_dir)
    eng.register_adapter("slow", GatedSource(load_peft_adapter(adapter_dirs["r4-qkvo"], tiny_cfg, "slow"), gate))
    slow = eng.add_request(_prompt(rng, tiny_cfg.vocab_size), "slow", SamplingParams(max_tokens=3, **GREEDY))
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    eng.step()  # blocks on the read, as with the flag off, instead of returning with nothing to do
    assert gate.is_set() and eng.last_plan is not None and eng.last_plan.kind == "prefill"
    assert [s.request_id for s in eng.last_plan.seqs] == [slow]
