"""Per-request incremental detokenization with stop strings: one per request, kept by the engine (offline callers)
or by the server (which watches stop strings off the engine thread and aborts).

Two things make naive deltas wrong, and both are handled here:

* A token may end inside a multi-byte UTF-8 character (byte-level BPE, SentencePiece byte fallback): the decoded
  text then ends in U+FFFD until the next token completes it. Text is only committed once it no longer ends in
  U+FFFD (a window of the last tokens is re-decoded, so each step costs O(window), not O(output)), or once
  MAX_PENDING tokens wait: no character spans that many, and a run of lone continuation bytes (which a request can
  force, e.g. with logit_bias) would otherwise be re-decoded whole at every token.
* A stop string may arrive split over several tokens: the last ``len(longest stop) - 1`` characters are held back
  until they can no longer start a stop string, so text that a stop string later swallows is never sent.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
MAX_PENDING = 16  # tokens held back while the text ends in U+FFFD (a UTF-8 character is at most 4 bytes)


class IncrementalDetokenizer:
    """Feed token ids as they come; ``take()`` returns the text that is safe to send now."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (committed), already cut at a stop string if one matched
        self.sent = 0  # characters of ``text`` handed out by take()
        self.stopped = False  # a stop string matched: the text ends before it
        self._prefix = 0  # ids[_prefix:_read] decode to the committed tail used as context for the next decode
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int], final: bool = False) -> None:
        """Append ids; ``final`` commits a trailing incomplete character too (the request ended)."""
        if self.stopped or self.tokenizer is None:
            self.ids.extend(new_ids)
            return
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        settled = final or not full.endswith(REPLACEMENT) or len(self.ids) - self._read >= MAX_PENDING
        if len(full) > len(prefix_text) and settled:
            start = len(self.text)
            self.text += full[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        if not self.stop:
            return
        search_from = max(0, new_from - self.hold)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """New text since the last call; keeps back what might still start a stop string unless ``final``."""
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out
