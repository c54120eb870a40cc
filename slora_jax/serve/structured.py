"""Structured output fields of a request body -> the grammar its output must match (compiled, ready for the engine).

Accepted, one at a time: OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "text"}`` = none) and vLLM's extensions
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs`` (``{"json" |
"regex" | "choice" | "grammar" | "json_object": ...}``). A grammar that does not compile is a 400 with llguidance's
reason. Compiling (and the first token's mask) runs in the request builder's tokenizer threads, never on the event
loop or the engine thread.
"""

from __future__ import annotations

import copy

from ..engine.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec
from .protocol import APIError

# vLLM's guided_* fields and the grammar kind each asks for
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# structured_outputs' keys (vLLM) and the grammar kind each asks for
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}


def response_format_spec(fmt: dict) -> GrammarSpec | None:
    """OpenAI's ``response_format`` as a grammar (None for plain text); 400 for a shape we do not know."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise APIError(400, "response_format of type json_schema needs a json_schema object "
                           '({"name": ..., "schema": {...}})', "response_format")
        schema = inner.get("schema")
        if schema is None:  # a name without a schema: any JSON object
            return GrammarSpec("json_object")
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON object", "response_format")
        return GrammarSpec("json_schema", schema)
    raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   "response_format")


def grammar_spec(req) -> tuple[GrammarSpec, str] | None:
    """(the grammar ``req`` asks for, the field that asked), or None; 400 when several fields ask at once."""
    asked: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec = response_format_spec(req.response_format)
        if spec is not None:
            asked.append((spec, "response_format"))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(req, field)
        if value is not None:
            asked.append((GrammarSpec(kind, value), field))
    if req.structured_outputs is not None:
        keys = [k for k, v in req.structured_outputs.items() if k in STRUCTURED_KEYS and v not in (None, False)]
        if len(keys) != 1:
            raise APIError(400, f"structured_outputs must name exactly one of {sorted(STRUCTURED_KEYS)}",
                           "structured_outputs")
        asked.append((GrammarSpec(STRUCTURED_KEYS[keys[0]], req.structured_outputs[keys[0]]), "structured_outputs"))
    if len(asked) > 1:
        raise APIError(400, f"only one structured output field may be given, got {', '.join(f for _, f in asked)}",
                       asked[1][1])
    return asked[0] if asked else None


class RequestGrammars:
    """Compiles requests' grammars for one engine's vocabulary. Thread-safe: its own copy of the tokenizer (the
    llguidance tokenizer is built from it once, on the first structured request)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.compiler = GrammarCompiler(None if tokenizer is None else copy.deepcopy(tokenizer), vocab_size,
                                        eos_token_ids)

    def for_request(self, req) -> GrammarMatcher | None:
        """The compiled grammar ``req`` asks for (its first mask computed), None if none; 400 with the reason."""
        compiled = self.compile_request(req)
        return None if compiled is None else compiled[1]

    def compile_request(self, req) -> tuple[GrammarSpec, GrammarMatcher] | None:
        """(the grammar ``req`` asks for, compiled), None if none; 400 with the reason. The spec is what crosses to
        an engine process (a matcher cannot), which compiles it again there (``compile_spec``)."""
        asked = grammar_spec(req)
        if asked is None:
            return None
        spec, field = asked
        try:
            return spec, self.compiler.compile(spec)
        except GrammarError as e:
            raise APIError(400, f"{field}: {e}", field) from None

    def compile_spec(self, spec: GrammarSpec) -> GrammarMatcher:
        """``spec`` compiled (the engine process's side; raises ``GrammarError``)."""
        return self.compiler.compile(spec)

    @property
    def compiles(self) -> int:
        return self.compiler.compiles
