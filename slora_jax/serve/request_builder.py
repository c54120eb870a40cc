"""From a validated request body to what the engine needs: adapter, prompt token ids, sampling parameters.

Whether the request fits the context and the pool is the engine's question (``add_request`` refuses with the field to
blame); this only turns the client's words into ids and settings, refusing what cannot be turned (unknown model, no
tokenizer, a chat template that raises, sampling values out of range).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..engine.sampling import SamplingParams
from .protocol import APIError, ChatCompletionRequest, CompletionRequest

# Used when the tokenizer has no chat template of its own: role-tagged turns, generation after "assistant:".
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's; chat defaults to None: as many as fit (the engine resolves it)

Kind = Literal["completion", "chat"]


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A generation request ready for the engine, with how the client wants the answer."""

    kind: Kind
    model: str  # as the client named it (echoed in responses)
    adapter: str | None
    prompt_ids: list[int]
    sampling: SamplingParams
    return_token_ids: bool
    stream: bool
    include_usage: bool


class RequestBuilder:
    """Builds :class:`PreparedRequest` s for one engine; ``tokenizer`` must be the server's own (event-loop) copy."""

    def __init__(self, engine, base_name: str, tokenizer):
        self.engine, self.base_name, self.tokenizer = engine, base_name, tokenizer

    def adapter_for(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None for the base model); 404 for a name we do not serve."""
        if model == self.base_name:
            return None
        if not self.engine.has_adapter(model):  # thread-safe; add_request checks again
            raise APIError(404, f"the model {model!r} does not exist (neither the base model {self.base_name!r} "
                           f"nor a loaded adapter)", "model")
        return model

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer: send the prompt as a list of token ids", "prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def completion(self, req: CompletionRequest) -> PreparedRequest:
        req.check_supported()
        adapter = self.adapter_for(req.model)
        prompt = req.single_prompt()
        prompt_ids = self.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        return self._prepared("completion", req, adapter, prompt_ids, COMPLETION_DEFAULT_MAX_TOKENS)

    def chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        req.check_supported()
        adapter = self.adapter_for(req.model)
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so chat is unavailable; use /v1/completions with "
                           "token ids")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        template = getattr(self.tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # a template may raise on roles it does not know
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
        prompt_ids = self.encode(text, add_special_tokens=False)  # the template already wrote the special tokens
        return self._prepared("chat", req, adapter, prompt_ids, None)

    @staticmethod
    def _prepared(kind: Kind, req, adapter: str | None, prompt_ids: list[int],
                  default_max_tokens: int | None) -> PreparedRequest:
        try:
            sampling = req.sampling_params(default_max_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return PreparedRequest(kind, req.model, adapter, prompt_ids, sampling, req.return_token_ids, req.stream,
                               include_usage)
