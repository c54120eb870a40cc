"""ASGI middleware in front of every route: the API-key check on /v1 (and :data:`KEYED_OUTSIDE_V1`), refusal
while shutting down, the count of requests in flight (the drain waits for it) and request counting by endpoint and
status.

It wraps the whole app (streams included, so a stream's status is counted once its response starts). The endpoint
label is the route's path for the app's own API routes and "other" for anything else (404s, docs), so label
cardinality stays bounded and a new route is counted without touching this file.

The API key travels as ``Authorization: Bearer <key>`` (RFC 6750): the scheme is matched case-insensitively and
may be followed by one or more spaces (``1*SP``), as the RFCs allow; the key itself must match byte for byte.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter
from fastapi.routing import APIRoute

from .errors import error_response
from .metrics import ServerMetrics
from .shutdown import SHUTTING_DOWN, Drain

ALWAYS_OPEN = frozenset({"/metrics"})  # answered even while draining (scrapes see the drain happen)
# vLLM's tokenizer endpoints live outside /v1; tokenizing costs CPU, so with an API key they need it too (vLLM's
# do not)
KEYED_OUTSIDE_V1 = frozenset({"/tokenize", "/detokenize"})


def api_route_paths(router: APIRouter) -> frozenset[str]:
    """Paths of a router's API routes: the endpoint labels (read from the router the app includes, as FastAPI may
    include a router lazily rather than copy its routes into ``app.routes``)."""
    return frozenset(route.path for route in router.routes if isinstance(route, APIRoute))


def bearer_token(authorization: bytes) -> bytes | None:
    """The credentials of a Bearer ``Authorization`` header value, else None."""
    scheme, sep, token = authorization.partition(b" ")
    if not sep or scheme.lower() != b"bearer":
        return None
    return token.lstrip(b" ")


class RequestGate:
    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, endpoints: frozenset[str], drain: Drain):
        self.app, self.metrics, self.endpoints, self.drain = app, metrics, endpoints, drain
        self.api_key = api_key.encode() if api_key else None

    def _authorised(self, scope) -> str | None:
        """None if the request may pass, else why not."""
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        token = bearer_token(auth)
        if token is not None and hmac.compare_digest(token, self.api_key):
            return None
        return "missing API key (send 'Authorization: Bearer <key>')" if not auth else "invalid API key"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        if self.drain.draining and path not in ALWAYS_OPEN:
            self.metrics.requests.labels(endpoint, "503").inc()
            response = error_response(503, f"{SHUTTING_DOWN}; retry on another instance")
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if self.api_key and (path.startswith("/v1") or path in KEYED_OUTSIDE_V1):
            refusal = self._authorised(scope)
            if refusal is not None:
                self.metrics.requests.labels(endpoint, "401").inc()
                await error_response(401, refusal)(scope, receive, send)
                return
        status: dict[str, int | None] = {"code": None}

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            with self.drain.track():
                await self.app(scope, receive, send_and_record)
        except Exception:
            status["code"] = status["code"] or 500
            raise
        finally:
            # no response started and nothing raised: the client left first (e.g. before its body was read); count
            # it as 499 like later disconnects, not as a 500 no client saw
            self.metrics.requests.labels(endpoint, str(status["code"] or 499)).inc()
