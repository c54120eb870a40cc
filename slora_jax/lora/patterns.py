"""PEFT's module-name patterns, matched in linear time.

PEFT treats ``target_modules`` and ``exclude_modules`` given as a string, the keys of ``rank_pattern`` and
``alpha_pattern``, and ``layers_pattern`` as Python regexes. Python's ``re`` backtracks: ``(.|.)*X`` takes time
exponential in the name's length, holding the GIL the whole time and deaf to signals, so one hostile
``adapter_config.json`` froze every endpoint of a server. We match with RE2 instead (the ``google-re2`` package):
an engine without backtracking whose matching time is linear in pattern and text, so a pattern either compiles, and
then each match on our short module names takes microseconds, or is refused at once with RE2's reason. We build
exactly the expressions PEFT builds (``fullmatch`` for a string ``target_modules``, ``(.*\\.)?(pattern)$`` for the
pattern dicts, PEFT's layer-index expressions), so ordinary patterns match as under PEFT. RE2 has Python's syntax
minus backreferences, lookaround and a few rare forms (``\\Z``, possessive quantifiers); a pattern using them is
refused rather than matched differently.

Why not the alternatives: a timeout (the ``regex`` package) would still burn seconds per hostile adapter and make
acceptance depend on machine load; a pattern language of our own would refuse the regexes real adapters ship with.
"""

from __future__ import annotations

import re2

from slora_jax.lora.errors import AdapterError

__all__ = ["MAX_PATTERN_CHARS", "PatternTable", "compile_pattern", "layer_index", "layers_pattern_regex",
           "pattern_value"]

MAX_PATTERN_CHARS = 4096
_MAX_PROGRAM_BYTES = 8 << 20  # RE2's memory budget for one compiled pattern; larger ones fail to compile
_DEFAULT_LAYER_INDEX = r".*?\.[^.]*\.(?P<idx>\d+)\."  # PEFT: the first numbered segment is the layer index


def _options() -> re2.Options:
    options = re2.Options()
    options.log_errors = False  # refusals are reported as AdapterErrors, not on stderr
    options.max_mem = _MAX_PROGRAM_BYTES
    return options


def compile_pattern(name: str, field: str, pattern: object, template: str = "{}"):
    """``template`` with ``pattern`` put in, compiled by RE2; :class:`AdapterError` for a non-string, an over-long
    pattern, or one RE2 cannot compile (with its reason)."""
    if not isinstance(pattern, str):
        raise AdapterError(name, f"{field}: pattern {pattern!r} is not a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise AdapterError(name, f"{field}: pattern of {len(pattern)} characters (the limit is {MAX_PATTERN_CHARS})")
    try:
        return re2.compile(template.format(pattern), _options())
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise AdapterError(name, f"{field}: pattern {pattern[:80]!r} is not a regex we can match in linear time "
                                 f"(RE2: {reason}; backreferences and lookaround are not supported)") from None


class PatternTable:
    """A ``rank_pattern`` / ``alpha_pattern`` dict, compiled once: PEFT's rule is that the first key (in file order)
    matching the end of a module name, ``(.*\\.)?(key)$``, gives that module's value."""

    def __init__(self, name: str, field: str, patterns: dict):
        self.entries = [(compile_pattern(name, f"{field} key", key, r"(.*\.)?({})$"), value)
                        for key, value in patterns.items()]

    def value(self, key: str, default):
        return next((value for regex, value in self.entries if regex.match(key)), default)


def pattern_value(patterns: dict, key: str, default, name: str = "adapter", field: str = "pattern"):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` rule for one module name (a ``module_key``): the value of the
    first pattern matching the end of ``key``, else ``default``. Compiles every call: for many keys use
    :class:`PatternTable`."""
    return PatternTable(name, field, patterns).value(key, default)


def layer_index(key: str, layer_patterns: list) -> int | None:
    """The layer index PEFT reads from a module name for ``layers_to_transform``: the number after the first match
    of a ``layers_pattern`` (compiled regexes, tried in order), or after the first ``name.`` segment if none are
    given; None if no pattern finds one."""
    for regex in layer_patterns or [re2.compile(_DEFAULT_LAYER_INDEX, _options())]:
        match = regex.match(key)
        if match is not None:  # PEFT stops at the first pattern that matches, even without an index
            idx = match.group("idx")
            return None if idx is None else int(idx)
    return None


def layers_pattern_regex(name: str, pattern: object):
    """One ``layers_pattern`` entry as PEFT uses it: ``(?:^|.*?\\.)pattern\\.(?P<idx>\\d+)\\.``."""
    return compile_pattern(name, "layers_pattern", pattern, r"(?:^|.*?\.){}\.(?P<idx>\d+)\.")
