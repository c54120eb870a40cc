"""A request's life inside the engine: tokens so far, pages held, status."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable
from typing import Any

from .logprobs import TokenLogprob
from .sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    """What a step produced for one request: new token ids, and whether (and why) it finished."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    text: str = ""  # new text, when the request has stop strings and the engine a tokenizer
    error_kind: str | None = None  # with finish_reason "error": "adapter", "adapter_unavailable" (a failure that
    # may pass), "request", "deadline" (whose fault)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    # with the request's first output, when it asked for prompt logprobs: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    seed: int = 0
    on_output: Callable[[RequestOutput], None] | None = None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    kv_pages: list[int] = dataclasses.field(default_factory=list)
    shared_pages: int = 0  # leading kv_pages that are prefix-cache references (not this sequence's own)
    adapter_slot: int = -1
    inflight: int = -1  # row of this sequence's sampled token in the step still on the device (-1 = none)
    num_cached: int = 0  # tokens whose K/V are in the pool
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    tenant: str | None = None  # whose service this counts towards (fairness policies); None: its adapter
    deadline: float | None = None  # time.monotonic() by which its first token is due (SLO); None: no deadline
    admit_time: float | None = None  # when admission last took it (its prefill step was built then)
    detok: Any = None  # IncrementalDetokenizer when stop strings must be watched
    penalty_row: int = -1  # its row in the step's penalty state (penalties.py); -1: none
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once computed (sampling.prompt_logprobs set)
    grammar: Any = None  # GrammarMatcher when the output must match a grammar (structured output)
    fork: Any = None  # ForkGroup: this is one of the samples of a request (n > 1) that share its prompt's pages

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def needs_whole_prompt(self) -> bool:
        """Its next prefill must compute every prompt token, so no cached prefix may be used: its prompt logprobs
        are still to come, or its penalties need the prompt's tokens in the step."""
        sp = self.sampling
        return (sp.prompt_logprobs is not None and self.prompt_logprobs is None) or sp.needs_penalty_row

    @property
    def num_generated(self) -> int:
        """Generated tokens, counting the one still on the device."""
        return len(self.output_ids) + (self.inflight >= 0)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, counting the one still on the device."""
        return len(self.prompt_ids) + self.num_generated

    @property
    def length_done(self) -> bool:
        """No more tokens may be generated (max_tokens reached, counting the one still on the device)."""
        return self.num_generated >= self.sampling.max_tokens

    def can_grow(self, max_model_len: int) -> bool:
        """May still get a token: not ``length_done`` and within the context. Asked twice per running sequence every
        decode step, so the generated count is read once."""
        generated = self.num_generated
        return generated < self.sampling.max_tokens and len(self.prompt_ids) + generated < max_model_len

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_tokens
