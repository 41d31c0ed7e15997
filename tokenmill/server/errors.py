"""Every failure a client can see, mapped to an HTTP status and an OpenAI-style body in one place:
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.process_client import EngineDeadError
from tokenmill.errors import (
    ContextTooLong,
    InvalidRequest,
    RequestFailed,
    ServerBusy,
    ServerOverloaded,
    ServerShuttingDown,
    TokenmillError,
)


class APIError(Exception):
    """An error raised by the HTTP layer itself (not the engine)."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BadRequest(APIError):
    """Malformed JSON, a wrong content type, a field of the wrong type."""


class Unauthorized(APIError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class ModelNotFound(APIError):
    status, type, code = 404, "not_found_error", "model_not_found"


class NotFound(APIError):
    status, type, code = 404, "not_found_error", None


class MethodNotAllowed(APIError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RequestTooLarge(APIError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class InternalError(APIError):
    """A bug: said as such, without internals (the traceback goes to the log)."""

    status, type, code = 500, "internal_error", "internal_error"


# exception class -> (status, type, code), first match wins; APIError subclasses carry their own.
_MAPPING: list[tuple[type[BaseException], int, str, str | None]] = [
    (ContextTooLong, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequest, 400, "invalid_request_error", "invalid_value"),
    (ServerOverloaded, 429, "server_overloaded", "server_overloaded"),
    (EngineDeadError, 503, "service_unavailable", "engine_dead"),
    (ServerBusy, 503, "service_unavailable", "server_busy"),
    (ServerShuttingDown, 503, "service_unavailable", "server_shutting_down"),
    (RequestFailed, 500, "internal_error", "request_failed"),
]


def classify(exc: BaseException) -> tuple[int, dict]:
    """(status, body) for any exception; anything unexpected is a 500 that says so, without internals."""
    if isinstance(exc, APIError):
        return exc.status, error_body(str(exc), exc.type, exc.param, exc.code)
    for cls, status, kind, code in _MAPPING:
        if isinstance(exc, cls):
            return status, error_body(str(exc), kind, getattr(exc, "param", None), code)
    return 500, error_body(f"internal error: {type(exc).__name__}", "internal_error", None, "internal_error")


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's routes answer errors in Anthropic's shape
# our error types -> Anthropic's (invalid_request_error, authentication_error and not_found_error are the same)
_ANTHROPIC_TYPES = {"server_overloaded": "overloaded_error", "service_unavailable": "overloaded_error",
                    "internal_error": "api_error"}


def anthropic_error(body: dict) -> dict:
    """An OpenAI-style error body as Anthropic's: {"type": "error", "error": {"type", "message"}}."""
    error = body["error"]
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error["type"], error["type"]),
                                       "message": error["message"]}}


def classify_for(path: str, exc: BaseException) -> tuple[int, dict]:
    """classify(exc), in the error shape of the API `path` belongs to."""
    status, body = classify(exc)
    return status, anthropic_error(body) if path.startswith(ANTHROPIC_PREFIX) else body


def error_response(exc: BaseException, path: str = "") -> JSONResponse:
    status, body = classify_for(path, exc)
    headers = {"Retry-After": str(getattr(exc, "retry_after", 1))} if status in (429, 503) else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, on_rejected: Callable[[int], None]) -> None:
    """Every error an endpoint raises (ours, FastAPI's validation, no route) as an OpenAI-style body; never 422.
    `on_rejected` counts each by status."""

    def respond(request: Request, exc: BaseException) -> JSONResponse:
        response = error_response(exc, request.url.path)
        on_rejected(response.status_code)
        return response

    @app.exception_handler(TokenmillError)
    async def _tokenmill_error(request: Request, exc: TokenmillError):
        return respond(request, exc)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return respond(request, BadRequest(str(exc.errors()[0].get("msg", "invalid request")) if exc.errors() else
                                           "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return respond(request, NotFound(f"no route {request.method} {request.url.path}"))
        if exc.status_code == 405:
            return respond(request, MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}"))
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)
