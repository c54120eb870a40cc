"""From a validated request body to what the engine needs: adapter, prompt token ids, sampling parameters.

Whether the request fits the pool is the engine's question (``add_request`` refuses with the field to blame); this
turns the client's words into ids and settings, refusing what cannot be turned (unknown model, no tokenizer, a chat
template that raises, text that is not valid Unicode, sampling values out of range) and what is too large to be
worth tokenizing (more characters than ``max_prompt_chars``) or to queue (more tokens than the context). The tenant a
request's service counts towards (fairness policies) comes from a request header, checked here too.

Tokenizing and templating grow with the text, so they run in a small thread pool (:class:`TokenizerThreads`), never
on the event loop: a megabyte prompt must not stall every other client's stream. Grammars (structured output) compile
in threads of their own (:data:`GRAMMAR_THREADS`), after the prompt passed its checks: a schema that takes a second
to compile holds up only other grammars, never plain requests or ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import json
import threading
from collections.abc import Mapping
from typing import Literal

from ..engine.engine import RequestRejected
from ..engine.grammar import GrammarMatcher, GrammarSpec
from ..engine.sampling import InvalidSampling, SamplingParams
from ..lora.errors import AdapterError
from .config import DEFAULT_TENANT_HEADER, MAX_TENANT_CHARS
from .protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_text,
)
from .structured import RequestGrammars, grammar_spec

# Used when the tokenizer has no chat template of its own: role-tagged turns, generation after "assistant:".
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's; chat defaults to None: as many as fit (the engine resolves it)
MESSAGE_OVERHEAD_CHARS = 16  # what one chat message adds to the prompt besides its text (role, separators)
GRAMMAR_THREADS = 2  # grammars compiled at once (each on a deep stack of its own: grammar.on_deep_stack)

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
    tenant: str | None = None  # from the tenant header; None: the engine counts the request towards its adapter
    first_token_slo_s: float | None = None  # the request's own first-token deadline; None: the server's default
    n: int = 1  # samples to generate
    best_of_keep: int | None = None  # best_of > n: answer with this many of them, highest cumulative logprob first
    rank_logprobs_only: bool = False  # logprobs are on only to rank best_of samples: not answered
    echo_text: str | None = None  # completions with echo: the prompt's text, which the answer starts with
    grammar: GrammarMatcher | None = None  # what the output must match (structured output)
    grammar_spec: GrammarSpec | None = None  # what ``grammar`` was compiled from (an engine process compiles it again)
    grammar_field: str | None = None  # the request field that asked for it (named in a compile's 400)


def _message_fields(index: int, message: ChatMessage) -> dict[str, str]:
    """``message.template_fields()``, its refusals saying which message (a conversation may hold hundreds)."""
    try:
        return message.template_fields()
    except APIError as e:
        raise APIError(e.status, f"messages[{index}]: {e.message}", e.param) from None


class TokenizerThreads:
    """A few worker threads, each with its own copy of the tokenizer (a fast tokenizer is not safe to share between
    threads, and the event loop's copy decodes streams meanwhile). Encoding releases the GIL, so the loop keeps
    serving while a long prompt is tokenized."""

    def __init__(self, tokenizer, workers: int):
        self.prototype = tokenizer
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="slora-tokenize")

    def tokenizer(self):
        """This worker thread's copy (made on first use)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.prototype)
        return tok

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestBuilder:
    """Builds :class:`PreparedRequest` s for one engine. ``completion`` and ``chat`` are coroutines that do their
    work in the tokenizer threads; ``tokenizer`` (None: token-id prompts only) is copied once per thread."""

    def __init__(self, engine, base_name: str, tokenizer, max_prompt_chars: int, threads: int = 4,
                 tenant_header: str = DEFAULT_TENANT_HEADER):
        self.engine, self.base_name, self.max_prompt_chars = engine, base_name, max_prompt_chars
        self.tenant_header = tenant_header
        self.has_tokenizer = tokenizer is not None
        self.threads = TokenizerThreads(tokenizer, threads)
        self.grammars = RequestGrammars(tokenizer, engine.cfg.vocab_size, engine.cfg.eos_token_id)
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="slora-grammar")

    async def completion(self, req: CompletionRequest, tenant: str | None = None) -> PreparedRequest:
        return await self._finish(req, await self.threads.run(self.prepare_completion, req, tenant))

    async def chat(self, req: ChatCompletionRequest, tenant: str | None = None) -> PreparedRequest:
        return await self._finish(req, await self.threads.run(self.prepare_chat, req, tenant))

    async def _finish(self, req, prepared: PreparedRequest) -> PreparedRequest:
        """The grammar compiled (grammar threads), then the mix registered (tokenizer threads): last, so that a
        request refused on the way leaves no mix behind."""
        if prepared.grammar_spec is not None:
            prepared = await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self._with_grammar, req,
                                                                        prepared)
        if req.adapters is not None:
            prepared = await self.threads.run(self._with_mix, req, prepared)
        return prepared

    def build_completion(self, req: CompletionRequest, tenant: str | None = None) -> PreparedRequest:
        """The whole build in the calling thread (offline callers and tests; the server awaits :meth:`completion`)."""
        return self._with_mix(req, self._with_grammar(req, self.prepare_completion(req, tenant)))

    def build_chat(self, req: ChatCompletionRequest, tenant: str | None = None) -> PreparedRequest:
        return self._with_mix(req, self._with_grammar(req, self.prepare_chat(req, tenant)))

    def _with_grammar(self, req, prepared: PreparedRequest) -> PreparedRequest:
        if prepared.grammar_spec is None:
            return prepared
        return dataclasses.replace(prepared, grammar=self.grammars.compile_asked(prepared.grammar_spec,
                                                                                 prepared.grammar_field))

    def tenant_of(self, headers: Mapping[str, str]) -> str | None:
        """The tenant named by the request's tenant header: None when absent or empty, 400 unless it is at most
        :data:`MAX_TENANT_CHARS` printable ASCII characters (it becomes a key the fairness policy keeps state
        under)."""
        value = headers.get(self.tenant_header)
        if not value:
            return None
        if len(value) > MAX_TENANT_CHARS or not all(" " <= c <= "~" for c in value):
            raise APIError(400, f"the {self.tenant_header} header must be at most {MAX_TENANT_CHARS} printable ASCII "
                           f"characters (got {len(value)} characters)", self.tenant_header)
        return value

    def close(self) -> None:
        self.threads.close()
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    def adapter_for(self, req) -> str | None:
        """The adapter a request's ``model`` names: None for the base model, and for a request with ``adapters``
        (its mix is added by :meth:`_with_mix`, once the rest of the request passed); 404 for a name we do not
        serve."""
        return None if req.adapters is not None else self.adapter_named(req.model)

    def adapter_named(self, model: str | None) -> str | None:
        """The adapter ``model`` names: None for the base model (and for no model: the tokenizer endpoints); 404 for a
        name we do not serve."""
        if model is None or model == self.base_name:
            return None
        if not self.engine.has_adapter(model):  # thread-safe; add_request checks again
            raise APIError(404, f"the model {model!r} does not exist (neither the base model {self.base_name!r} "
                           f"nor a loaded adapter)", "model")
        return model

    def _with_mix(self, req, prepared: PreparedRequest) -> PreparedRequest:
        """``prepared`` serving the mix that ``req.adapters`` names: registered only once the rest of the request has
        passed its checks, so refused requests leave no mixes behind (they once piled up past ``max_mixes``)."""
        if req.adapters is None:
            return prepared
        return dataclasses.replace(prepared, adapter=self.mix_for(req.model, req.adapters))

    def mix_for(self, model: str, parts: dict[str, float]) -> str:
        """The adapter serving the mix ``parts`` (registered on first use); ``model`` must be the base model or one
        of the parts. 404 for a part we do not serve, 400 for bad weights or a rank above the maximum."""
        if model != self.base_name and model not in parts:
            raise APIError(400, f"with adapters, model must be the base model {self.base_name!r} or one of the "
                           f"adapters mixed, not {model[:200]!r}", "model")
        try:
            return self.engine.register_mix(parts)  # thread-safe
        except KeyError as e:
            raise APIError(404, e.args[0], "adapters") from None
        except AdapterError as e:  # a part that failed: 503 with Retry-After where that may pass, as for an adapter
            raise APIError.of_adapter(e, 400, "adapters") from None
        except ValueError as e:  # bad weights, a rank above the maximum
            raise APIError(400, str(e), "adapters") from None

    def check_chars(self, n_chars: int, field: str) -> None:
        if n_chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt has {n_chars} characters; this server accepts at most "
                           f"{self.max_prompt_chars} (--max-prompt-chars)", field)

    def check_tokens(self, n_tokens: int) -> None:
        """Refuse a prompt the context cannot hold here, before it is queued for the engine thread."""
        try:
            self.engine.check_prompt_length(n_tokens)
        except RequestRejected as e:
            raise APIError(400, str(e), e.param) from None

    def encode(self, text: str, add_special_tokens: bool, field: str = "prompt") -> list[int]:
        """Tokenize in a worker thread (its own tokenizer copy)."""
        if not self.has_tokenizer:
            raise APIError(400, "this server has no tokenizer: send the prompt as a list of token ids", "prompt")
        self.check_chars(len(text), field)
        check_text(text, field)
        return list(self.threads.tokenizer().encode(text, add_special_tokens=add_special_tokens))

    def prepare_completion(self, req: CompletionRequest, tenant: str | None = None) -> PreparedRequest:
        """Everything but the grammar's compile and the mix (:meth:`_finish`)."""
        req.check_supported()
        adapter = self.adapter_for(req)
        prompt = req.single_prompt()
        special = req.add_special_tokens is not False  # vLLM's default for completions: true
        prompt_ids = self.encode(prompt, add_special_tokens=special) if isinstance(prompt, str) else list(prompt)
        prepared = self._prepared("completion", req, adapter, prompt_ids, COMPLETION_DEFAULT_MAX_TOKENS, tenant)
        self.check_tokens(len(prompt_ids))
        if req.echo:  # the answer starts with the prompt's text
            text = prompt if isinstance(prompt, str) else (
                self.threads.tokenizer().decode(prompt_ids) if self.has_tokenizer else "")
            prepared = dataclasses.replace(prepared, echo_text=text)
        return prepared

    def prepare_chat(self, req: ChatCompletionRequest, tenant: str | None = None) -> PreparedRequest:
        req.check_supported()
        adapter = self.adapter_for(req)
        if not self.has_tokenizer:
            raise APIError(400, "this server has no tokenizer, so chat is unavailable; use /v1/completions with "
                           "token ids")
        prompt_ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, bool(req.add_special_tokens))
        prepared = self._prepared("chat", req, adapter, prompt_ids, None, tenant)
        self.check_tokens(len(prompt_ids))
        return prepared

    def chat_prompt_ids(self, chat: list[ChatMessage], add_generation_prompt: bool,
                        add_special_tokens: bool = False) -> list[int]:
        """The prompt ids of a chat: its messages through the tokenizer's chat template (``FALLBACK_CHAT_TEMPLATE``
        without one), encoded without special tokens (the template writes them) unless ``add_special_tokens``. The
        one path of ``/v1/chat/completions`` and ``/tokenize``, so the two give the same ids. In a worker thread."""
        messages = [_message_fields(i, m) for i, m in enumerate(chat)]
        self.check_chars(sum(sum(map(len, m.values())) + MESSAGE_OVERHEAD_CHARS for m in messages), "messages")
        for m in messages:
            for text in m.values():
                check_text(text, "messages")
        tok = self.threads.tokenizer()
        template = getattr(tok, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        try:
            text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        except Exception as e:  # a template may raise on roles it does not know
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
        return self.encode(text, add_special_tokens=add_special_tokens, field="messages")

    # ---------------------------------------------------------------- /tokenize and /detokenize (vLLM's)

    async def tokenize(self, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        return await self.threads.run(self.build_tokenize, req)

    async def detokenize(self, req: DetokenizeRequest, max_tokens: int) -> str:
        return await self.threads.run(self.build_detokenize, req, max_tokens)

    def require_tokenizer(self, endpoint: str) -> None:
        if not self.has_tokenizer:
            raise APIError(400, f"this server has no tokenizer, so {endpoint} is unavailable (the model directory "
                           "holds no tokenizer files)")

    def build_tokenize(self, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """The ids ``/v1/completions`` (``prompt``) or ``/v1/chat/completions`` (``messages``) would use for the same
        input (with vLLM's ``add_special_tokens`` defaults), and their token strings if asked. No length limit but the
        characters': counting a prompt too long to serve is what the endpoint is for."""
        req.check_supported()
        self.adapter_named(req.model)  # every model shares the base tokenizer: only the name is checked
        self.require_tokenizer("/tokenize")
        if req.prompt is not None:
            ids = self.encode(req.prompt, add_special_tokens=req.special_tokens())
        else:
            ids = self.chat_prompt_ids(req.messages, req.add_generation_prompt, req.special_tokens())
        strs = list(self.threads.tokenizer().convert_ids_to_tokens(ids)) if req.return_token_strs else None
        return ids, strs

    def build_detokenize(self, req: DetokenizeRequest, max_tokens: int) -> str:
        """``tokenizer.decode(tokens)``, special tokens kept (vLLM's); 400 naming the first id that is not an integer
        in ``[0, vocab_size)``, and for more than ``max_tokens`` ids."""
        self.adapter_named(req.model)
        self.require_tokenizer("/detokenize")
        ids, vocab = req.tokens, self.engine.cfg.vocab_size
        if len(ids) > max_tokens:
            raise APIError(400, f"tokens has {len(ids)} ids; this server decodes at most {max_tokens} (4 x "
                           "--max-model-len) at once", "tokens")
        for i, t in enumerate(ids):
            if type(t) is not int or not 0 <= t < vocab:  # bool is an int to Python, not to JSON
                brief = {list: "an array", dict: "an object"}.get(type(t)) or json.dumps(t)[:50]
                raise APIError(400, f"tokens[{i}] is {brief}, not a token id (an integer in [0, {vocab}))", "tokens")
        try:
            return self.threads.tokenizer().decode(ids)
        except Exception as e:  # an id the tokenizer's own vocabulary lacks (a model vocab padded past it)
            raise APIError(400, f"cannot decode tokens: {type(e).__name__}: {e}", "tokens") from None

    def _prepared(self, kind: Kind, req, adapter: str | None, prompt_ids: list[int], default_max_tokens: int | None,
                  tenant: str | None) -> PreparedRequest:
        for s in [req.stop] if isinstance(req.stop, str) else req.stop or []:
            check_text(s, "stop")
        try:
            sampling = req.sampling_params(default_max_tokens)
        except InvalidSampling as e:  # the sampler's fields carry OpenAI's names, most of them the request's too
            raise APIError(400, str(e), e.field if e.field in type(req).model_fields else None) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        spec, field = grammar_spec(req) or (None, None)  # the fields checked now; compiled by _with_grammar
        return PreparedRequest(kind, req.model, adapter, prompt_ids, sampling, req.return_token_ids, req.stream,
                               include_usage, tenant, req.first_token_slo_s, n=req.best_of_count() or req.samples,
                               best_of_keep=req.samples if req.best_of_count() else None,
                               rank_logprobs_only=bool(req.best_of_count()) and req.logprobs is None,
                               grammar_spec=spec, grammar_field=field)
