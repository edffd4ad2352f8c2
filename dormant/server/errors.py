"""Typed JSON errors: every refusal is ``{"error": {"message", "type", "code"}}`` (OpenAI's
envelope) with a status that says whose fault it is.

| status | when                                                                           |
|--------|--------------------------------------------------------------------------------|
| 400    | a malformed or unsatisfiable request (validation, bad values, bad token ids,   |
|        | IPC handles or a bucket that cannot be applied)                                |
| 401    | a missing or wrong API key or admin token                                      |
| 403    | an admin route on a non-loopback bind without a token; a foreign Origin/Host  |
| 404    | an unknown route, or a model name this server does not serve                   |
| 409    | a sleep that conflicts with the current sleep state                            |
| 413    | a body over the size limit                                                     |
| 415    | a JSON route without ``Content-Type: application/json``                        |
| 501    | the engine lacks what the route needs (a refit API not built yet)              |
| 503    | the engine cannot serve now: asleep, weights not refit, out of memory on wake  |
| 500    | anything else (the message says what; no traceback is sent)                    |
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dormant.core.errors import (
    EngineAsleepError,
    EngineDeadError,
    EngineError,
    InvalidSamplingParamsError,
    SleepModeDisabledError,
    UnknownRpcMethodError,
)
from dormant.memory.errors import (
    MemoryLayerError,
    SleepConflictError,
    TagAsleepError,
    UnknownTagError,
    WakeOutOfMemoryError,
)
from dormant.worker.transfer_errors import WeightTransferError

logger = logging.getLogger("dormant.server")


class ServerError(Exception):
    """An error with its HTTP status; ``kind`` is the ``type`` field of the body."""

    status: HTTPStatus = HTTPStatus.BAD_REQUEST

    def __init__(self, message: str, status: HTTPStatus | None = None, kind: str = "") -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.kind = kind or type(self).__name__


class BadRequestError(ServerError):
    status = HTTPStatus.BAD_REQUEST


class NotServedError(ServerError):
    status = HTTPStatus.NOT_FOUND


class UnauthorizedError(ServerError):
    status = HTTPStatus.UNAUTHORIZED


class ForbiddenError(ServerError):
    status = HTTPStatus.FORBIDDEN


class ClientGoneError(ServerError):
    """The client closed its connection before the reply: its requests were aborted, and this
    answer is never read."""


class NotImplementedByEngineError(ServerError):
    """The engine has no method the route needs; the message names it."""

    status = HTTPStatus.NOT_IMPLEMENTED


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": int(status)}}


def error_response(message: str, kind: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=int(status))


def status_of(error: BaseException) -> HTTPStatus:
    """The status an engine or server error answers with (see the module's table)."""
    if isinstance(error, ServerError):
        return error.status
    if isinstance(error, SleepConflictError):
        return HTTPStatus.CONFLICT
    unavailable = (EngineAsleepError, TagAsleepError, WakeOutOfMemoryError, EngineDeadError)
    if isinstance(error, unavailable):
        return HTTPStatus.SERVICE_UNAVAILABLE
    refused = (
        InvalidSamplingParamsError,
        UnknownRpcMethodError,
        UnknownTagError,
        SleepModeDisabledError,
        WeightTransferError,  # the request's handles or bucket could not be applied
        ValueError,
        TypeError,
    )
    if isinstance(error, refused):
        return HTTPStatus.BAD_REQUEST
    return HTTPStatus.INTERNAL_SERVER_ERROR


def from_exception(error: BaseException) -> JSONResponse:
    status = status_of(error)
    kind = error.kind if isinstance(error, ServerError) else type(error).__name__
    message = str(error) or type(error).__name__
    if status is HTTPStatus.INTERNAL_SERVER_ERROR and not isinstance(error, MemoryLayerError):
        logger.error("internal error: %s: %s", kind, message, exc_info=error)
    return error_response(message, kind, status)


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    """Validation errors answer 400 (not FastAPI's 422), HTTP errors and engine errors get
    the typed body, and nothing answers with a traceback."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(_validation_message(error), "BadRequestError", 400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = getattr(error, "kind", None) or {
            404: "NotFoundError",
            405: "MethodNotAllowedError",
        }.get(error.status_code, HTTPStatus(error.status_code).phrase.replace(" ", ""))
        message = str(error.detail)
        if error.status_code == 404 and not hasattr(error, "kind"):
            message = f"no route {request.method} {request.url.path}; see /openapi.json"
        return error_response(message, kind, error.status_code)

    async def on_error(request: Request, error: Exception) -> JSONResponse:
        return from_exception(error)

    # Specific classes are answered by Starlette's ExceptionMiddleware, which does not
    # re-raise (a handler for Exception itself would log a traceback after answering).
    for kind in (ServerError, EngineError, MemoryLayerError, ValueError, TypeError, KeyError):
        app.add_exception_handler(kind, on_error)
    app.add_exception_handler(Exception, on_error)
