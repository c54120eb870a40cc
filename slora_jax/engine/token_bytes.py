"""Each token's UTF-8 bytes, read from a fast tokenizer's vocabulary and its decoder's kind.

Decoded text cannot say where a character was split: a token that ends inside a multi-byte character and a token
that is a real U+FFFD both decode to U+FFFD. The bytes can. The detokenizer uses them to commit text only at
character boundaries, and chat logprobs report them as ``bytes`` (OpenAI: the bytes that rebuild text split over
tokens). Two decoder families cover the Llama line and most others:

* byte-level BPE (GPT-2, Llama-3, Qwen): every byte is one printable character of the vocabulary's alphabet;
* SentencePiece with byte fallback (Llama-2, Mistral, Gemma): ``<0xNN>`` pieces are single bytes, other pieces are
  text with U+2581 for a space.

Any other decoder (WordPiece, a Python-only tokenizer) gives None and callers fall back to decoded text.
"""

from __future__ import annotations

import codecs
import functools
import json
import re

SPACE_MARK = "\u2581"  # SentencePiece's visible space
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: printable Latin-1 bytes stand for themselves, the other
    68 bytes take the code points from 256 up, in byte order (GPT-2's scheme, shared by every byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return {c: b for b, c in chars.items()}


def _decoder_kind(spec: dict | None) -> str | None:
    """"byte_level", "byte_fallback", "pieces" (text pieces with U+2581 spaces, no byte tokens) or None."""
    if not spec:
        return None
    kinds = {d.get("type") for d in spec.get("decoders", [spec])}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "byte_fallback"
    if kinds & {"Metaspace", "Replace"}:
        return "pieces"
    return None


class TokenBytes:
    """``table(token_id)`` -> the token's bytes (None for an id outside the vocabulary). Computed per id on first
    use and kept: a request's stream asks for the same few thousand ids again and again."""

    def __init__(self, backend, kind: str):
        self._backend, self._kind = backend, kind
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._cache: dict[int, bytes | None] = {}

    def __call__(self, token_id: int) -> bytes | None:
        try:
            return self._cache[token_id]
        except KeyError:
            value = self._cache[token_id] = self._compute(token_id)
            return value

    def _compute(self, token_id: int) -> bytes | None:
        if token_id in self._added:  # added tokens decode to their content as written
            return self._added[token_id].encode("utf-8")
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return None
        if self._kind == "byte_level":
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode("utf-8")
        if self._kind == "byte_fallback" and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        return piece.replace(SPACE_MARK, " ").encode("utf-8")


@functools.lru_cache(maxsize=16)
def _for_backend(backend) -> TokenBytes | None:
    decoder = getattr(backend, "decoder", None)
    try:
        kind = _decoder_kind(json.loads(decoder.__getstate__())) if decoder is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
    return TokenBytes(backend, kind) if kind is not None else None


def token_bytes(tokenizer) -> TokenBytes | None:
    """The bytes table of ``tokenizer`` (a transformers fast tokenizer, or anything with its ``backend_tokenizer``),
    shared by every caller of the same backend; None when its decoder is not one this module reads."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return _for_backend(backend) if backend is not None else None


def incomplete_tail(data: bytes) -> int:
    """Bytes at the end of ``data`` that may begin a UTF-8 character whose last byte has not come yet (0: none), as
    Python's incremental decoder holds them back (bytes no later byte can complete are final). Cutting ``data``
    before them changes no character of its decoding, whatever bytes come next."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-3:], final=False)  # a character is at most 4 bytes: 3 of them can be waiting
    return len(decoder.getstate()[0])
