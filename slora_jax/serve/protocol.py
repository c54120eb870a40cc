"""Request and response bodies of the OpenAI-compatible API (vLLM's field names and extensions).

Only what we can serve exactly is accepted: a field we do not implement (``suffix``, ``tools``, vLLM's ``min_p`` or
``include_stop_str_in_output``: :data:`VLLM_UNIMPLEMENTED`) is rejected with a 400 that names it rather than silently
ignored, so a client never gets a subtly different answer. Unknown extra fields are ignored, as OpenAI clients send
several optional ones.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.forks import MAX_SAMPLES
from ..engine.sampling import MAX_LOGPROBS, SamplingParams
from .body_types import (
    AdapterWeights,
    ContentParts,
    GuidedChoices,
    LogitBias,
    PromptBatch,
    StopStrings,
    StopTokenIds,
    TokenBatch,
    TokenIds,
    ToolList,
)


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "code"}}`` with HTTP status ``status``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "conflict_error",
             413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, error_type: str | None = None,
                 retry_after_s: float | None = None):
        """``retry_after_s``: sent as ``Retry-After`` (whole seconds, rounded up), which clients such as openai's
        wait for before they retry."""
        super().__init__(message)
        self.status, self.message, self.param, self.error_type = status, message, param, error_type
        self.retry_after_s = retry_after_s

    @classmethod
    def of_adapter(cls, e: Exception, status: int, param: str, message: str | None = None) -> APIError:
        """``status`` for an adapter's failure ``e``, but 503 with ``Retry-After`` for one that may pass (its
        ``retry_after_s`` set: a disk away, a read that timed out): the server's trouble, not the request's."""
        retry = getattr(e, "retry_after_s", None)
        return cls(status if retry is None else 503, str(e) if message is None else message, param,
                   retry_after_s=retry)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.error_type)


MAX_ERROR_CHARS = 2000  # error messages may quote the client's input: never echo a megabyte back


def error_body(status: int, message: str, param: str | None = None, error_type: str | None = None) -> dict:
    """The error JSON; the message is cut to :data:`MAX_ERROR_CHARS` and made encodable (a lone surrogate quoted
    from the request would make the response itself fail). ``error_type`` defaults to the status's usual type."""
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": error_type or APIError.TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def check_text(text: str, field: str) -> str:
    """``text`` if it is valid Unicode. JSON allows a lone UTF-16 surrogate (``"\\ud800"``) and pydantic lets one
    through a union-typed field (``prompt``, ``stop``, message content); a tokenizer given one fails."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{field} holds a lone UTF-16 surrogate at character {e.start}, which is not valid "
                       "Unicode text", field) from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


# vLLM's sampling extensions that we do not implement, each with vLLM's default (what we do anyway): set to anything
# else they are refused with a 400 naming them, where silently ignoring them would answer a different request.
VLLM_UNIMPLEMENTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "min_p": 0.0, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "allowed_token_ids": None, "bad_words": [], "logits_processors": None,
    "return_tokens_as_token_ids": False,
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to look for VLLM_UNIMPLEMENTED fields; others are ignored
    vllm_unimplemented: ClassVar[dict[str, Any]] = VLLM_UNIMPLEMENTED

    model: str = Field(max_length=1024)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    seed: int | None = None
    stop: str | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    n: int | None = 1  # samples (choices) to return; null: 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0  # null: the default, as vLLM takes it
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0  # vLLM extension
    min_tokens: int = 0  # vLLM extension
    logit_bias: LogitBias | None = None
    user: str | None = None
    # structured output (structured.py): OpenAI's response_format; vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: GuidedChoices | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM extension: token ids of the prompt and the output in the response
    # vLLM extension: the tokenizer's special tokens (BOS) on the prompt; null: the route's default (completions
    # true, chat false: the template writes them)
    add_special_tokens: bool | None = None
    # our extension: this request's first-token deadline in seconds (overrides --first-token-slo-s); a number only
    first_token_slo_s: float | None = Field(None, strict=True)
    # our extension: a weighted mix of loaded adapters served as one (PEFT's "cat" combination); numbers only
    adapters: AdapterWeights | None = None

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if name in self.vllm_unimplemented and value is not None and value != self.vllm_unimplemented[name]:
                raise APIError(400, f"{name}={json.dumps(value)[:100]} is not supported (only vLLM's default, "
                               f"{json.dumps(self.vllm_unimplemented[name])})", name)
        slo = self.first_token_slo_s
        if slo is not None and not (slo > 0 and math.isfinite(slo)):
            raise APIError(400, f"first_token_slo_s must be a positive finite number of seconds, got {slo!r}",
                           "first_token_slo_s")
        if not 1 <= self.samples <= MAX_SAMPLES:
            raise APIError(400, f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n}", "n")
        if self.max_tokens is not None and self.max_tokens < 1 and not self.allows_zero_tokens():
            raise APIError(400, f"max_tokens must be at least 1, got {self.max_tokens} (0 only with echo, in "
                           "/v1/completions)", "max_tokens")

    def allows_zero_tokens(self) -> bool:
        return False

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(top alternatives per generated token, per prompt token); None where not asked."""
        return None, None

    def best_of_count(self) -> int | None:
        """best_of > n (completions): samples to generate, of which the n with the highest cumulative logprob of
        their generated tokens are answered; else None."""
        return None

    @property
    def samples(self) -> int:
        """How many choices the answer has (``n``)."""
        return 1 if self.n is None else self.n

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """SamplingParams with OpenAI's defaults (temperature 1, top_p 1); raises InvalidSampling on bad values.

        ``default_max_tokens`` applies when the client gave none; None leaves it to the engine (as many as fit)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k,
            seed=None if self.seed == -1 else self.seed,  # vLLM: -1 is no seed (a random one)
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_tokens=self.min_tokens,
        ).validate()

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} as (id, bias) pairs; keys must be decimal token ids. Finite biases are
        clamped to [-100, 100] as OpenAI documents the range and vLLM clamps; anything else is refused later."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise APIError(400, f"logit_bias keys must be token ids (decimal digits), got {key[:50]!r}",
                               "logit_bias")
            pairs.append((int(key), min(100.0, max(-100.0, bias)) if math.isfinite(bias) else bias))
        return tuple(pairs)


class CompletionRequest(_Request):
    prompt: str | TokenIds | PromptBatch | TokenBatch
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and not self.samples <= self.best_of <= MAX_SAMPLES:
            raise APIError(400, f"best_of must be an integer in [n, {MAX_SAMPLES}] (n={self.samples}), got "
                           f"{self.best_of}", "best_of")
        if self.stream and self.best_of_count():
            raise APIError(400, "best_of > n cannot be streamed: the best samples are known only at the end",
                           "best_of")

    def allows_zero_tokens(self) -> bool:
        return self.echo and self.max_tokens == 0  # just the prompt (and its logprobs): scoring

    def logprob_counts(self) -> tuple[int | None, int | None]:
        ranked = 0 if self.best_of_count() else None  # best_of ranks by the generated tokens' logprobs
        return (self.logprobs if self.logprobs is not None else ranked), self.logprobs if self.echo else None

    def best_of_count(self) -> int | None:
        return self.best_of if self.best_of is not None and self.best_of > self.samples else None

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of prompts is refused: n=1, one choice per response)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError(400, "a batch of prompts is not supported; send one prompt per request", "prompt")
            p = p[0]
        if isinstance(p, list) and not p or p == "":
            raise APIError(400, "prompt is empty", "prompt")
        return p


# Content part types whose text goes into the prompt, each with the key that holds it, and how one message's texts
# are joined: as vLLM's OpenAI server does for a text-only model whose chat template takes string content
# (vllm/entrypoints/chat_utils.py: MM_PARSER_MAP, _parse_chat_message_content_parts), so a request moved from vLLM
# gets the same prompt. A bare string in the list is a text part too, as there.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}
PART_SEPARATOR = "\n"
# vLLM's media parts: what a multimodal model would take; this server's models take text only
MEDIA_PARTS = ("image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds",
               "video_url", "prompt_embeds")


def part_text(index: int, part: dict[str, Any] | str) -> str:
    """The text of content part ``index``; 400 naming the part for any other (where vLLM would skip a text part
    without its text, we refuse it: a prompt silently missing part of what the client sent is a different request)."""
    if isinstance(part, str):
        return part
    where, kind = f"content part {index}", part.get("type")
    supported = ", ".join(TEXT_PARTS)
    if kind is None:
        raise APIError(400, f"{where} has no 'type'; a text part is {{\"type\": \"text\", \"text\": ...}}",
                       "messages")
    if not isinstance(kind, str):
        raise APIError(400, f"{where} has a 'type' that is not a string ({kind!r})", "messages")
    if kind in MEDIA_PARTS:
        raise APIError(400, f"{where} is of type {kind!r}, but this server's models take text only (supported "
                       f"content part types: {supported})", "messages")
    if kind not in TEXT_PARTS:
        raise APIError(400, f"{where} is of an unsupported type {kind!r} (supported content part types: "
                       f"{supported})", "messages")
    key = TEXT_PARTS[kind]
    if not isinstance(part.get(key), str):
        raise APIError(400, f"{where} of type {kind!r} needs a string {key!r}", "messages")
    return part[key]


# Messages in one chat: validating a list runs on the event loop (~3 us a message), and a 4 MiB body of 120k tiny
# messages held every stream for ~0.4 s before its prompt-length refusal; past this many it stops at once.
MAX_MESSAGES = 16384


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | ContentParts | None = None
    name: str | None = None  # passed to the chat template, as vLLM does
    # a tool call's history: refused when set (tools are not supported; dropping them would change the prompt)
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def template_fields(self) -> dict[str, str]:
        """What the chat template gets of this message; 400 for the fields we cannot pass on."""
        if self.tool_calls or self.tool_call_id:
            raise APIError(400, "messages with tool_calls or tool_call_id are not supported (tools are not)",
                           "messages")
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        """The message's text: a list of parts gives its parts' texts joined by :data:`PART_SEPARATOR`; a part that
        is not text is refused (:func:`part_text`)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return PART_SEPARATOR.join(part_text(i, part) for i, part in enumerate(self.content))


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: ToolList | None = None
    add_generation_prompt: bool = True  # vLLM extension
    # vLLM's chat extensions that change the prompt or the answer's text, also unimplemented
    vllm_unimplemented: ClassVar[dict[str, Any]] = {**VLLM_UNIMPLEMENTED, "echo": False,
                                                    "continue_final_message": False, "chat_template": None,
                                                    "chat_template_kwargs": {}, "mm_processor_kwargs": {},
                                                    "media_io_kwargs": {}, "documents": []}

    def check_supported(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError(400, "max_tokens and max_completion_tokens disagree", "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        super().check_supported()
        if self.top_logprobs is not None:
            if self.top_logprobs and not self.logprobs:  # 0 without logprobs asks for nothing (vLLM's default)
                raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                               "top_logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)


class PinLoraRequest(BaseModel):
    """``/v1/adapters/pin`` and ``/unpin``: the name in the body, as for load and unload (an adapter name may hold
    a ``/``, and the endpoint label of the request metrics stays the route's path)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256)


# ---------------------------------------------------------------- tokenizer endpoints (vLLM's /tokenize, /detokenize)

# vLLM's /tokenize fields that we do not implement, each with vLLM's default: set to anything else (a value that is
# not empty, false or null) they are refused with a 400 naming them, as for generation (VLLM_UNIMPLEMENTED)
TOKENIZE_UNIMPLEMENTED = ("continue_final_message", "chat_template", "chat_template_kwargs", "tools",
                          "mm_processor_kwargs", "media_io_kwargs", "documents")


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: vLLM's two forms in one body, ``prompt`` (as ``/v1/completions`` tokenizes it) or
    ``messages`` (as ``/v1/chat/completions`` builds its prompt); exactly one of them. ``model`` absent: the base."""

    model_config = ConfigDict(extra="allow")  # kept to look for TOKENIZE_UNIMPLEMENTED fields; others are ignored

    model: str | None = Field(None, max_length=1024)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES, fail_fast=True)
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages (the template's)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool | None = False

    def check_supported(self) -> None:
        for name in TOKENIZE_UNIMPLEMENTED:
            value = (self.model_extra or {}).get(name)
            if value:
                raise APIError(400, f"{name}={json.dumps(value)[:100]} is not supported (only vLLM's default, "
                               f"{'false' if name == 'continue_final_message' else 'null'})", name)
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of prompt (text) and messages (a chat), not "
                           f"{'both' if self.prompt is not None else 'neither'}",
                           "prompt" if self.prompt is not None else "messages")
        if self.messages is not None and not self.messages:
            raise APIError(400, "messages is empty", "messages")

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS): vLLM's default per form unless given."""
        return self.prompt is not None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: ``tokens`` are checked one by one (``RequestBuilder.build_detokenize``) so that the first
    bad one is named, where a typed list would coerce ``"7"`` and ``7.0`` and name only a position."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=1024)
    tokens: list[Any]


# ---------------------------------------------------------------- responses (plain dicts: cheap to build per chunk)

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_choice(text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_delta(delta: dict, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def envelope(kind: Literal["completion", "chat"], rid: str, model: str, choices: list[dict], chunk: bool,
             created: int | None = None, **extra) -> dict:
    obj = ("text_completion" if kind == "completion" else
           "chat.completion.chunk" if chunk else "chat.completion")
    body = {"id": rid, "object": obj, "created": created or int(time.time()), "model": model, "choices": choices}
    body.update(extra)
    return body


# JSON may carry U+0085, U+2028 and U+2029 raw, but line readers built on str.splitlines (httpx's aiter_lines
# among them) end a line there and cut an SSE event in two; escaped, they reach every client intact.
_SPLITLINES_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def json_line(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)`` with no character that any line reader takes for a line end."""
    text = json.dumps(value, ensure_ascii=False)
    # three substring checks cost ~0.05 us, the translation ~3 us: a stream writes one chunk per token
    if "\u2028" in text or "\u2029" in text or "\x85" in text:
        return text.translate(_SPLITLINES_BREAKS)
    return text


class ChunkTemplate:
    """The SSE event of a plain stream chunk (one choice's text, finish reason and token ids; no logprobs) as
    ``json_line(envelope(..., chunk=True))`` writes it, byte for byte, from a prefix built once per request: a
    stream sends one per token, and at batch 256 the dict building and encoding of every chunk was a share of
    the event loop's work (and of the GIL the engine's step loop needs)."""

    def __init__(self, kind: Literal["completion", "chat"], rid: str, model: str, created: int):
        head = envelope(kind, rid, model, [], chunk=True, created=created)
        self.kind = kind
        self.prefix = "data: " + json_line(head)[:-2] + '{"index": '

    def event(self, index: int, text: str, finish_reason: str | None, token_ids: list[int] | None) -> str:
        if self.kind == "completion":
            body = ', "text": ' + json_line(text)
        else:
            body = ', "delta": ' + ('{"content": ' + json_line(text) + "}" if text else "{}")
        fin = "null" if finish_reason is None else json.dumps(finish_reason)
        ids = "" if token_ids is None else ', "token_ids": [' + ", ".join(map(str, token_ids)) + "]"
        return f'{self.prefix}{index}{body}, "logprobs": null, "finish_reason": {fin}{ids}}}]}}\n\n'
