"""Per-request incremental detokenization with stop strings: one per request, kept by the engine (offline callers)
or by the server (which watches stop strings off the engine thread and aborts).

Three things make naive deltas wrong and one makes them slow; all are handled here:

* A SentencePiece decoder (Llama-2, Mistral: ``Strip``/``Metaspace``) drops the leading space of the first token it
  decodes, so output ids decoded alone lose the space that separates the answer from the prompt ("sea", not
  " sea"). As vLLM does, decoding starts with the prompt's last :data:`CONTEXT` ids as already-read context and only
  the text past them is output; ``ids`` holds the generated ids only.
* A token may end inside a multi-byte UTF-8 character (byte-level BPE, SentencePiece byte fallback): the decoded
  text then ends in U+FFFD until the next token completes it. Text is only committed once it no longer ends in
  U+FFFD (a window of the last tokens is re-decoded, so each step costs O(window), not O(output)), or once
  MAX_PENDING tokens wait: a run of lone continuation bytes (which a request can force, e.g. with logit_bias) would
  otherwise be re-decoded whole at every token. Such a forced commit stops before a trailing incomplete character
  when dropping at most :data:`MAX_CHAR_TOKENS` - 1 tokens makes the text clean (outputs merged into one ``add``
  can end inside a character every time), so a valid character is never committed as U+FFFD.
* A stop string may arrive split over several tokens: the last ``len(longest stop) - 1`` characters are held back
  until they can no longer start a stop string, so text that a stop string later swallows is never sent. As in
  vLLM, stop strings are looked for only once more than ``min_tokens`` tokens exist, in text that ends past the
  ``min_tokens``-th token's.
* The tokenizer's special tokens, which the decode skips, never enter the window: a long run of them (EOS under
  ``ignore_eos``) once made each later token re-decode the whole run twice (quadratic), and counted towards
  MAX_PENDING while a character waited for its last byte.
"""

from __future__ import annotations

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
            if end - self._read < MAX_PENDING:
                return
            # forced: stop before a trailing incomplete character if that leaves clean text (else commit it all)
            for k in range(end - 1, max(self._read, end - MAX_CHAR_TOKENS), -1):
                text = self._decode(self._window[self._prefix:k])
                if not text.endswith(REPLACEMENT) and len(text) > len(prefix_text):
                    full, end = text, k
                    break
        if len(full) > len(prefix_text):
            self.text += full[len(prefix_text):]
            self._prefix, self._read = self._read, end

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
