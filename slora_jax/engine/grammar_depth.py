"""How deep a request's grammar nests, measured before llguidance compiles it.

Why: llguidance's compiler recurses once per level of nesting, and its limits (fuel, grammar size) do not bound the
depth. A chain of ~1000 JSON-schema ``$ref`` s or ~3000 Lark rules, each naming the next (40-75 KB of request),
overflowed the compiling thread's stack and killed the server with every request in it. Real grammars nest tens of
levels; anything past :data:`MAX_DEPTH` is refused with a clear error instead.

Depth here: for a JSON schema, nested objects and arrays plus one level per local ``$ref`` followed; for Lark or
GBNF text, the longest chain of rules each naming the next, and each schema inlined with llguidance's ``%json``.
A reference back into a rule or schema already on the chain (recursion, which the grammar may use freely) adds
nothing. This check is the first guard; the second is the deep stack every compile runs on
(``grammar.on_deep_stack``), for nesting this parse does not see.
"""

from __future__ import annotations

import json
import re

MAX_DEPTH = 200


class TooDeep(ValueError):
    """The grammar nests deeper than :data:`MAX_DEPTH`; the message says where."""


def check_schema_depth(schema) -> None:
    """Raise :class:`TooDeep` if ``schema`` (a parsed JSON schema) nests deeper than :data:`MAX_DEPTH`."""
    heights: dict[str, int] = {}  # a $ref's target: its height, once known
    open_refs: set[str] = set()

    def height(node, budget: int) -> int:
        if budget < 0:
            raise TooDeep(f"the JSON schema nests more than {MAX_DEPTH} levels deep ($refs followed)")
        if isinstance(node, dict):
            best = 0
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in open_refs:
                if ref not in heights:
                    open_refs.add(ref)
                    heights[ref] = height(_resolve(schema, ref), budget - 1)
                    open_refs.discard(ref)
                best = heights[ref]
                if best > budget:
                    raise TooDeep(f"the JSON schema nests more than {MAX_DEPTH} levels deep ($refs followed)")
            children = node.values()
        elif isinstance(node, list):
            best, children = 0, node
        else:
            return 0
        for child in children:
            best = max(best, height(child, budget - 1))
        return best + 1

    height(schema, MAX_DEPTH)


def _resolve(schema, ref: str):
    """The value a local JSON pointer (``#/$defs/name``) names, or None (llguidance reports a bad ref itself)."""
    node = schema
    for part in ref[1:].split("/")[1:] if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# Lark: "name:" (with ?/! and .priority), terminals "NAME:"; GBNF: "name ::=". Literals are blanked first so that a
# rule's name inside a string or regex is not taken for a reference.
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|/(?:[^/\\\n]|\\.)+/[a-z]*|\[(?:[^\]\\\n]|\\.)*\]')
_COMMENTS = re.compile(r"(?m)(?://|#).*$")
_RULE = re.compile(r"(?m)^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?:::=|:)")
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_INLINE_JSON = re.compile(r"%json\s*")


def check_grammar_depth(text: str) -> None:
    """Raise :class:`TooDeep` if a Lark or GBNF grammar's chain of rules is longer than :data:`MAX_DEPTH`, or a
    schema it inlines (``%json {...}``) nests deeper."""
    for inline in _INLINE_JSON.finditer(text):
        try:
            schema, _ = json.JSONDecoder().raw_decode(text, inline.end())
        except RecursionError:
            raise TooDeep(f"the grammar's inline JSON schema nests more than {MAX_DEPTH} levels deep") from None
        except ValueError:  # not JSON: llguidance says what is wrong with it
            continue
        check_schema_depth(schema)
    plain = _COMMENTS.sub("", _LITERALS.sub(" ", text))
    heads = list(_RULE.finditer(plain))
    bodies: dict[str, set[str]] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(plain)
        bodies.setdefault(head.group(1), set()).update(_NAME.findall(plain, head.end(), end))
    heights: dict[str, int] = {}
    open_rules: set[str] = set()

    def height(rule: str, budget: int) -> int:
        if budget < 0:
            raise TooDeep(f"the grammar's rules nest more than {MAX_DEPTH} levels deep")
        if rule not in heights:
            open_rules.add(rule)
            named = [r for r in bodies[rule] if r in bodies and r not in open_rules]
            heights[rule] = 1 + max((height(r, budget - 1) for r in named), default=0)
            open_rules.discard(rule)
        if heights[rule] > budget + 1:
            raise TooDeep(f"the grammar's rules nest more than {MAX_DEPTH} levels deep")
        return heights[rule]

    for rule in bodies:
        height(rule, MAX_DEPTH)
