"""Run one HTTP request through an ASGI app in this process and hand its response back piece by piece.

A Ray replica (``ray_app``) answers the ingress's requests this way: the request travels as plain data
(:class:`RelayedRequest`), the replica's own app (``app.create_app``: the same routes, validation, errors and metrics as
``python -m slora_jax.serve``) answers it, and its response start and body chunks are yielded as they are sent, so a
stream stays a stream. When the consumer stops early (the client left, the ingress cancelled the call) the app is told
the client disconnected, which aborts the request in the engine and frees its pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator

# ASGI 2.3: Starlette's StreamingResponse then listens for http.disconnect while it streams (2.4 relies on send errors)
_ASGI = {"version": "3.0", "spec_version": "2.3"}
DISCONNECT_GRACE_S = 5.0  # how long an abandoned request may take to see the disconnect before it is cancelled
_running: set[asyncio.Task] = set()  # requests still finishing after their consumer left


@dataclasses.dataclass
class RelayedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


@dataclasses.dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


def _scope(req: RelayedRequest) -> dict:
    return {"type": "http", "asgi": _ASGI, "http_version": "1.1", "method": req.method, "scheme": "http",
            "path": req.path, "raw_path": req.path.encode("utf-8", "surrogateescape"),
            "query_string": req.query_string, "root_path": "", "headers": [tuple(h) for h in req.headers],
            "client": req.client, "server": ("relay", 0)}


async def relay(app, req: RelayedRequest, abandoned: set[asyncio.Task] | None = None
                ) -> AsyncIterator[ResponseStart | bytes]:
    """Yield the app's :class:`ResponseStart`, then its body chunks until the response is complete (chunks the app
    sent while the previous one was being relayed come joined: fewer, larger messages when the relay falls behind).

    A request whose consumer left before its end is told the client disconnected and kept (in ``abandoned`` if
    given) while it finishes on its own; it has :data:`DISCONNECT_GRACE_S` for that, then it is cancelled."""
    pending: deque[dict | None] = deque()  # the app's messages not yet relayed; None: the app returned
    arrived = asyncio.Event()
    disconnected = asyncio.Event()
    body_sent = False

    def push(message: dict | None) -> None:
        pending.append(message)
        arrived.set()

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        push(message)

    task = asyncio.ensure_future(app(_scope(req), receive, send))
    task.add_done_callback(lambda _: push(None))
    complete = False
    try:
        while True:
            while not pending:
                arrived.clear()
                await arrived.wait()
            message = pending.popleft()
            if message is None:  # the app returned (or raised) before finishing its response
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
                raise RuntimeError("the app ended without completing its response")
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [tuple(h) for h in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                body, more = [message.get("body", b"")], message.get("more_body", False)
                while more and pending and pending[0] is not None and pending[0]["type"] == "http.response.body":
                    nxt = pending.popleft()  # chunks sent while the last one was relayed travel together
                    body.append(nxt.get("body", b""))
                    more = nxt.get("more_body", False)
                if any(body):
                    yield b"".join(body)
                if not more:
                    complete = True
                    return
    finally:
        disconnected.set()
        if not task.done():
            keep = abandoned if abandoned is not None else _running
            keep.add(task)  # the loop holds tasks weakly: keep it until it ends
            task.add_done_callback(keep.discard)
            if not complete:
                asyncio.get_running_loop().call_later(DISCONNECT_GRACE_S, task.cancel)
