"""The FastAPI app: OpenAI-compatible completions and chat (stream or not), vLLM's tokenizer endpoints, adapter admin,
health and metrics.

``model`` in a request is an adapter name, or the served base model's name for no adapter. Routes are thin: a body
model from ``protocol`` in, a call to one of the app's parts (:class:`ServeContext`), a response out. Every failure
is a JSON error with a precise status (``errors``); the API-key check and request counting wrap every route
(``gate``). The engine is reached through its thread-safe methods or the engine thread, never from here directly.

Adding an endpoint: its body model in ``protocol``, one ``@routes.get/post`` function here. Errors, auth (for /v1
paths, and ``gate.KEYED_OUTSIDE_V1``) and the per-endpoint request metric come with it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .adapters import AdapterAdmin, timed_out
from .config import ServerConfig
from .engine_thread import EngineHandle, EngineUnavailable
from .errors import error_response, install_error_handlers
from .gate import RequestGate, api_route_paths
from .generation import GenerationRunner
from .limits import BodyLimits
from .metrics import ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraRequest,
    PinLoraRequest,
    TokenizeRequest,
    UnloadLoraRequest,
)
from .request_builder import RequestBuilder
from .shutdown import Drain

log = logging.getLogger("slora_jax.serve")
DETOKENIZE_MAX_FACTOR = 4  # /detokenize takes at most this many times max_model_len ids


@dataclasses.dataclass
class ServeContext:
    """What the routes work with; one per app (``app.state.ctx``)."""

    config: ServerConfig
    engine_thread: EngineHandle
    metrics: ServerMetrics
    requests: RequestBuilder
    generations: GenerationRunner
    adapters: AdapterAdmin
    drain: Drain
    max_model_len: int
    last_stats: dict = dataclasses.field(default_factory=dict)  # served by /metrics when the engine cannot answer

    @property
    def engine(self):
        return self.engine_thread.engine


async def serve_context(request: Request) -> ServeContext:
    """Async: a plain function dependency takes a thread of Starlette's shared pool for every request."""
    return request.app.state.ctx


Ctx = Annotated[ServeContext, Depends(serve_context)]
routes = APIRouter()


# ---------------------------------------------------------------- generation
@routes.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, ctx: Ctx):
    arrival = time.monotonic()
    tenant = ctx.requests.tenant_of(request.headers)
    return await ctx.generations.respond(await ctx.requests.completion(req, tenant), arrival, request)


@routes.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, ctx: Ctx):
    arrival = time.monotonic()
    tenant = ctx.requests.tenant_of(request.headers)
    return await ctx.generations.respond(await ctx.requests.chat(req, tenant), arrival, request)


# ---------------------------------------------------------------- tokenizer (vLLM's /tokenize and /detokenize)
@routes.post("/tokenize")
async def tokenize(req: TokenizeRequest, ctx: Ctx):
    ids, strs = await ctx.requests.tokenize(req)
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs})


@routes.post("/detokenize")
async def detokenize(req: DetokenizeRequest, ctx: Ctx):
    return JSONResponse({"prompt": await ctx.requests.detokenize(req, DETOKENIZE_MAX_FACTOR * ctx.max_model_len)})


# ---------------------------------------------------------------- models and adapters
@routes.get("/v1/models")
async def models(ctx: Ctx):
    base, max_len, created = ctx.config.served_model_name, ctx.max_model_len, int(time.time())
    data = [{"id": base, "object": "model", "created": created, "owned_by": "slora-jax", "root": base,
             "parent": None, "max_model_len": max_len}]
    data += [{"id": n, "object": "model", "created": created, "owned_by": "slora-jax", "root": n, "parent": base,
              "max_model_len": max_len} for n in ctx.engine.adapter_names()]
    return {"object": "list", "data": data}


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoraRequest, ctx: Ctx):
    name = req.lora_name
    ctx.adapters.check_name(name)
    path = ctx.adapters.resolve_path(req.lora_path)
    await ctx.adapters.off_loop(ctx.adapters.register, name, path)  # reads every weight: off the loop
    log.info("loaded adapter %s from %s", name, path)
    return {"object": "lora_adapter", "name": name, "path": str(path), "status": "loaded",
            "message": f"Success: LoRA adapter {name!r} added successfully."}


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraRequest, ctx: Ctx):
    name = req.lora_name
    await ctx.adapters.off_loop(ctx.adapters.check_unloadable, name)  # may ask the engine process: off the loop
    await ctx.adapters.unregister(ctx.engine_thread, name, ctx.config.admin_timeout_s)
    log.info("unloaded adapter %s", name)
    return {"object": "lora_adapter", "name": name, "status": "unloaded",
            "message": f"Success: LoRA adapter {name!r} removed successfully."}


# ---------------------------------------------------------------- adapter residency (routers ask where adapters are)
@routes.get("/v1/adapters")
async def adapter_states(ctx: Ctx, tier: str | None = None):
    ctx.adapters.check_tier(tier)
    try:
        data = await ctx.engine_thread.adapter_states(tier, ctx.config.admin_timeout_s)
    except TimeoutError:
        raise timed_out("list adapters", ctx.config.admin_timeout_s, None) from None
    return {"object": "list", "data": data}


@routes.post("/v1/adapters/pin")
async def pin_adapter(req: PinLoraRequest, ctx: Ctx):
    name, timeout = req.lora_name, ctx.config.admin_timeout_s
    await ctx.adapters.off_loop(ctx.adapters.check_unloadable, name, "pinned")
    await ctx.adapters.off_loop(ctx.adapters.read, name, timeout)  # a disk read: off the loop and the engine thread
    state = await ctx.adapters.pin(ctx.engine_thread, name, timeout)
    log.info("pinned adapter %s (%d explicit pins)", name, state["explicit_pins"])
    return {"object": "lora_adapter", "status": "pinned", **state}


@routes.post("/v1/adapters/unpin")
async def unpin_adapter(req: PinLoraRequest, ctx: Ctx):
    name = req.lora_name
    await ctx.adapters.off_loop(ctx.adapters.check_unloadable, name, "unpinned")
    state = await ctx.adapters.unpin(ctx.engine_thread, name, ctx.config.admin_timeout_s)
    log.info("unpinned adapter %s (%d explicit pins left)", name, state["explicit_pins"])
    return {"object": "lora_adapter", "status": "unpinned", **state}


# ---------------------------------------------------------------- operations
@routes.get("/health")
async def health(ctx: Ctx):
    thread = ctx.engine_thread
    if thread.healthy:
        return {"status": "ok"}
    reason = thread.fatal or thread.last_error or "the engine thread is not running"
    return error_response(503, f"unhealthy: {reason}")


@routes.get("/metrics")
async def prometheus_metrics(ctx: Ctx):
    try:
        stats = await ctx.engine_thread.stats(ctx.config.metrics_timeout_s)
        ctx.last_stats = stats
    except Exception as e:  # a long step or a stats bug: serve the last good values
        log.warning("metrics: engine stats unavailable (%s); serving the last values", e)
    ctx.metrics.refresh(ctx.last_stats, ctx.engine_thread.step_failures)
    payload, content_type = ctx.metrics.render()
    return Response(payload, media_type=content_type)


async def _engine_unavailable(_: Request, exc: EngineUnavailable) -> Response:
    """Any route that needed the engine while it is gone (stopped, its pool lost, its process dead): 503."""
    return error_response(503, str(exc))


def create_app(engine_thread: EngineHandle, config: ServerConfig, tokenizer=None) -> FastAPI:
    """The app for an engine already running in ``engine_thread``; ``tokenizer`` defaults to a copy of the engine's
    (a fast tokenizer must not be shared with the engine thread, which decodes concurrently). With an API key the
    interactive docs (/docs, /redoc, /openapi.json) are off: they would describe the API to anyone."""
    engine = engine_thread.engine
    if tokenizer is None and engine.tokenizer is not None:
        tokenizer = copy.deepcopy(engine.tokenizer)
    metrics = ServerMetrics()
    engine.watch_adapters(metrics.adapter_event)  # per-adapter pool loads, evictions and load seconds
    base_name = config.served_model_name
    max_model_len = engine.ecfg.max_model_len
    ctx = ServeContext(
        config=config, engine_thread=engine_thread, metrics=metrics,
        requests=RequestBuilder(engine, base_name, tokenizer, config.prompt_chars_limit(max_model_len),
                                config.tokenizer_threads, config.tenant_header),
        generations=GenerationRunner(engine_thread, metrics, tokenizer),
        adapters=AdapterAdmin(engine, base_name, config.allowed_adapter_dirs),
        drain=Drain(engine_thread),
        max_model_len=max_model_len)

    docs = {} if config.api_key is None else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="slora-jax", description="OpenAI-compatible server for many LoRA adapters on one base model",
                  **docs)
    app.state.ctx = ctx
    app.state.tokenizer = tokenizer  # the server's own copy (tests compare against it)
    install_error_handlers(app)
    app.add_exception_handler(EngineUnavailable, _engine_unavailable)
    app.include_router(routes)
    app.add_middleware(BodyLimits, max_bytes=config.body_bytes_limit(max_model_len), timeout_s=config.body_timeout_s)
    app.add_middleware(RequestGate, api_key=config.api_key, metrics=metrics, endpoints=api_route_paths(routes),
                       drain=ctx.drain)  # added last: outermost, so auth and the drain come before the body is read
    return app
