"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, for every way a request can fail.

Malformed JSON and validation failures are 400 (as OpenAI and vLLM answer, not FastAPI's 422), an unknown route
404, and anything unexpected a 500 with one log line and no traceback in the body; the server keeps serving.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 503: "overloaded_error"}


class ApiError(Exception):
    """A request the server refuses: its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def respond(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem in words, and the field it names (``messages.0.role``)."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # A union's members appear in the location (``str``, ``list[str]``): drop them from the field's name.
    loc = [part for part in loc if not any(c in part for c in "[]") and part not in ("str", "int", "float")]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return message, param


def install(app: FastAPI, errors_counter: Any = None) -> None:
    """Answer every failure of ``app`` with OpenAI's body; ``errors_counter`` (labelled by status) counts them."""

    def counted(response: JSONResponse) -> JSONResponse:
        if errors_counter is not None:
            errors_counter.labels(status=str(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return counted(respond(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return counted(respond(ApiError(400, message, param=param)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return counted(respond(ApiError(exc.status_code, message, headers=getattr(exc, "headers", None))))

    app.add_middleware(_CatchAll, counter=errors_counter)


class _CatchAll:
    """Turns an exception that escaped a route into a 500 with one log line, where no response has started."""

    def __init__(self, app: ASGIApp, counter: Any = None):
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            log.error(
                "internal error on %s %s: %s: %s", scope.get("method"), scope.get("path"), type(exc).__name__, exc
            )
            if started:
                return
            if self.counter is not None:
                self.counter.labels(status="500").inc()
            body = json.dumps(error_body(500, f"internal error: {type(exc).__name__}")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})
