"""Grammar compile and per-request matchers (engine/grammar.py) on the demo's byte-level tokenizer.

Random walks sample uniformly among the tokens each mask allows (fresh randomness per check) until the matcher says
done; the decoded text must then satisfy an independent reference: ``jsonschema`` for schemas, ``re.fullmatch`` for
regexes, membership for choices. The first mask of a choice grammar is checked token by token against the
tokenizer's own decoding.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from slora_jax.engine.grammar import (
    CACHED_GRAMMARS,
    MAX_CHOICES,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    allowed_tokens,
    fill_masks,
    ll_tokenizer,
)
from slora_jax.engine.grammar_depth import MAX_DEPTH
from slora_jax.engine.sampling import mask_words
from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer

VOCAB = 512
EOS = 2

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3},
                                      "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
     "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


def _walk(matcher, rng, max_tokens: int = 300) -> list[int]:
    """Sample uniformly among allowed tokens until the grammar is done (or EOS is drawn)."""
    ids = []
    while not matcher.is_done() and len(ids) < max_tokens:
        allowed = allowed_tokens(matcher.mask(), VOCAB)
        assert allowed.size, "a live grammar must allow some token"
        token = int(rng.choice(allowed))
        assert matcher.accept(token), matcher.error
        ids.append(token)
        if token == EOS:
            break
    assert matcher.is_done(), f"not done after {max_tokens} tokens"
    return ids


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enum-array", "numbers"])
def test_random_walks_through_a_schema_validate(compiler, tokenizer, schema):
    rng = np.random.default_rng()
    for _ in range(20):
        ids = _walk(compiler.compile(GrammarSpec("json_schema", schema)), rng)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_walks_match(compiler, tokenizer):
    rng = np.random.default_rng()
    pattern = r"(yes|no)-[0-9]{2,4}"
    choices = ["apple", "banana pie", "cherry"]
    for _ in range(20):
        text = tokenizer.decode(_walk(compiler.compile(GrammarSpec("regex", pattern)), rng), skip_special_tokens=True)
        assert re.fullmatch(pattern, text), text
        text = tokenizer.decode(_walk(compiler.compile(GrammarSpec("choice", choices)), rng), skip_special_tokens=True)
        assert text in choices


def test_json_object_walk_is_an_object_or_a_valid_prefix(compiler, tokenizer):
    rng = np.random.default_rng()
    for _ in range(10):
        m = compiler.compile(GrammarSpec("json_object"))
        ids = []
        while not m.is_done() and len(ids) < 60:
            token = int(rng.choice(allowed_tokens(m.mask(), VOCAB)))
            assert m.accept(token)
            ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert text.startswith("{")
        if m.is_done():
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("spec", [
    GrammarSpec("choice", [f"c{i}" for i in range(MAX_CHOICES)]),  # the most a choice may have
    GrammarSpec("json_schema", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}),
], ids=["choice-max", "600-optional-properties"])
def test_wide_grammars_that_compile_also_run(compiler, tokenizer, spec):
    """A grammar that passes the compile check must not fail on a later token: llguidance's items-per-row limit
    (its default 2000) once let these compile, then fail after the first token (a 200 with an error event)."""
    rng = np.random.default_rng(5)
    for _ in range(3):
        m = compiler.compile(spec)
        for _ in range(6):
            allowed = allowed_tokens(m.mask(), VOCAB)
            assert m.error is None and allowed.size, m.error
            if m.is_done():
                break
            assert m.accept(int(rng.choice(allowed[allowed != EOS] if (allowed != EOS).any() else allowed))), m.error


def test_first_choice_mask_is_every_token_that_starts_a_choice(compiler, tokenizer):
    choices = ["apple", "banana pie", "cherry"]
    mask = compiler.compile(GrammarSpec("choice", choices)).mask()
    want = [t for t in range(VOCAB) if t not in tokenizer.all_special_ids
            and (piece := tokenizer.decode([t])) and any(c.startswith(piece) for c in choices)]
    assert allowed_tokens(mask, VOCAB).tolist() == want


def test_eos_only_where_the_grammar_accepts(compiler, tokenizer):
    m = compiler.compile(GrammarSpec("regex", "a+"))
    assert EOS not in allowed_tokens(m.mask(), VOCAB)  # nothing matched yet
    a = tokenizer.encode("a", add_special_tokens=False)
    assert m.catch_up(a) and m.is_accepting() and not m.is_done()
    assert EOS in allowed_tokens(m.mask(), VOCAB)
    assert m.accept(EOS) and m.is_done()
    m = compiler.compile(GrammarSpec("regex", "ab"))
    assert m.catch_up(tokenizer.encode("ab", add_special_tokens=False)) and m.is_done()  # nothing can follow


def test_catch_up_accepts_each_token_once(compiler, tokenizer):
    ids = tokenizer.encode('{"name":"x","age":7}', add_special_tokens=False)
    m = compiler.compile(GrammarSpec("json_schema", SCHEMAS[0]))
    assert m.catch_up(ids[:3]) and m.catch_up(ids[:3]) and m.accepted == 3
    assert m.catch_up(ids) and m.accepted == len(ids) and m.is_done()


def test_a_token_outside_the_grammar_breaks_the_matcher(compiler, tokenizer):
    m = compiler.compile(GrammarSpec("regex", "[0-9]+"))
    assert not m.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert m.error and not m.is_done() and not m.catch_up([5, 6])
    assert allowed_tokens(m.mask(), VOCAB).tolist() == [EOS]  # a broken row can only end


@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("regex", "(("), "unclosed group"),
    (GrammarSpec("json_schema", {"type": "objectx"}), "objectx"),
    (GrammarSpec("json_schema", '{"type": '), "not valid JSON"),
    (GrammarSpec("json_schema", [1, 2]), "JSON object"),
    (GrammarSpec("json_schema", {"type": "integer", "minimum": "a"}), "minimum"),
    (GrammarSpec("choice", []), "non-empty list"),
    (GrammarSpec("choice", ["a", 3]), "non-empty list"),
    (GrammarSpec("grammar", "start: foo"), "foo"),
    (GrammarSpec("regex", "\ud800"), "surrogates"),
    (GrammarSpec("choice", ["c"] * (MAX_CHOICES + 1)), f"at most {MAX_CHOICES}"),
    (GrammarSpec("json_schema", {"$ref": "#"}), "cannot compile"),  # fails at its first mask
])
def test_bad_grammars_raise_with_the_reason(compiler, spec, reason):
    with pytest.raises(GrammarError, match=reason):
        compiler.compile(spec)


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": defs | {f"d{n}": {"type": "string"}}}


def _rule_chain(n: int, gbnf: bool = False) -> str:
    eq = " ::= " if gbnf else ": "
    head = "root" if gbnf else "start"
    return f"{head}{eq}r0\n" + "".join(f"r{i}{eq}r{i + 1}\n" for i in range(n)) + f'r{n}{eq}"a"\n'


def _nested(leaf: dict, n: int) -> dict:
    for _ in range(n):
        leaf = {"a": leaf}
    return leaf


@pytest.mark.parametrize("spec", [
    GrammarSpec("json_schema", _ref_chain(1000)),  # these four overflowed the compiler's stack: the server died
    GrammarSpec("json_schema", json.dumps(_ref_chain(5000))),
    GrammarSpec("grammar", _rule_chain(3000)),
    GrammarSpec("grammar", _rule_chain(10000, gbnf=True)),
    # json.loads' RecursionError was a 500 (Python 3.11); 3.12's parser takes 5000 levels, and the depth check refuses
    GrammarSpec("json_schema", '{"a": ' * 5000 + "1" + "}" * 5000),
    GrammarSpec("json_schema", _nested({"type": "string"}, 5000)),  # what 3.12.3's json.loads returns for it
    GrammarSpec("grammar", "start: %json " + json.dumps(_ref_chain(1000))),  # a schema inlined in Lark
], ids=["ref-chain", "ref-chain-text", "lark-rules", "gbnf-rules", "nested-text", "nested-object", "lark-inline-json"])
def test_grammars_nested_too_deep_are_refused_before_compiling(compiler, spec):
    with pytest.raises(GrammarError, match=f"more than {MAX_DEPTH} levels"):
        compiler.compile(spec)


_UNCHECKED_DEEP_COMPILE = """
import pathlib, sys, tempfile
from slora_jax.engine import grammar as G
G.check_schema_depth = G.check_grammar_depth = lambda _: None  # a form the depth check would miss
from slora_jax.tools.tokenizer import load_tokenizer, write_tokenizer
from tests.test_grammar import EOS, VOCAB, _ref_chain, _rule_chain
tok = load_tokenizer(write_tokenizer(pathlib.Path(tempfile.mkdtemp()), VOCAB))
compiler = G.GrammarCompiler(tok, VOCAB, (EOS,))
compiler.compile(G.GrammarSpec("json_schema", _ref_chain(1000)))
compiler.compile(G.GrammarSpec("grammar", _rule_chain(int(sys.argv[1]))))
print("compiled", compiler.compiles)
"""


def test_a_grammar_past_the_depth_check_compiles_on_a_deep_stack_instead_of_killing_the_server(tmp_path):
    """The backstop: with the depth check switched off, the chains that overflowed an 8 MiB stack (SIGSEGV of the
    whole server) compile on the compiling thread's deep stack. Run in a child process, so a crash fails the test
    and not the suite."""
    import os
    import subprocess
    import sys

    script = tmp_path / "deep.py"
    script.write_text(_UNCHECKED_DEEP_COMPILE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])  # the caller's path kept (the GPU's wheels)
    done = subprocess.run([sys.executable, str(script), "20000"], cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "compiled 2" in done.stdout


def test_deep_stack_runs_inline_when_no_thread_can_start(compiler, monkeypatch):
    """The deep-stack thread is a backstop, not a requirement: if it cannot start, the compile runs in the calling
    thread (the depth check still guards it), errors keep their type and message, and the process-wide default
    stack size is left as it was."""
    import threading

    from slora_jax.engine import grammar as grammar_module

    before = threading.stack_size()
    names = []
    real = grammar_module.GrammarCompiler._compile

    def spy(self, *args):
        names.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(grammar_module.GrammarCompiler, "_compile", spy)
    compiler.compile(GrammarSpec("regex", "ab+"))
    with pytest.raises(GrammarError, match="cannot compile the regex"):
        compiler.compile(GrammarSpec("regex", "a("))

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    compiler.compile(GrammarSpec("regex", "ab*c"))  # not compiled before: "ab+" would come from the cache
    assert names == ["slora-grammar-compile", "slora-grammar-compile", threading.current_thread().name]
    assert threading.stack_size() == before


def test_deep_but_allowed_and_recursive_grammars_compile(compiler):
    """Depth counts chains, not size or recursion: a schema that refers to itself, a grammar whose rule names its
    own, a wide grammar, and chains just under the bound all compile."""
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}, "v": {"type": "integer"}}}}}
    wide = "start: " + " | ".join(f"w{i}" for i in range(500)) + "\n" + "".join(f'w{i}: "x{i}"\n' for i in range(500))
    for spec in (GrammarSpec("json_schema", tree), GrammarSpec("grammar", 'start: "(" start ")" | "a"\n'),
                 GrammarSpec("grammar", "start: %json " + json.dumps(tree)),
                 GrammarSpec("grammar", wide), GrammarSpec("json_schema", _ref_chain(MAX_DEPTH // 3)),
                 GrammarSpec("grammar", _rule_chain(MAX_DEPTH - 5))):
        compiler.compile(spec)


def test_no_tokenizer_is_a_clear_error():
    with pytest.raises(GrammarError, match="tokenizer"):
        GrammarCompiler(None, VOCAB, EOS).compile(GrammarSpec("regex", "a"))


def test_masks_cover_the_model_vocabulary(tokenizer):
    """A model vocabulary wider than the tokenizer's (padded embeddings): tokens past the tokenizer never allowed."""
    wide = GrammarCompiler(tokenizer, 600, (EOS,)).compile(GrammarSpec("regex", ".*"))
    mask = wide.mask()
    assert mask.shape == (mask_words(600),) and mask.dtype == np.int32
    allowed = allowed_tokens(mask, 600)
    assert allowed.max() < VOCAB and EOS in allowed


def test_fill_mask_checks_its_buffer(compiler):
    m = compiler.compile(GrammarSpec("regex", "a"), first_mask=False)
    with pytest.raises(ValueError, match="int32"):
        m.fill_mask(np.zeros(mask_words(VOCAB), np.int64))
    with pytest.raises(ValueError, match="int32"):
        m.fill_mask(np.zeros(mask_words(VOCAB) + 1, np.int32))


def test_parallel_masks_equal_serial_ones(compiler):
    rng = np.random.default_rng()
    specs = [GrammarSpec("json_schema", s) for s in SCHEMAS] * 3
    serial, parallel = [], []
    for spec in specs:  # advance each a few random tokens, and a twin by the same tokens
        m, ids = compiler.compile(spec), []
        for _ in range(int(rng.integers(0, 6))):
            if not m.is_done():
                ids.append(int(rng.choice(allowed_tokens(m.mask(), VOCAB))))
                m.accept(ids[-1])
        twin = compiler.compile(spec, first_mask=False)
        assert twin.catch_up(ids)
        serial.append(m)
        parallel.append(twin)
    fill_masks(parallel)
    for a, b in zip(serial, parallel, strict=True):
        np.testing.assert_array_equal(a.mask(), b.mask())


def test_llguidance_tokenizer_is_cached_per_tokenizer(tokenizer):
    assert ll_tokenizer(tokenizer, VOCAB, (EOS,)) is ll_tokenizer(tokenizer, VOCAB, (EOS,))
    assert ll_tokenizer(tokenizer, 600, (EOS,)) is not ll_tokenizer(tokenizer, VOCAB, (EOS,))


def test_a_fork_advances_on_its_own(compiler, tokenizer):
    m = compiler.compile(GrammarSpec("regex", "(ab|ac)d"))
    twin = m.fork()
    np.testing.assert_array_equal(twin.mask(), m.mask())
    assert twin.catch_up(tokenizer.encode("ab", add_special_tokens=False))
    assert m.accepted == 0 and twin.accepted > 0
    assert not np.array_equal(twin.mask(), m.mask())
    assert twin.catch_up(tokenizer.encode("abd", add_special_tokens=False)) and twin.is_done() and not m.is_done()


def test_a_grammar_compiled_again_comes_from_the_cache_and_forks(tokenizer):
    """One schema sent with every request compiles once; each request still gets its own matcher, and a schema
    whose properties come in another order (another output order) is another grammar."""
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,))
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "boolean"}}, "required": ["a", "b"]}
    first = compiler.compile(GrammarSpec("json_schema", schema))
    second = compiler.compile(GrammarSpec("json_schema", json.loads(json.dumps(schema))))
    assert compiler.compiles == 1 and second is not first
    rng = np.random.default_rng(9)
    text = tokenizer.decode(_walk(first, rng), skip_special_tokens=True)  # advancing one leaves the other
    assert list(json.loads(text)) == ["a", "b"] and second.accepted == 0
    assert list(json.loads(tokenizer.decode(_walk(second, rng), skip_special_tokens=True))) == ["a", "b"]
    swapped = {**schema, "properties": {"b": schema["properties"]["b"], "a": schema["properties"]["a"]}}
    third = compiler.compile(GrammarSpec("json_schema", swapped))
    assert compiler.compiles == 2
    assert list(json.loads(tokenizer.decode(_walk(third, rng), skip_special_tokens=True))) == ["b", "a"]
    for i in range(CACHED_GRAMMARS):  # the least recently used is dropped: schema's entry goes, swapped's stays
        compiler.compile(GrammarSpec("regex", f"x{i}"))
        if i == 0:
            compiler.compile(GrammarSpec("json_schema", swapped))
    compiler.compile(GrammarSpec("json_schema", swapped))
    assert compiler.compiles == 2 + CACHED_GRAMMARS
    compiler.compile(GrammarSpec("json_schema", schema))
    assert compiler.compiles == 3 + CACHED_GRAMMARS
