"""Token logprobs in OpenAI's response shapes, built per choice as the engine's outputs arrive (whole or streamed).

Completions (``logprobs: k``, ``echo``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per
token; with echo the prompt's tokens come first, the first of them with ``None`` logprob and alternatives (nothing
precedes it). ``top_logprobs`` maps token text to logprob: the k most likely tokens plus the chosen one (OpenAI's "up
to logprobs + 1 elements"; texts that decode alike keep the likelier). Chat (``logprobs: true``, ``top_logprobs:
k``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.

A token's text is its own decoding (byte-level BPE: exact; a token that is part of a multi-byte character decodes to
U+FFFD, and its ``bytes`` are then the token's own, where the tokenizer's vocabulary says them: ``token_bytes.py``).
``text_offset`` counts characters of those texts from the start of the choice's text. A logprob of -inf (impossible
for the raw logits we report, but JSON has no infinity) is sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

import math

from ..engine.detok import REPLACEMENT
from ..engine.logprobs import TokenLogprob
from ..engine.sequence import RequestOutput
from ..engine.token_bytes import token_bytes

FLOOR = -9999.0


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else FLOOR


class TokenTexts:
    """Each token id's text, decoded once (shared by every request of a server; the event loop's thread only)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes = token_bytes(tokenizer)

    def utf8(self, token_id: int) -> list[int]:
        """The token's bytes as chat logprobs report them: its text's, unless that holds U+FFFD (a piece of a
        character, or a real U+FFFD), then the token's own bytes where the tokenizer says them, so that the bytes of
        consecutive tokens rebuild a character split over them."""
        text = self(token_id)
        own = self._bytes(token_id) if self._bytes is not None and REPLACEMENT in text else None
        return list(own if own is not None else text.encode("utf-8"))

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                                            else f"token_id:{token_id}")
        return text


class ChoiceLogprobs:
    """One choice's logprobs: everything so far (``whole``) and what is not yet streamed (``take``)."""

    def __init__(self, kind: str, texts: TokenTexts, prompt_ids: list[int]):
        self.kind, self.texts, self.prompt_ids = kind, texts, prompt_ids
        self.entries: list[tuple[int, TokenLogprob | None]] = []  # (token id, its logprobs; None: the first prompt's)
        self._sent = 0
        self._offset = 0

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:  # echo: with the first output
            self.entries += list(zip(self.prompt_ids, out.prompt_logprobs, strict=True))
        self.entries += [(lp.token_id, lp) for lp in out.logprobs or ()]

    def pending(self) -> bool:
        return self._sent < len(self.entries)

    def take(self) -> dict | None:
        """The logprobs of the tokens not sent yet, in the response's shape (None if there are none)."""
        if not self.pending():
            return None
        new = self.entries[self._sent:]
        piece = self._format(new, self._offset)
        self._sent = len(self.entries)
        self._offset += sum(len(self.texts(t)) for t, _ in new)
        return piece

    def whole(self) -> dict:
        return self._format(self.entries, 0)

    def _format(self, entries: list[tuple[int, TokenLogprob | None]], offset: int) -> dict:
        if self.kind == "chat":
            return {"content": [self._chat_entry(lp) for _, lp in entries if lp is not None]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in entries:
            text = self.texts(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else _finite(lp.logprob))
            out["top_logprobs"].append(None if lp is None else self._top_dict(lp))
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _top_dict(self, e: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for token_id, lp in e.top:
            top.setdefault(self.texts(token_id), _finite(lp))
        top.setdefault(self.texts(e.token_id), _finite(e.logprob))
        return top

    def _chat_entry(self, e: TokenLogprob) -> dict:
        text = self.texts(e.token_id)
        return {"token": text, "logprob": _finite(e.logprob), "bytes": self.texts.utf8(e.token_id),
                "top_logprobs": [{"token": self.texts(i), "logprob": _finite(lp), "bytes": self.texts.utf8(i)}
                                 for i, lp in e.top]}
