"""Per-request incremental detokenization with stop strings: one per request, kept by the engine (offline callers)
or by the server (which watches stop strings off the engine thread and aborts).

Three things make naive deltas wrong and one makes them slow; all are handled here:

* A SentencePiece decoder (Llama-2, Mistral: ``Strip``/``Metaspace``) drops the leading space of the first token it
  decodes, so output ids decoded alone lose the space that separates the answer from the prompt ("sea", not
  " sea"). As vLLM does, decoding starts with the prompt's last :data:`CONTEXT` ids as already-read context and only
  the text past them is output; ``ids`` holds the generated ids only.
* A token may end inside a multi-byte UTF-8 character (byte-level BPE, SentencePiece byte fallback): the decoded
  text then ends in U+FFFD until the next token completes it. Text is committed (a window of the last tokens is
  re-decoded, so each step costs O(window), not O(output)) up to the last whole character, which the tokens' bytes
  say (``token_bytes.py``): a U+FFFD in the text may also be a real one, which text alone cannot tell apart. For a
  tokenizer whose bytes are unknown the text decides: nothing is committed while it ends in U+FFFD, until
  MAX_PENDING tokens wait (a run of lone continuation bytes, which a request can force with logit_bias, would
  otherwise be re-decoded whole at every token); such a forced commit stops before a trailing incomplete character
  when dropping at most :data:`MAX_CHAR_TOKENS` - 1 tokens leaves fewer trailing U+FFFD.
* A stop string may arrive split over several tokens: the last ``len(longest stop) - 1`` characters are held back
  until they can no longer start a stop string, so text that a stop string later swallows is never sent. As in
  vLLM, stop strings are looked for only once more than ``min_tokens`` tokens exist, in text that ends past the
  ``min_tokens``-th token's.
* The tokenizer's special tokens, which the decode skips, never enter the window: a long run of them (EOS under
  ``ignore_eos``) once made each later token re-decode the whole run twice (quadratic), and counted towards
  MAX_PENDING while a character waited for its last byte.
"""

from __future__ import annotations

from .token_bytes import incomplete_tail, token_bytes

REPLACEMENT = "\ufffd"
MAX_PENDING = 16  # tokens held back while the text ends in U+FFFD (a UTF-8 character is at most 4 bytes)
MAX_CHAR_TOKENS = 4  # tokens a UTF-8 character can span (a byte or more each): how far a forced commit looks back
CONTEXT = 5  # prompt ids decoded before the output (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


class IncrementalDetokenizer:
    """Feed token ids as they come; ``take()`` returns the text that is safe to send now."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), prompt_ids=(), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens = min_tokens
        self.ids: list[int] = []  # the generated ids
        # ids the decode skips (it skips special tokens): never in the window, where they change no text
        self._skipped = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self._bytes = token_bytes(tokenizer)  # each token's bytes: commits end on character boundaries
        self._window = [int(t) for t in list(prompt_ids)[-CONTEXT:]]  # prompt context + generated ids, to decode
        self.text = ""  # decoded so far (committed), already cut at a stop string if one matched
        self.sent = 0  # characters of ``text`` handed out by take()
        self.stopped = False  # a stop string matched: the text ends before it
        self._stop_from = 0  # a stop string must end past this character of ``text`` (the min_tokens-th token's)
        # _window[_prefix:_read] decode to the committed tail used as context for the next decode
        self._prefix, self._read = 0, len(self._window)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int], final: bool = False) -> None:
        """Append ids; ``final`` commits a trailing incomplete character too (the request ended)."""
        if self.stopped or self.tokenizer is None:
            self.ids.extend(new_ids)
            return
        below = self.min_tokens - len(self.ids)
        if 0 < below < len(new_ids):  # they cross min_tokens: stop strings count from the text past it only
            self.add(new_ids[:below])
            new_ids = new_ids[below:]
        self.ids.extend(new_ids)
        self._window.extend(t for t in new_ids if t not in self._skipped)
        start = len(self.text)
        self._commit(final)
        if len(self.ids) <= self.min_tokens:
            self._stop_from = len(self.text)
        elif len(self.text) > start:
            self._check_stop(max(start, self._stop_from))

    def _commit(self, final: bool) -> None:
        prefix_text = self._decode(self._window[self._prefix:self._read])
        full = self._decode(self._window[self._prefix:])
        end = len(self._window)
        if not final and full.endswith(REPLACEMENT):
            cut = self._character_end(end)
            if cut is None:  # the tokens' bytes are unknown: the text decides
                if end - self._read < MAX_PENDING:
                    return
                full, end = self._forced(prefix_text, full, end)
            elif cut < end:  # the tokens from ``cut`` hold the start of a character still to be completed
                if cut <= self._read:
                    return
                full, end = self._decode(self._window[self._prefix:cut]), cut
        if len(full) > len(prefix_text):
            self.text += full[len(prefix_text):]
            self._prefix, self._read = self._read, end

    def _character_end(self, end: int) -> int | None:
        """Where the pending tokens ``_window[_read:end]`` stop holding whole characters: ``end`` when their bytes
        end a character (a U+FFFD at the end is real), else the index of the token where an unfinished character
        starts. None if the tokens' bytes are unknown."""
        if self._bytes is None:
            return None
        pieces = [self._bytes(t) for t in self._window[self._read:end]]
        if any(p is None for p in pieces):
            return None
        tail, k = incomplete_tail(b"".join(pieces)), end
        while tail > 0:
            k -= 1
            tail -= len(pieces[k - self._read])
        return k

    def _forced(self, prefix_text: str, full: str, end: int) -> tuple[str, int]:
        """MAX_PENDING tokens wait and their bytes are unknown: commit, but before a trailing incomplete character
        if fewer tokens decode to a prefix with fewer trailing U+FFFD (the text may hold real ones: counting, not
        "ends in", finds the split character)."""
        trailing = _trailing_replacements(full)
        for k in range(end - 1, max(self._read, end - MAX_CHAR_TOKENS), -1):
            text = self._decode(self._window[self._prefix:k])
            if _trailing_replacements(text) < trailing and full.startswith(text) and len(text) > len(prefix_text):
                return text, k
        return full, end

    def _check_stop(self, new_from: int) -> None:
        """Cut the text at the first stop string that ends past character ``new_from``."""
        if not self.stop:
            return
        hits = [i for i in (self.text.find(s, max(0, new_from - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """New text since the last call; keeps back what might still start a stop string unless ``final``."""
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out


def _trailing_replacements(text: str) -> int:
    return len(text) - len(text.rstrip(REPLACEMENT))
