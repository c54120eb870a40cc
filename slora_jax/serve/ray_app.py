"""Replicas of the server on Ray Serve behind one endpoint, each request sent to a replica that holds its adapter.

``python -m slora_jax.serve --ray --replicas N ...`` (docs/RAY.md). Two deployments:

* :class:`SloraReplica`: one engine (one GPU) and its engine thread, built from the same flags as a single server
  (``cli.build_engine``), answering with the same app (``app.create_app``): routes, validation, errors, metrics
  and streams are the single server's, run in the replica's process (``asgi_relay``). It reports where its adapters
  are (``record_routing_stats``) and tells Ray which adapters it serves (multiplexed model ids).
* :class:`SloraIngress`: the HTTP endpoint. It reads the request's ``model`` (the adapter; the base model's name
  means none) and relays the request, bytes in and bytes out, to the replica that ``ray_router`` picks for that
  adapter. It owns no API of its own, so the API cannot drift from the single server's.

Faults: a replica that dies before it accepted a request (the request never started) is retried once on another;
one that dies later ends its requests with an error (503, or an error event and ``[DONE]`` on a stream), and Ray
starts a new replica in its place while the others keep serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import LoggingConfig

from .asgi_relay import RelayedRequest, ResponseStart, relay
from .config import body_bytes_limit, context_len
from .errors import error_response, install_error_handlers
from .limits import BodyLimits
from .protocol import error_body
from .ray_router import AdapterAffinityRouter

log = logging.getLogger("slora_jax.serve")

APP_NAME = "slora"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# runtime adapter changes act on one engine: through the ingress they would reach one replica of N
REPLICA_LOCAL_WRITES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/adapters/pin",
                                  "/v1/adapters/unpin"})
ACCEPTED = "accepted"  # a replica's first item: the request reached a live replica (after it, no retry)
ACCEPT_TIMEOUT_S = 120.0  # no replica took the request in this long (none alive, all full): 503
REPLICA_LOST = (RayActorError, ReplicaUnavailableError)  # the replica chosen is gone (before ACCEPTED: nothing ran)
UNAVAILABLE = (DeploymentUnavailableError, BackPressureError)  # no replica can take requests now: 503, not 500
STATS_PERIOD_S = 1.0  # how often each replica reports its adapter residency to the routers


def adapter_of(path: str, body: bytes, base_model: str) -> str:
    """The adapter a generation request names ("" for the base model, other paths and bodies the replica refuses)."""
    if path not in GENERATION_PATHS:
        return ""
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return model if isinstance(model, str) and model != base_model else ""


class SloraReplica:
    """One engine and the single server's app, answering relayed requests."""

    def __init__(self, args: argparse.Namespace):
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from .app import create_app
        from .cli import build_engine
        from .engine_thread import EngineThread

        # a replica whatever flags built it: no host fill unless asked (cli.host_fill), so a replica reads only the
        # adapters routed to it (``build_app`` may be given a server's flags without --ray, as the tests do)
        engine, config, tokenizer = build_engine(argparse.Namespace(**{**vars(args), "ray": True}))
        self.engine = engine
        self.engine_thread = EngineThread(engine).start()
        self.app = create_app(self.engine_thread, config, tokenizer=tokenizer)
        self.stats_timeout_s = config.metrics_timeout_s
        self.abandoned: set[asyncio.Task] = set()  # requests finishing after their caller left
        self.requests = 0  # relayed requests accepted
        self.last_report: dict = {"device": [], "host": [], "running": 0, "waiting": 0, "cold_loads": 0,
                                  "pool_loads": 0, "requests": 0, "pid": os.getpid(),
                                  "replica": serve.get_replica_context().replica_id.unique_id}

        async def serves(name: str) -> str:  # the engine loads adapters itself: Ray only learns what we serve
            return name

        held = engine.ecfg.max_cpu_loras or max(len(engine.adapter_names()), 1)
        self.note_adapter = serve.multiplexed(max_num_models_per_replica=held)(serves)

    async def forward(self, req: RelayedRequest, routing: str | None = None):
        """Yield :data:`ACCEPTED`, then the app's response start and body chunks. ``routing`` is the router's."""
        name = serve.get_multiplexed_model_id()
        if name and self.engine.has_adapter(name):
            await self.note_adapter(name)
        self.requests += 1
        yield ACCEPTED
        async for item in relay(self.app, req, self.abandoned):
            yield item

    async def record_routing_stats(self) -> dict:
        """Residency for the router (adapter names on the device and in host memory), load, requests relayed, and
        the adapter counters the replica's /metrics exports as ``slora_adapter_store`` (``cold_loads``: reads from
        the source, its ``host_loads``; ``pool_loads``: copies into the pool, its ``loads``)."""
        def snapshot():
            engine = self.engine
            return ([a["name"] for a in engine.adapter_states("device")],
                    [a["name"] for a in engine.adapter_states("host")], engine.stats())

        try:
            device, host, stats = await self.engine_thread.call(snapshot, timeout=self.stats_timeout_s)
        except Exception as e:  # a long step (a compile) or a stopped engine: the last report stands
            log.warning("residency report unavailable (%s): sending the last one", type(e).__name__)
            return self.last_report
        store = stats["adapters"]
        self.last_report = {
            "device": device, "host": host, "running": stats["running"], "waiting": stats["waiting"],
            "cold_loads": store.get("host_loads", 0), "pool_loads": store.get("loads", 0), "requests": self.requests,
            "pid": os.getpid(), "replica": serve.get_replica_context().replica_id.unique_id}
        return self.last_report

    def check_health(self) -> None:
        thread = self.engine_thread
        if not thread.healthy:  # Ray replaces the replica
            raise RuntimeError(f"unhealthy: {thread.fatal or thread.last_error or 'the engine thread stopped'}")

    def __del__(self) -> None:  # Ray calls it once the replica has drained (or its start-up failed)
        if getattr(self, "engine_thread", None) is not None:
            self.engine_thread.stop()
        if getattr(self, "app", None) is not None:
            self.app.state.ctx.requests.close()
            self.app.state.ctx.adapters.close()


class RelayedResponse(StreamingResponse):
    """A replica's response, streamed through as it comes; the replica's call is cancelled if the client leaves.
    A replica lost mid-stream ends an event stream with an error event and ``[DONE]``, as the server does."""

    def __init__(self, start: ResponseStart, rest):
        self.rest = rest
        self.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
        super().__init__(self.chunks(), status_code=start.status)
        self.raw_headers = list(start.headers)

    async def chunks(self):
        try:
            async for chunk in self.rest:
                yield chunk
        except REPLICA_LOST as e:
            log.warning("replica lost mid-response: %s", e)
            if not self.sse:
                raise
            yield f"data: {json.dumps(error_body(503, 'the replica serving this request stopped; retry'))}\n\n"
            yield "data: [DONE]\n\n"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.rest.cancel()  # no-op once the replica finished; else it aborts the request there


@serve.ingress()
class SloraIngress:
    """The endpoint: relays each request to a replica chosen for its adapter."""

    def __init__(self, replicas: DeploymentHandle, base_model: str, max_body_bytes: int, body_timeout_s: float,
                 routing: str = "affinity"):
        self.replicas, self.base_model, self.routing = replicas, base_model, routing
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="slora-jax (Ray)", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)
        app.add_api_route("/{path:path}", self.handle, include_in_schema=False,
                          methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
        app.add_middleware(BodyLimits, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)
        return app

    async def handle(self, request: Request):
        path = request.url.path
        if path in REPLICA_LOCAL_WRITES:
            return error_response(501, f"{path} changes one engine and is not replicated across Ray replicas: serve "
                                  "adapters with --adapter-dir or --lora-modules, which every replica registers")
        body = await request.body()
        client = (request.client.host, request.client.port) if request.client else None
        req = RelayedRequest(request.method, path, request.scope.get("query_string", b""),
                             list(request.scope["headers"]), body, client)
        return await self.relay(req, adapter_of(path, body, self.base_model))

    async def relay(self, req: RelayedRequest, adapter: str):
        handle = self.replicas.options(stream=True, multiplexed_model_id=adapter)
        for attempt in (1, 2):
            try:
                stream = handle.forward.remote(req, routing=self.routing)
                await asyncio.wait_for(stream.__anext__(), ACCEPT_TIMEOUT_S)  # ACCEPTED
                break
            except REPLICA_LOST as e:  # died before it took the request: nothing ran, another may take it
                log.warning("replica lost before accepting a request (attempt %d): %s", attempt, e)
            except UNAVAILABLE as e:  # the deployment failed, or its queue is full
                log.warning("no replica can take a request: %s", e)
                return error_response(503, f"no replica can take requests now ({type(e).__name__}); retry")
            except TimeoutError:
                stream.cancel()
                return error_response(503, f"no replica took the request within {ACCEPT_TIMEOUT_S:.0f} s; retry")
        else:
            return error_response(503, "the replicas chosen for this request stopped before taking it; retry")
        try:
            start = await stream.__anext__()
        except REPLICA_LOST:
            return error_response(503, "the replica serving this request stopped; retry")
        if not isinstance(start, ResponseStart):
            stream.cancel()
            return error_response(500, "internal error: the replica answered out of order")
        return RelayedResponse(start, stream)


def build_app(args: argparse.Namespace, base_model: str, replica_resources: dict | None = None,
              routing: str = "affinity", stats_period_s: float = STATS_PERIOD_S):
    """The Ray Serve application: ``args.replicas`` engines built from ``args`` (the server's flags) behind one
    ingress. ``replica_resources``: each replica's Ray resources (default one CPU; one GPU on a GPU cluster)."""
    from .cli import batch_size

    replica_resources = replica_resources or {"num_cpus": 1}
    batch = batch_size(args, on_gpu=bool(replica_resources.get("num_gpus")))
    router = RequestRouterConfig(request_router_class=AdapterAffinityRouter,
                                 request_routing_stats_period_s=stats_period_s,
                                 request_routing_stats_timeout_s=max(4 * stats_period_s, 10.0))
    logs = LoggingConfig(log_level=args.log_level.upper(), enable_access_log=args.log_level == "debug")
    replica = serve.deployment(SloraReplica).options(
        num_replicas=args.replicas, max_ongoing_requests=4 * batch,  # a batch and its queue
        ray_actor_options=replica_resources, request_router_config=router, logging_config=logs,
        graceful_shutdown_timeout_s=args.shutdown_grace_s, health_check_period_s=5.0, health_check_timeout_s=30.0)
    # one relay per two engines: on a CPU core an ingress relays ~75 whole responses/s, ~3 H200s' worth (RAY.md)
    ingress = serve.deployment(SloraIngress).options(num_replicas=-(-args.replicas // 2), max_ongoing_requests=100_000,
                                                    ray_actor_options={"num_cpus": 0}, logging_config=logs)
    # the replicas' context is not known here: the CLI's default unless --max-model-len is set
    body_bytes = body_bytes_limit(args.max_body_bytes, args.max_prompt_chars, context_len(args.max_model_len))
    return ingress.bind(replica.bind(args), base_model, body_bytes, args.body_timeout_s, routing)


def run_ray(args: argparse.Namespace) -> None:
    """Start (or join) a Ray cluster, serve the application on ``args.host:args.port`` until SIGINT/SIGTERM."""
    import ray

    from .cli import served_model_name

    ray.init(address=args.ray_address, logging_level=logging.WARNING)
    gpus = ray.cluster_resources().get("GPU", 0)
    resources = {"num_gpus": 1} if gpus else {"num_cpus": 1}
    log.info("Ray cluster: %s; %d replicas with %s each", ray.cluster_resources(), args.replicas, resources)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args, served_model_name(args), resources), name=APP_NAME, route_prefix="/")
    log.info("slora-jax ready on Ray: http://%s:%d/v1 (%d replicas)", args.host, args.port, args.replicas)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down: draining the replicas (grace %.0f s)", args.shutdown_grace_s)
    try:
        serve.delete(APP_NAME)
        if args.ray_address is None:
            serve.shutdown()
    finally:
        if args.ray_address is None:
            ray.shutdown()
