"""The FastAPI app: OpenAI-compatible completions and chat (stream or not), adapter admin, health and metrics.

``model`` in a request is an adapter name, or the served base model's name for no adapter. Every failure is a JSON
``{"error": {"message", "type", "code"}}`` with a precise status (never FastAPI's 422), and the server keeps
serving: the handlers only validate and translate; the engine thread owns the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.detok import IncrementalDetokenizer
from ..engine.engine import QueueFull
from ..engine.sampling import SamplingParams
from ..engine.sequence import RequestOutput
from ..lora.peft import AdapterError, load_peft_adapter
from .engine_thread import EngineThread, EngineUnavailable, RequestStream
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
    chat_choice,
    chat_delta,
    completion_choice,
    envelope,
    error_body,
    new_id,
    usage,
)

log = logging.getLogger("slora_jax.serve")

# Used when the tokenizer has no chat template of its own: role-tagged turns, generation after "assistant:".
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter",
                    "/v1/unload_lora_adapter", "/health", "/metrics")


@dataclasses.dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    allowed_adapter_dirs: tuple[Path, ...] = ()  # runtime loads only from below these (resolved) directories
    metrics_timeout_s: float = 5.0
    admin_timeout_s: float = 60.0


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', 'cannot parse')}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "missing" and not loc:
            return "the request body is missing (expected a JSON object)"
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


class _SSEResponse(StreamingResponse):
    """A streaming response that always closes its generator, so a dropped client aborts its request at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


class _Gate:
    """ASGI middleware: API-key check on /v1 and request counting by endpoint and status (streams included)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _KNOWN_ENDPOINTS else "other"
        if self.api_key and path.startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                self.metrics.requests.labels(endpoint, "401").inc()
                msg = "missing API key (send 'Authorization: Bearer <key>')" if not auth else "invalid API key"
                await _error(401, msg)(scope, receive, send)
                return
        status = {"code": 500}

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


class _Generation:
    """One accepted request between the engine thread and the HTTP response: text, tokens, timings, metrics.

    Text is made here from the token ids (``IncrementalDetokenizer``), not taken from the engine, so characters
    split across tokens and stop strings split across tokens come out right in streams too.
    """

    def __init__(self, kind: Literal["completion", "chat"], rid: str, model: str, prompt_ids: list[int],
                 stream: RequestStream, engine_thread: EngineThread, metrics: ServerMetrics, arrival: float,
                 return_token_ids: bool, tokenizer, stop: tuple[str, ...]):
        self.kind, self.rid, self.model, self.prompt_ids = kind, rid, model, prompt_ids
        self.stream, self.engine_thread, self.metrics, self.arrival = stream, engine_thread, metrics, arrival
        self.return_token_ids = return_token_ids
        self.detok = IncrementalDetokenizer(tokenizer, stop)
        self.created = int(time.time())
        self.last_token_time: float | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.detok.ids

    def _record(self, out: RequestOutput) -> str:
        """Account for one output; returns the text that may be sent now. Sets ``done`` at the end."""
        now = time.monotonic()
        if out.new_token_ids:
            if self.last_token_time is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.tpot.observe((now - self.last_token_time) / len(out.new_token_ids))
            self.last_token_time = now
            self.metrics.generated_tokens.inc(len(out.new_token_ids))
        self.detok.add(out.new_token_ids, final=out.finished)
        reason = out.finish_reason if out.finished else None
        if self.detok.stopped and reason != "stop":
            # a stop string the engine did not act on (yet): end here and free the engine's pages now
            reason = "stop"
            self.engine_thread.abort(self.rid)
        if reason is not None:
            self.done = True
            self.finish_reason, self.error = reason, out.error
            self.metrics.finished.labels(reason).inc()
            if reason in ("stop", "length"):
                self.metrics.e2e.observe(now - self.arrival)
        return self.detok.take(final=self.done)

    def _abort_if_open(self) -> None:
        if not self.stream.finished:
            self.engine_thread.abort(self.rid)
        if not self.done:  # the client went away first
            self.done, self.finish_reason = True, "abort"
            self.metrics.finished.labels("client_disconnect").inc()

    def _failure(self) -> APIError:
        if self.finish_reason == "error":
            message = self.error or "generation failed"
            return APIError(400 if message.startswith("adapter ") else 500, message)
        return APIError(503, f"the request was aborted ({self.finish_reason})")

    def _ok(self) -> bool:
        return self.finish_reason in ("stop", "length")

    # ---------------------------------------------------------------- whole response
    async def collect(self, request: Request) -> dict | None:
        """Wait for the end; None if the client went away (the request is then aborted)."""
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            while not self.done:
                getter = asyncio.ensure_future(self.stream.get())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return None
                self._record(getter.result())
        finally:
            watcher.cancel()
            self._abort_if_open()
        if not self._ok():
            raise self._failure()
        ids = self.token_ids if self.return_token_ids else None
        choice = (completion_choice if self.kind == "completion" else chat_choice)(self.detok.text,
                                                                                  self.finish_reason, ids)
        if self.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_ids
        return envelope(self.kind, self.rid, self.model, [choice], chunk=False, created=self.created,
                        usage=usage(len(self.prompt_ids), len(self.token_ids)))

    # ---------------------------------------------------------------- server-sent events
    def _chunk(self, text: str, finish_reason: str | None, ids: list[int] | None, role: bool = False) -> str:
        ids = ids if self.return_token_ids else None
        if self.kind == "completion":
            choice = completion_choice(text, finish_reason, ids)
        else:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            choice = chat_delta(delta, finish_reason, ids)
        if role and self.return_token_ids:
            choice["prompt_token_ids"] = self.prompt_ids
        body = envelope(self.kind, self.rid, self.model, [choice], chunk=True, created=self.created)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.kind == "chat":
                yield self._chunk("", None, None, role=True)
            async for out in self.stream:
                text = self._record(out)
                if self.done and not self._ok():
                    if out.new_token_ids or text:
                        yield self._chunk(text, None, out.new_token_ids)
                    yield f"data: {json.dumps(self._failure().body())}\n\n"
                    break
                if text or self.done or (self.return_token_ids and out.new_token_ids):
                    yield self._chunk(text, self.finish_reason, out.new_token_ids)
                if self.done:
                    break
            if include_usage:
                body = envelope(self.kind, self.rid, self.model, [], chunk=True, created=self.created,
                                usage=usage(len(self.prompt_ids), len(self.token_ids)))
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self._abort_if_open()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(engine_thread: EngineThread, config: ServerConfig, tokenizer=None) -> FastAPI:
    """The app for an engine already running in ``engine_thread``; ``tokenizer`` defaults to a copy of the engine's
    (a fast tokenizer must not be shared with the engine thread, which decodes concurrently)."""
    engine = engine_thread.engine
    if tokenizer is None and engine.tokenizer is not None:
        tokenizer = copy.deepcopy(engine.tokenizer)
    metrics = ServerMetrics()
    base_name = config.served_model_name
    allowed_roots = tuple(Path(d).resolve() for d in config.allowed_adapter_dirs)
    max_len = engine.ecfg.max_model_len
    last_stats: dict = {}

    app = FastAPI(title="slora-jax", description="OpenAI-compatible server for many LoRA adapters on one base model")
    app.state.engine_thread, app.state.metrics, app.state.config = engine_thread, metrics, config
    app.state.tokenizer = tokenizer
    app.add_middleware(_Gate, api_key=config.api_key, metrics=metrics)

    # ---------------------------------------------------------------- errors: always the same JSON shape
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _error(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    # ---------------------------------------------------------------- helpers
    def adapter_for(model: str) -> str | None:
        if model == base_name:
            return None
        if model not in engine.store:  # a dict lookup: safe from the loop; add_request checks again
            raise APIError(404, f"the model {model!r} does not exist (neither the base model {base_name!r} nor a "
                           f"loaded adapter)", "model")
        return model

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer: send the prompt as a list of token ids", "prompt")
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def adapter_pages(adapter: str | None) -> int:
        """Pool pages the adapter takes (0 for none). A plain dict read, safe from the loop; a race reads 0."""
        if adapter is None:
            return 0
        try:
            return int(engine.store.adapter_pages(adapter))
        except Exception:
            return 0

    def sampling_for(req, n_prompt: int, default_max_tokens: int | None, adapter: str | None) -> SamplingParams:
        if n_prompt >= max_len:
            raise APIError(400, f"the prompt has {n_prompt} tokens; this model's context is {max_len} tokens "
                           f"(prompt + max_tokens must fit)", "prompt")
        # Admission reserves prompt + max_tokens of KV next to the adapter: a request that cannot fit in the whole
        # pool would wait forever, so it is refused now (and an unset max_tokens is capped to what fits).
        fit = min(max_len, (engine.pool.num_pages - adapter_pages(adapter)) * engine.ecfg.page_size)
        try:
            sampling = req.sampling_params(default_max_tokens or max(1, fit - n_prompt))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        total = n_prompt + sampling.max_tokens
        if total > max_len:
            raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({sampling.max_tokens}) exceeds this "
                           f"model's context of {max_len} tokens", "max_tokens")
        if total > fit:
            raise APIError(400, f"prompt ({n_prompt} tokens) + max_tokens ({sampling.max_tokens}) needs more KV "
                           f"cache than this server's pool holds next to the adapter ({fit} tokens); lower max_tokens",
                           "max_tokens")
        return sampling

    async def start(kind: Literal["completion", "chat"], req, prompt_ids: list[int], arrival: float,
                    default_max_tokens: int | None) -> _Generation:
        adapter = adapter_for(req.model)
        sampling = sampling_for(req, len(prompt_ids), default_max_tokens, adapter)
        rid = new_id("cmpl" if kind == "completion" else "chatcmpl")
        try:
            stream = await engine_thread.submit(prompt_ids, adapter, sampling, rid)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}") from None
        except KeyError as e:
            raise APIError(404, str(e.args[0]) if e.args else "unknown adapter", "model") from None
        except AdapterError as e:
            raise APIError(400, str(e), "model") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e)) from None
        metrics.prompt_tokens.inc(len(prompt_ids))
        return _Generation(kind, rid, req.model, prompt_ids, stream, engine_thread, metrics, arrival,
                           req.return_token_ids, tokenizer, sampling.stop)

    async def respond(gen: _Generation, req, request: Request) -> Response:
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(gen.events(include_usage), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        body = await gen.collect(request)
        if body is None:  # the client is gone; nobody will read this
            return Response(status_code=499)
        return JSONResponse(body)

    def resolve_adapter_path(raw: str) -> Path:
        """An adapter path inside an allowed directory (relative paths are tried under each), else 403."""
        if not allowed_roots:
            raise APIError(403, "loading adapters at run time is disabled (start the server with --adapter-dir or "
                           "--allowed-adapter-dir)", "lora_path")
        given = Path(raw).expanduser()
        candidates = [given] if given.is_absolute() else [root / given for root in allowed_roots]
        inside = [c.resolve() for c in candidates]
        inside = [r for r in inside if any(r == root or r.is_relative_to(root) for root in allowed_roots)]
        if not inside:
            raise APIError(403, f"{raw!r} is outside the directories adapters may be loaded from", "lora_path")
        return next((r for r in inside if r.exists()), inside[0])

    # ---------------------------------------------------------------- generation
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        arrival = time.monotonic()
        req.check_supported()
        adapter_for(req.model)
        prompt = req.single_prompt()
        prompt_ids = encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        gen = await start("completion", req, prompt_ids, arrival, default_max_tokens=req.max_tokens or 16)
        return await respond(gen, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        req.check_supported()
        adapter_for(req.model)
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so chat is unavailable; use /v1/completions with "
                           "token ids")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        template = getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # a template may raise on roles it does not know
            raise APIError(400, f"cannot apply the chat template: {e}", "messages") from None
        prompt_ids = encode(text, add_special_tokens=False)  # the template already wrote the special tokens
        gen = await start("chat", req, prompt_ids, arrival, default_max_tokens=req.max_tokens)
        return await respond(gen, req, request)

    # ---------------------------------------------------------------- models and adapters
    @app.get("/v1/models")
    async def models():
        names = await engine_thread.call(lambda: list(engine.store.names()), timeout=config.admin_timeout_s)
        created = int(time.time())
        data = [{"id": base_name, "object": "model", "created": created, "owned_by": "slora-jax", "root": base_name,
                 "parent": None, "max_model_len": max_len}]
        data += [{"id": n, "object": "model", "created": created, "owned_by": "slora-jax", "root": n,
                  "parent": base_name, "max_model_len": max_len} for n in names]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraRequest):
        name = req.lora_name
        if name == base_name or name != name.strip():
            raise APIError(400, f"invalid adapter name {name!r}", "lora_name")
        path = resolve_adapter_path(req.lora_path)
        if name in engine.store:
            raise APIError(400, f"an adapter named {name!r} is already loaded; unload it first", "lora_name")
        try:  # read and check it fully now, so a bad adapter never reaches a request
            await run_in_threadpool(load_peft_adapter, path, engine.cfg, name, engine.ecfg.max_lora_rank)
        except AdapterError as e:
            raise APIError(400, str(e), "lora_path") from None
        except (OSError, ValueError) as e:
            raise APIError(400, f"adapter {name!r}: {e}", "lora_path") from None
        try:
            await engine_thread.call(lambda: engine.store.register(name, path), timeout=config.admin_timeout_s)
        except (AdapterError, ValueError, KeyError) as e:
            raise APIError(400, str(e), "lora_name") from None
        log.info("loaded adapter %s from %s", name, path)
        return {"object": "lora_adapter", "name": name, "path": str(path), "status": "loaded",
                "message": f"Success: LoRA adapter {name!r} added successfully."}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraRequest):
        name = req.lora_name
        if name == base_name:
            raise APIError(400, "the base model cannot be unloaded", "lora_name")
        if name not in engine.store:
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name")
        try:
            await engine_thread.call(lambda: engine.store.unregister(name), timeout=config.admin_timeout_s)
        except KeyError:
            raise APIError(404, f"no adapter named {name!r} is loaded", "lora_name") from None
        except (RuntimeError, ValueError) as e:  # e.g. still used by running requests
            raise APIError(409, str(e), "lora_name") from None
        log.info("unloaded adapter %s", name)
        return {"object": "lora_adapter", "name": name, "status": "unloaded",
                "message": f"Success: LoRA adapter {name!r} removed successfully."}

    # ---------------------------------------------------------------- operations
    @app.get("/health")
    async def health():
        if engine_thread.healthy:
            return {"status": "ok"}
        reason = engine_thread.fatal or engine_thread.last_error or "the engine thread is not running"
        return _error(503, f"unhealthy: {reason}")

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            stats = await engine_thread.call(engine.stats, timeout=config.metrics_timeout_s)
            last_stats.clear()
            last_stats.update(stats)
        except Exception as e:  # a long step or a stats bug: serve the last good values
            log.warning("metrics: engine stats unavailable (%s); serving the last values", e)
        metrics.refresh(last_stats, engine_thread.step_failures)
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)

    return app
