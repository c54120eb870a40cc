"""Structured output: a request's grammar (JSON schema, any JSON object, regex, choice, Lark/GBNF) compiled with
llguidance into a per-request matcher that gives the in-step sampler a token bitmask before each of its steps.

llguidance, not xgrammar: its wheel is one abi3 binary with no Python dependencies (it runs unchanged on the GPU
image's Python as a carried wheel), it computes a mask lazily per token (tens of microseconds on the demo
vocabulary; no per-grammar precompile over the whole vocabulary), and vLLM, SGLang and llama.cpp ship it.

Thread use: :class:`GrammarCompiler` is thread-safe (the server compiles in a grammar thread of its own, off the
event loop, the tokenizer threads and the engine thread, and computes the first mask there too); a
:class:`GrammarMatcher` belongs to one thread at a time (the engine thread once the request is queued). The compiler
keeps the last :data:`CACHED_GRAMMARS` grammars it compiled, so an application that sends one schema with every
request compiles it once.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import weakref
from typing import Any, Literal

import numpy as np

from .grammar_depth import MAX_DEPTH, check_grammar_depth, check_schema_depth
from .sampling import mask_words

MASK_BITS = 32  # a mask row is int32 words; bit j of word w allows token 32 * w + j
# Defaults for JSON schemas: no free whitespace between tokens (a sampled run of spaces or newlines would never end
# an object), compact separators. A schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False}
# Parser limits for untrusted grammars (llguidance's units): bound compile work and each step's mask work. The
# initial lexer fuel is under llguidance's default (1M) so that a regex like a{100000}, whose every mask would take
# ~100 ms of the engine thread, is refused when it is compiled; a 40-property schema with patterns uses far less.
# Items in one parser row: llguidance's default (2000) let a 2000-string choice or a ~500-property schema compile and
# then fail after its first token; 12000 serves ~3000 properties (masks of a few ms), step_max_items bounds a step.
LIMITS = dict(initial_lexer_fuel=300_000, step_lexer_fuel=200_000, step_max_items=50_000, max_grammar_size=200_000,
              max_items_in_row=12_000, verbose_errors=False)
DEEP_STACK_BYTES = 512 << 20  # the compiling thread's stack (see on_deep_stack)
_STACK_SIZE_LOCK = threading.Lock()
CACHED_GRAMMARS = 64  # compiled grammars kept per compiler, least recently used dropped first
MAX_CHOICES = 2000  # strings of a choice (a row of n + 1 items, well inside max_items_in_row): refused beyond it

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


class GrammarError(ValueError):
    """A grammar we cannot serve (it does not compile, or the tokenizer cannot be used); the message says why."""


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to match. ``source``: the schema (dict or JSON text) for ``json_schema``,
    the pattern for ``regex``, the list of strings for ``choice``, Lark or GBNF text for ``grammar``, unused for
    ``json_object`` (any JSON object)."""

    kind: Kind
    source: Any = None

    def cache_key(self) -> str | None:
        """The spec as text (None if it is not JSON data). Key order is kept: a schema's property order is the order
        of its output, so two schemas that differ only in it are different grammars."""
        try:
            return json.dumps([self.kind, self.source], ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):  # nesting too deep is refused when it compiles
            return None

    def llguidance_grammar(self) -> str:
        """The llguidance grammar text (nothing is checked here: compiling checks)."""
        import llguidance

        match self.kind:
            case "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
            case "json_schema":
                schema = self.source
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as e:
                        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
                    except RecursionError:
                        raise GrammarError(f"the JSON schema nests more than {MAX_DEPTH} levels deep") from None
                if not isinstance(schema, dict | bool):
                    raise GrammarError("a JSON schema must be a JSON object")
                try:
                    check_schema_depth(schema)
                    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
                except ValueError as e:
                    raise GrammarError(f"invalid JSON schema: {e}") from None
            case "regex":
                if not isinstance(self.source, str):
                    raise GrammarError("a regex must be a string")
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            case "choice":
                choices = self.source
                if (not isinstance(choices, list | tuple) or not choices
                        or not all(isinstance(c, str) and c for c in choices)):
                    raise GrammarError("a choice must be a non-empty list of non-empty strings")
                if len(choices) > MAX_CHOICES:
                    raise GrammarError(f"a choice may have at most {MAX_CHOICES} strings, got {len(choices)}")
                return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
            case "grammar":
                if not isinstance(self.source, str):
                    raise GrammarError("a grammar must be a string (Lark or GBNF)")
                try:
                    check_grammar_depth(self.source)
                    return llguidance.grammar_from("grammar", self.source)
                except ValueError as e:
                    raise GrammarError(f"invalid grammar: {e}") from None
        raise GrammarError(f"unknown grammar kind {self.kind!r}")


# One llguidance tokenizer per HF tokenizer object and (vocab size, EOS ids): building one walks the whole vocabulary
# (about a second for 128k tokens).
_ll_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ll_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """The cached ``llguidance.LLTokenizer`` of an HF fast tokenizer, its masks ``vocab_size`` wide (the model's
    vocabulary, which may exceed the tokenizer's) with the model's EOS ids as the end of output."""
    import llguidance.hf

    key = (int(vocab_size), tuple(int(t) for t in eos_token_ids))
    with _ll_lock:
        per_tok = _ll_tokenizers.setdefault(tokenizer, {})
        if key not in per_tok:
            try:
                per_tok[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=key[0], eos_token=list(key[1]))
            except Exception as e:  # noqa: BLE001 - slow tokenizers, vocabularies wider than the model's
                raise GrammarError(f"structured output is unavailable with this tokenizer: {e}") from None
        return per_tok[key]


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s into matchers for one model's vocabulary. Thread-safe; the llguidance
    tokenizer is built on the first compile (it is cached per tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...] | int):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.eos_token_ids = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        self.compiles = 0  # grammars compiled (not counting failures, nor those served from the cache)
        self._cache: collections.OrderedDict[str, GrammarMatcher] = collections.OrderedDict()
        self._cache_lock = threading.Lock()

    def compile(self, spec: GrammarSpec, first_mask: bool = True) -> GrammarMatcher:
        """A fresh matcher for ``spec``; raises :class:`GrammarError` with llguidance's reason. ``first_mask``
        also computes the mask of the first token now (in the calling thread, off the engine's path). A grammar
        compiled before (same kind, same source, keys in the same order) is a fork of the cached one."""
        import llguidance

        if self.tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer; this server has none")
        key = spec.cache_key()
        with self._cache_lock:
            hit = self._cache.get(key) if key is not None else None
            if hit is not None:
                self._cache.move_to_end(key)
                return hit.fork()
        tok = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        out = on_deep_stack(self._compile, llguidance, tok, spec, first_mask)
        self.compiles += 1
        if key is not None and first_mask:  # only grammars whose first mask passed are kept
            with self._cache_lock:
                self._cache[key] = out.fork()
                while len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return out

    def _compile(self, llguidance, tok, spec: GrammarSpec, first_mask: bool) -> GrammarMatcher:
        what = spec.kind.replace("_", " ")
        try:
            grammar = spec.llguidance_grammar()
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        except GrammarError:
            raise
        except (ValueError, TypeError) as e:  # e.g. a lone UTF-16 surrogate (UnicodeEncodeError) in a pattern
            raise GrammarError(f"cannot compile the {what}: {e}") from None
        if matcher.is_error():
            raise GrammarError(f"cannot compile the {what}: {_first_lines(matcher.get_error())}")
        out = GrammarMatcher(matcher, self.vocab_size, self.eos_token_ids)
        if first_mask:  # the lexer is built lazily: a grammar over the limits fails here, before it is queued
            out.mask()
            if out.error is not None:
                raise GrammarError(f"cannot compile the {what}: {out.error}")
        return out


def on_deep_stack(fn, *args):
    """``fn(*args)`` on a fresh thread with a :data:`DEEP_STACK_BYTES` stack; its result, or its exception raised.

    Why: the depth check (``grammar_depth``) refuses the nesting we know llguidance's compiler recurses on, but it
    is our own parse of llguidance's languages; a form it misses would overflow a normal 8 MiB thread stack and
    kill the server. On this stack the compiler survives any grammar its symbol limit lets through (measured: 64k
    chained Lark rules, 1000 chained $refs). The stack is reserved address space, touched only as deep as used.
    Falls back to the calling thread if no such thread can be started."""
    result: list = []

    def run():
        try:
            result.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 -- handed to the caller as it was raised
            result.append((False, e))

    with _STACK_SIZE_LOCK:  # threading.stack_size is process-wide: set it only while this thread starts
        old = threading.stack_size()
        try:
            threading.stack_size(DEEP_STACK_BYTES)
            thread = threading.Thread(target=run, name="slora-grammar-compile", daemon=True)
            thread.start()
        except (RuntimeError, ValueError, MemoryError):
            thread = None
        finally:
            threading.stack_size(old)
    if thread is None:
        return fn(*args)
    thread.join()
    ok, value = result[0]
    if ok:
        return value
    raise value


def _first_lines(message: str, n: int = 6) -> str:
    return "\n".join(message.strip().splitlines()[:n])


class GrammarMatcher:
    """One request's place in its grammar: the tokens accepted so far and the mask of the next one.

    The mask of the current state is computed once and kept (the server computes the first one when it compiles);
    :meth:`catch_up` takes the request's generated ids and accepts those not seen yet, so the engine may accept a
    token early (before its step's read-back is appended) without counting it twice."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.matcher, self.vocab_size, self.eos_token_ids = matcher, vocab_size, eos_token_ids
        self.words = mask_words(vocab_size)
        self.accepted = 0  # generated tokens consumed by the grammar
        self._mask: np.ndarray | None = None  # the mask for token number ``accepted`` (None: not computed yet)
        self.error: str | None = None

    def fork(self) -> GrammarMatcher:
        """An independent copy in the same state (microseconds: the compiled grammar is shared), so one compile can
        serve several requests (``n`` samples) and a caller's matcher is never advanced behind its back."""
        twin = GrammarMatcher(self.matcher.deep_copy(), self.vocab_size, self.eos_token_ids)
        twin.accepted, twin.error, twin._mask = self.accepted, self.error, self._mask  # masks are never written
        return twin

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the next token's mask into ``out`` (int32 [words], C-contiguous). A matcher in error allows only
        EOS, so its step samples a harmless token and the engine ends the request at :meth:`catch_up`."""
        if out.dtype != np.int32 or out.shape != (self.words,) or not out.flags.c_contiguous:
            raise ValueError(f"a mask row is a contiguous int32[{self.words}], got {out.dtype}{list(out.shape)}")
        if self.error is None:
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
            if self.matcher.is_error():
                self.error = _first_lines(self.matcher.get_error())
        if self.error is not None:
            out[:] = 0
            for t in self.eos_token_ids:
                out[t // MASK_BITS] |= np.int32(np.uint32(1 << (t % MASK_BITS)).view(np.int32))

    def mask(self) -> np.ndarray:
        """The next token's mask (computed on first call for this state, then kept)."""
        if self._mask is None:
            self._mask = np.empty(self.words, np.int32)
            self.fill_mask(self._mask)
        return self._mask

    def set_mask(self, row: np.ndarray) -> None:
        """Keep ``row``, computed for the current state elsewhere (:func:`fill_masks`)."""
        self._mask = row

    @property
    def has_mask(self) -> bool:
        return self._mask is not None

    def accept(self, token: int) -> bool:
        """Consume one generated token; False (and ``error`` set) if the grammar does not allow it."""
        self._mask = None
        self.accepted += 1
        if self.error is None and not self.matcher.consume_token(int(token)):
            self.error = (_first_lines(self.matcher.get_error()) if self.matcher.is_error() else
                          f"token {int(token)} is not allowed by the grammar")
        return self.error is None

    def catch_up(self, generated: list[int]) -> bool:
        """Accept ``generated[accepted:]`` (the request's generated ids); False once the grammar was broken."""
        for token in generated[self.accepted:]:
            if not self.accept(token):
                return False
        return self.error is None

    def is_done(self) -> bool:
        """The grammar is complete and allows no further token (only EOS): the request should stop."""
        return self.error is None and self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        """What was generated so far is a complete match (EOS is allowed now)."""
        return self.error is None and self.matcher.is_accepting()


_executor = None
_executor_lock = threading.Lock()


def fill_masks(matchers: list[GrammarMatcher]) -> None:
    """Compute the current masks of ``matchers`` that have none, in parallel (llguidance's thread pool); each
    matcher keeps its row. Serial for one matcher (no pool hand-off)."""
    todo = [m for m in matchers if not m.has_mask and m.error is None]
    if len(todo) <= 1:
        for m in matchers:
            m.mask()
        return
    import llguidance

    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    words = todo[0].words
    rows = np.empty((len(todo), words), np.int32)
    _executor.unsafe_compute_mask_ptr([(m.matcher, i) for i, m in enumerate(todo)], rows.ctypes.data, words * 4,
                                      len(todo))
    for i, m in enumerate(todo):
        if m.matcher.is_error():
            m.error = _first_lines(m.matcher.get_error())
            m.mask()  # the EOS-only row
        else:
            m.set_mask(rows[i])
    for m in matchers:
        m.mask()


def allowed_tokens(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids a mask row allows (for tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(mask, np.int32).view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def prepare_grammar_rows(seqs: list, previous) -> None:
    """Before a step over ``seqs`` is built: each sequence with a grammar gets its next token's mask ready.

    Decode is pipelined (a row's input token may still be on the device, ``seq.inflight`` its row in the previous
    step's output ``previous[2]``), but a mask needs that token accepted first. So when a grammar row has one in
    flight, this waits for the previous step and accepts it early (``catch_up`` counts it once when it is appended).
    Steps without grammar rows are untouched: the host-device overlap is lost only while grammars run."""
    rows = [s for s in seqs if s.grammar is not None]
    if not rows:
        return
    pending = [s for s in rows if s.inflight >= 0]
    if pending and previous is not None:
        tokens = np.asarray(previous[2])  # blocks until the previous step is done (jax keeps the host copy)
        for s in pending:
            s.grammar.catch_up([*s.output_ids, int(tokens[s.inflight])])
    fill_masks([s.grammar for s in rows])
