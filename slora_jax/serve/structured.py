"""Structured output fields of a request body -> the grammar its output must match (compiled, ready for the engine).

Accepted, one at a time: OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
"json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "text"}`` = none) and vLLM's extensions
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs`` (``{"json" |
"regex" | "choice" | "grammar" | "json_object": ...}``). A grammar that does not compile is a 400 with llguidance's
reason. Compiling (and the first token's mask) runs in the request builder's grammar threads, never on the event
loop, the tokenizer threads or the engine thread.
"""

from __future__ import annotations

import copy
import json

from ..engine.grammar import GrammarCompiler, GrammarError, GrammarMatcher, GrammarSpec
from ..engine.grammar_depth import TooDeep, check_schema_depth
from .protocol import APIError

# vLLM's guided_* fields and the grammar kind each asks for
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# structured_outputs' keys (vLLM) and the grammar kind each asks for
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}
# structured_outputs' options (vLLM): our JSON grammars never allow free whitespace and there is one backend, so
# disable_any_whitespace and disable_fallback change nothing; disable_additional_properties closes the schema's
# objects; the two that would ask for another grammar are refused when set. Any other key is refused.
STRUCTURED_FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
STRUCTURED_REFUSED = ("whitespace_pattern", "structural_tag")
# where a JSON schema holds subschemas: one, a list of them, or a name -> subschema mapping
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_BY_NAME = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


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
        asked.append((structured_outputs_spec(req.structured_outputs), "structured_outputs"))
    if len(asked) > 1:
        raise APIError(400, f"only one structured output field may be given, got {', '.join(f for _, f in asked)}",
                       asked[1][1])
    return asked[0] if asked else None


def structured_outputs_spec(so: dict) -> GrammarSpec:
    """vLLM's ``structured_outputs`` as a grammar: exactly one grammar key, options as STRUCTURED_FLAGS says."""
    def refuse(message: str):
        raise APIError(400, f"structured_outputs: {message}", "structured_outputs")

    for key, value in so.items():
        if key in STRUCTURED_FLAGS and value is not None and not isinstance(value, bool):
            refuse(f"{key} must be true or false")
        elif key in STRUCTURED_REFUSED and value not in (None, ""):
            refuse(f"{key} is not supported")
        elif key not in STRUCTURED_KEYS and key not in STRUCTURED_FLAGS and key not in STRUCTURED_REFUSED:
            refuse(f"unknown key {key[:100]!r}")
    keys = [k for k, v in so.items() if k in STRUCTURED_KEYS and v not in (None, False)]
    if len(keys) != 1:
        refuse(f"name exactly one of {sorted(STRUCTURED_KEYS)}")
    spec = GrammarSpec(STRUCTURED_KEYS[keys[0]], so[keys[0]])
    if spec.kind == "json_schema" and so.get("disable_additional_properties"):
        source = spec.source
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except ValueError:
                return spec  # compiling says why
        try:
            check_schema_depth(source)  # closed_objects recurses too
        except TooDeep as e:
            refuse(str(e))
        spec = GrammarSpec("json_schema", closed_objects(source))
    return spec


def closed_objects(schema):
    """A copy of ``schema`` whose object schemas without ``additionalProperties`` get ``false`` (vLLM's
    ``disable_additional_properties``): only the named properties may be written. Subschemas are found by keyword
    (a property that happens to be named ``properties`` is a name, not a schema)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _BY_NAME:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class RequestGrammars:
    """Compiles requests' grammars for one engine's vocabulary. Thread-safe: its own copy of the tokenizer (the
    llguidance tokenizer is built from it once, on the first structured request)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.compiler = GrammarCompiler(None if tokenizer is None else copy.deepcopy(tokenizer), vocab_size,
                                        eos_token_ids)

    def compile_asked(self, spec: GrammarSpec, field: str) -> GrammarMatcher:
        """``spec`` compiled (its first mask computed), as :func:`grammar_spec` found it in the request's ``field``;
        400 naming the field with the reason. The spec is what crosses to an engine process (a matcher cannot),
        which compiles it again there (``compile_spec``)."""
        try:
            return self.compiler.compile(spec)
        except GrammarError as e:
            raise APIError(400, f"{field}: {e}", field) from None

    def compile_spec(self, spec: GrammarSpec) -> GrammarMatcher:
        """``spec`` compiled (the engine process's side; raises ``GrammarError``)."""
        return self.compiler.compile(spec)

    @property
    def compiles(self) -> int:
        return self.compiler.compiles
