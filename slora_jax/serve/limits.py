"""How much a client may send and how long it may take: the request body's size (413) and arrival time (408), and the
time from a request's first byte to its last header (a slow-header client is answered 408 and cut off).

uvicorn bounds neither the body nor the time to send headers, so a client that sends a request slowly (slowloris)
held a connection and a task forever, and a 10 MB body was read whole before anything looked at it. The body rules
are ASGI middleware (:class:`BodyLimits`); the header deadline lives in the HTTP protocol (:func:`http_protocol`),
as no ASGI code runs before the headers are complete.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_response

RAW_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class BodyLimits:
    """Reads a request's whole body before the app sees it: at most ``max_bytes`` (413, checked against the
    declared Content-Length before reading) and within ``timeout_s`` of the headers (408). The app then gets the
    body in one message; later ``receive`` calls (disconnect watching) go to the client as before."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # every method: a GET may carry a body too (the Ray ingress reads any)
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # the rest of the body is read and dropped by the server after the answer (the connection stays usable)
            await self._too_large(scope, receive, send, int(declared))
            return
        body = await self._read(scope, receive, send)
        if body is None:
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, scope, receive, send) -> bytes | None:
        """The whole body, or None once the request was answered (too large, too slow) or the client left."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                response = error_response(408, f"the request body did not arrive within {self.timeout_s:g} s")
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, None)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope, receive, send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else f"over {self.max_bytes} bytes"
        response = error_response(413, f"the request body is too large ({size}; at most {self.max_bytes} bytes, "
                                  "--max-body-bytes)")
        await response(scope, receive, send)


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``http=`` of ``uvicorn.Config``) with a header deadline: from a new
    connection, or the first byte of a next request on a kept-alive one, to the end of that request's headers.
    Past it the client gets a bare 408 and the connection is closed. The deadline also bounds how long an unread
    body is drained after an early answer (413)."""

    class HeaderDeadlineProtocol(H11Protocol):  # h11 always: httptools (from ray[serve]) reads headers otherwise
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = None
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting_headers():
                self._arm_header_timer()
            else:
                self._disarm_header_timer()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            """No request is being handled: bytes that arrive belong to the headers of the next one."""
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            if self._header_timer is None and not self.transport.is_closing():
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._awaiting_headers() and not self.transport.is_closing():
                if self.cycle is None:  # nothing was answered on this connection yet: say why it is closed
                    self.transport.write(RAW_408)
                self.transport.close()

    return HeaderDeadlineProtocol
