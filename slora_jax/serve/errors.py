"""Every failure answered in one JSON shape, ``{"error": {"message", "type", "param", "code"}}``, never FastAPI's 422.

Handlers raise :class:`~slora_jax.serve.protocol.APIError`; validation errors, Starlette's HTTP errors (404, 405)
and anything unexpected are translated here, so no route has to think about the error format.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import APIError, error_body

log = logging.getLogger("slora_jax.serve")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """One readable line for a body that failed validation (malformed JSON, missing or mistyped fields)."""
    parts = []
    for err in exc.errors()[:3]:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', 'cannot parse')}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "missing" and not loc:
            return "the request body is missing (expected a JSON object)"
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    headers = None if exc.retry_after_s is None else {"Retry-After": str(math.ceil(exc.retry_after_s))}
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def validation_param(exc: RequestValidationError) -> str | None:
    """The top-level field the first validation error is in (OpenAI's ``param``), None for the body as a whole."""
    for err in exc.errors()[:1]:
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if loc and isinstance(loc[0], str) and err.get("type") != "json_invalid":
            return loc[0]
    return None


async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(400, validation_message(exc), validation_param(exc))


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _timed_out(_: Request, exc: TimeoutError) -> JSONResponse:
    """A wait (on the engine, mostly) that no route turned into its own answer: the server gave up on it, which is
    a 504, not an internal error."""
    message = f"timed out: {exc}" if str(exc) else "timed out waiting for the engine"
    return JSONResponse(error_body(504, message, None, "timeout_error"), status_code=504)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(TimeoutError, _timed_out)
    app.add_exception_handler(Exception, _unexpected)
