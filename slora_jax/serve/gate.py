"""ASGI middleware in front of every route: the API-key check on /v1 and request counting by endpoint and status.

It wraps the whole app (streams included, so a stream's status is counted once its response starts). The endpoint
label is the route's path for the app's own API routes and "other" for anything else (404s, docs), so label
cardinality stays bounded and a new route is counted without touching this file.
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter
from fastapi.routing import APIRoute

from .errors import error_response
from .metrics import ServerMetrics


def api_route_paths(router: APIRouter) -> frozenset[str]:
    """Paths of a router's API routes: the endpoint labels (read from the router the app includes, as FastAPI may
    include a router lazily rather than copy its routes into ``app.routes``)."""
    return frozenset(route.path for route in router.routes if isinstance(route, APIRoute))


class RequestGate:
    def __init__(self, app, api_key: str | None, metrics: ServerMetrics, endpoints: frozenset[str]):
        self.app, self.api_key, self.metrics, self.endpoints = app, api_key, metrics, endpoints

    def _authorised(self, scope) -> str | None:
        """None if the request may pass, else why not."""
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return "missing API key (send 'Authorization: Bearer <key>')" if not auth else "invalid API key"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        if self.api_key and path.startswith("/v1"):
            refusal = self._authorised(scope)
            if refusal is not None:
                self.metrics.requests.labels(endpoint, "401").inc()
                await error_response(401, refusal)(scope, receive, send)
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
