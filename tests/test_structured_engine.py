"""Structured output in the engine: grammar masks reach the in-step sampler through the pipelined decode.

Greedy constrained output must equal an independent reference: HF transformers' logits (fp32) with the grammar's
mask applied by numpy, argmax, token by token. Sampled outputs (random weights: junk unless constrained) must
validate with ``jsonschema``; requests without a grammar must get exactly the tokens they get alone.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from hf_reference import hf_model

from slora_jax.engine.config import EngineConfig
from slora_jax.engine.engine import Engine
from slora_jax.engine.grammar import GrammarCompiler, GrammarSpec, allowed_tokens
from slora_jax.engine.sampling import SamplingParams
from slora_jax.tools import synth
from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

ECFG = EngineConfig(max_batch_size=8, max_prefill_tokens=64, max_prefill_seqs=4, max_model_len=64, page_size=4,
                    max_lora_rank=8, max_loras=2, num_pages=240, dtype="float32", backend="reference",
                    decode_lora_variants=False, min_decode_bucket=8, min_prefill_bucket=64)  # 2 compiles
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": -50,
                                                                           "maximum": 50},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "bb", "ccc"]}}}}
SPECS = {"schema": GrammarSpec("json_schema", SCHEMA), "regex": GrammarSpec("regex", r"[a-z]{1,6}( [0-9]{2})?"),
         "choice": GrammarSpec("choice", ["red", "green", "blue sky"])}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = synth.write_model(tmp_path_factory.mktemp("structured") / "model", "tiny", seed=11)
    write_tokenizer(out, 512)
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    eng = Engine.from_model_dir(model_dir, ECFG, tokenizer=tokenizer, progress=False)
    eng.warmup(progress=False)
    return eng


@pytest.fixture(scope="module")
def compiler(engine, tokenizer):
    return GrammarCompiler(tokenizer, engine.cfg.vocab_size, engine.cfg.eos_token_id)


def _prompt(rng, lo=3, hi=12):
    return [int(t) for t in rng.integers(3, 500, size=int(rng.integers(lo, hi)))]


def _run(engine, jobs, between_steps=None, finals=None):
    """jobs: (prompt, sampling, grammar or None); returns each request's Sequence after the engine drained.
    ``between_steps(seqs)`` runs after every step; ``finals`` collects each request's last output."""
    on_output = None if finals is None else (lambda out: finals.__setitem__(out.request_id, out))
    rids = [engine.add_request(p, None, s, grammar=g, on_output=on_output) for p, s, g in jobs]
    while engine.has_unfinished():
        engine.step()
        if between_steps is not None:
            between_steps([engine.requests[r] for r in rids])
    return [engine.requests.pop(r) for r in rids]


def _hf_constrained_greedy(model, compiler, spec, prompt, max_tokens, eos) -> list[int]:
    """Greedy decoding with HF logits and the grammar's mask applied on the host (the reference)."""
    m, out = compiler.compile(spec), []
    with torch.no_grad():
        while len(out) < max_tokens and not m.is_done():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].numpy()
            allowed = allowed_tokens(m.mask(), len(logits))
            out.append(int(allowed[np.argmax(logits[allowed])]))
            assert m.accept(out[-1])
            if out[-1] in eos:
                break
    return out


def test_greedy_constrained_output_equals_hf_with_the_mask(engine, compiler, model_dir):
    rng = np.random.default_rng()
    jobs, refs = [], []
    model = hf_model(model_dir)
    for name in [*SPECS, *SPECS]:
        prompt = _prompt(rng)
        jobs.append((prompt, SamplingParams(max_tokens=40, temperature=0.0), compiler.compile(SPECS[name])))
        refs.append(_hf_constrained_greedy(model, compiler, SPECS[name], prompt, 40, engine.cfg.eos_token_id))
        jobs.append((_prompt(rng), SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=0.0), None))
    seqs = _run(engine, jobs)
    for seq, ref in zip(seqs[::2], refs, strict=True):
        assert seq.output_ids == ref
        assert seq.finish_reason == ("stop" if len(ref) < 40 else "length")
    assert engine.compiles_since_warmup() == 0


def test_sampled_outputs_validate_and_plain_rows_are_unchanged(engine, compiler, tokenizer):
    rng = np.random.default_rng()
    plain = [(_prompt(rng), SamplingParams(max_tokens=int(rng.integers(5, 40)), temperature=1.0,
                                           seed=int(rng.integers(2**31))), None) for _ in range(6)]
    alone = _run(engine, plain)
    shared = compiler.compile(SPECS["schema"])  # each request follows its own copy
    guided = [(_prompt(rng), SamplingParams(max_tokens=50, temperature=1.0), shared) for _ in range(10)]
    mixed = _run(engine, [j for pair in zip(guided, plain + [None] * 4, strict=True) for j in pair if j])
    plain_again = [s for s in mixed if s.grammar is None]
    assert [s.output_ids for s in plain_again] == [s.output_ids for s in alone]
    assert shared.accepted == 0
    for seq in mixed:
        if seq.grammar is not None:
            assert seq.finish_reason == "stop", tokenizer.decode(seq.output_ids)
            jsonschema.validate(json.loads(tokenizer.decode(seq.output_ids, skip_special_tokens=True)), SCHEMA)
    assert engine.compiles_since_warmup() == 0


def test_max_tokens_cut_is_length_and_a_valid_prefix(engine, compiler, tokenizer):
    rng = np.random.default_rng()
    seqs = _run(engine, [(_prompt(rng), SamplingParams(max_tokens=4, temperature=1.0),
                          compiler.compile(SPECS["schema"])) for _ in range(3)])
    for seq in seqs:
        assert seq.finish_reason == "length" and len(seq.output_ids) == 4
        fresh = compiler.compile(SPECS["schema"])
        assert fresh.catch_up(seq.output_ids) and not fresh.is_done()
        text = tokenizer.decode(seq.output_ids)
        assert text.startswith('{"name":"') or '{"name":"'.startswith(text)


def test_grammar_rows_survive_preemption(engine, compiler, tokenizer):
    """Grammar rows preempted mid-output (one token still on the device) are recomputed and finish valid."""
    rng = np.random.default_rng()
    preempted = set()

    def preempt_some(seqs):
        for seq in seqs:
            if (seq.request_id not in preempted and len(preempted) < 3 and seq in engine.scheduler.running
                    and seq.inflight >= 0 and len(seq.output_ids) >= 2 + len(preempted) * 3):
                engine.scheduler.preempt(seq)  # what the scheduler does when the pool runs dry
                preempted.add(seq.request_id)

    before = engine.scheduler.num_preemptions
    seqs = _run(engine, [(_prompt(rng), SamplingParams(max_tokens=50, temperature=1.0),
                          compiler.compile(SPECS["schema"])) for _ in range(6)], preempt_some)
    assert len(preempted) == 3 and engine.scheduler.num_preemptions == before + 3
    for seq in seqs:
        jsonschema.validate(json.loads(tokenizer.decode(seq.output_ids, skip_special_tokens=True)), SCHEMA)
    assert engine.pool.stats()["pages_kv"] == 0 and engine.compiles_since_warmup() == 0


class _BreaksAfter:
    """A matcher that refuses its n-th token (a grammar that hits a parser limit mid-output)."""

    def __init__(self, inner, n):
        self.inner, self.n, self.error = inner, n, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fork(self):
        return self

    def catch_up(self, generated):
        if len(generated) >= self.n:
            self.error = "parser limit"
            return False
        return self.inner.catch_up(generated)


def test_a_broken_grammar_ends_only_its_request(engine, compiler):
    rng = np.random.default_rng()
    bad, finals = _BreaksAfter(compiler.compile(SPECS["schema"]), 3), {}
    seqs = _run(engine, [(_prompt(rng), SamplingParams(max_tokens=50, temperature=1.0), bad),
                         (_prompt(rng), SamplingParams(max_tokens=50, temperature=1.0),
                          compiler.compile(SPECS["schema"])),
                         # ignore_eos: the neighbour's 10 tokens must not depend on a sample drawing EOS
                         (_prompt(rng), SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True), None)],
                   finals=finals)
    out = finals[seqs[0].request_id]
    assert out.finish_reason == "error" and out.error_kind == "request" and "parser limit" in out.error
    assert len(seqs[0].output_ids) == 3
    assert seqs[1].finish_reason == "stop" and len(seqs[2].output_ids) == 10
