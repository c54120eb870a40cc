"""One choice of an answer (OpenAI's ``n``): a sample's text, tokens and how it ended.

A request for ``n`` samples runs as ``n`` engine requests (``engine.forks``: one prefill, the prompt's pages shared);
each becomes a :class:`Choice` with its own detokenizer, so stop strings are watched per choice and a choice that hits
one ends alone. The response lists the choices by index; a stream interleaves their chunks, each with its index.
"""

from __future__ import annotations

from ..engine.detok import IncrementalDetokenizer
from ..engine.sequence import RequestOutput


class BackendDecoder:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` straight from a fast tokenizer's Rust backend. The
    detokenizer decodes twice per streamed token; transformers' ``decode`` wraps the same backend call in about
    three times its cost of Python (argument conversion, batch checks), run on the event loop for every token.
    Only for a tokenizer whose decode is exactly the backend's (:meth:`wrap` checks: no space clean-up)."""

    def __init__(self, backend, all_special_ids=()):
        self.backend_tokenizer = backend  # named as the tokenizer's: token_bytes.py reads the token bytes there
        self.all_special_ids = list(all_special_ids)  # what the detokenizer leaves out of its window

    @classmethod
    def wrap(cls, tokenizer):
        """A :class:`BackendDecoder` for ``tokenizer`` where that is exact, else ``tokenizer`` itself."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
            return tokenizer
        return cls(backend, getattr(tokenizer, "all_special_ids", None) or ())

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class Choice:
    def __init__(self, index: int, request_id: str, tokenizer, stop: tuple[str, ...] = (), prompt_ids=(),
                 min_tokens: int = 0, end_ids: frozenset[int] = frozenset()):
        """``end_ids``: the ids whose text is left out when they end the choice (its stop_token_ids, and EOS unless
        it ignores EOS), as vLLM does and the engine's own detokenizer (never fed them) does."""
        self.index, self.request_id = index, request_id  # its place in the answer; its engine request id
        self.detok = IncrementalDetokenizer(tokenizer, stop, prompt_ids, min_tokens)
        self.end_ids = end_ids
        self.done = False  # its answer is complete: the engine ended it, or a stop string matched
        self.ended = False  # the engine sent its last output (else it is aborted when the answer ends)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_kind: str | None = None
        self.last_token_time: float | None = None
        self.cumulative_logprob = 0.0  # of its generated tokens, when the engine sends their logprobs (best_of)

    @property
    def token_ids(self) -> list[int]:
        return self.detok.ids

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def ok(self) -> bool:
        return self.finish_reason in ("stop", "length")

    def add(self, out: RequestOutput) -> tuple[str, bool]:
        """Take one engine output; returns (the text that may be sent now, whether a stop string ended the choice
        here: the engine does not watch stop strings, so the caller must abort its engine request)."""
        self.ended |= out.finished
        self.cumulative_logprob += sum(lp.logprob for lp in out.logprobs or ())
        ids = out.new_token_ids
        if out.finished and out.finish_reason == "stop" and ids and ids[-1] in self.end_ids:  # counted, not decoded
            self.detok.add(ids[:-1], final=True)
            self.detok.ids.append(ids[-1])
        else:
            self.detok.add(ids, final=out.finished)
        reason = out.finish_reason if out.finished else None
        stopped = self.detok.stopped and reason != "stop"
        if stopped:
            reason = "stop"
        if reason is not None:
            self.done = True
            self.finish_reason, self.error, self.error_kind = reason, out.error, out.error_kind
        return self.detok.take(final=self.done), stopped
