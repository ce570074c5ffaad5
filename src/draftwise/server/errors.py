"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status.

Whose fault an error is follows from where it is raised, never from its type: a :class:`RequestError` (a 4xx
naming the field at fault) is raised only while a request is checked, before it is queued (request validation,
:mod:`draftwise.server.validation`; the body parser; the API-key and body-size checks), and is the one source
of 4xx. Anything that fails later, a ``ValueError`` from inside the engine included, is the server's: a 5xx
(:class:`APIError` 500, or 503 for a full queue or a shutdown), counted by ``/health``.

Every failure the server can meet (bad JSON, wrong types, out-of-range values, unknown routes, an internal
error) is turned into this body, so clients written for OpenAI report it as they would OpenAI's. The body always
encodes: characters UTF-8 cannot carry (lone surrogates echoed from the request) are written as ``\\udXXX``
escapes. An unexpected exception is answered by :class:`ErrorBoundaryMiddleware` with a JSON 500 that keeps the
connection usable (Starlette's own 500 handler re-raises, and uvicorn then closes the connection).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = ["APIError", "RequestError", "RequestBodyError", "error_body", "encodable", "install_error_handlers",
           "ErrorBoundaryMiddleware"]

logger = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """An error answered with an OpenAI-style body.

    Args:
        status: HTTP status code.
        message: human-readable explanation (what was wrong and what to do).
        param: the request field at fault, if any.
        code: machine-readable code (``"model_not_found"``, ``"context_length_exceeded"``...), if any.
        type: OpenAI error type; default from the status (``invalid_request_error`` for 400).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:  # noqa: A002 - OpenAI's field name
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def to_body(self) -> dict:
        """The JSON body."""
        return error_body(self.message, self.type, self.param, self.code)

    def to_response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """A JSON response with this error's status and body (plus ``headers``)."""
        headers = dict(headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.to_body(), status_code=self.status, headers=headers or None)


class RequestError(APIError):
    """A request refused as the client's fault: a 4xx naming the field at fault, like OpenAI's ``param``.

    Raised only by the checks a request passes before it is queued (see the module docstring).

    Args:
        message: what was wrong and what to do.
        param: the request field at fault (``"prompt"``, ``"messages.0.content"``...), if any.
        code: machine-readable code (``"context_length_exceeded"``, ``"model_not_found"``...), if any.
        status: HTTP status, 400 to 499 (default 400).

    Raises:
        ValueError: a ``status`` outside 400..499.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        if not 400 <= status <= 499:
            raise ValueError(f"a RequestError is a 4xx, got status {status}")
        super().__init__(status, message, param=param, code=code)


class RequestBodyError(StarletteHTTPException):
    """A request body refused while FastAPI parses it, carrying the :class:`APIError` to answer with.

    FastAPI turns any other exception raised while it reads the body into a bare "There was an error parsing
    the body"; an HTTP exception it lets through, and :func:`install_error_handlers` answers this one with
    :attr:`error`.
    """

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.message)
        self.error = error


def encodable(text: str) -> str:
    """``text`` with every character UTF-8 cannot encode (a lone surrogate such as ``\\ud800``) replaced by its
    backslash escape, so a message that quotes user input can always be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,  # noqa: A002
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``; the strings are made encodable (:func:`encodable`)."""
    return {"error": {"message": encodable(message), "type": type,
                      "param": None if param is None else encodable(param),
                      "code": None if code is None else encodable(code)}}


def validation_error(exc: RequestValidationError) -> RequestError:
    """The first pydantic error as a 400 naming the field (``messages.0.content``...). Among a union's
    branches, a value error (the input has a branch's shape but a bad value, such as a lone surrogate) is more
    telling than the other branches' type mismatches, so it wins."""
    errors = exc.errors()
    if not errors:
        return RequestError("invalid request body")
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip())
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if "[key]" in loc:  # a bad dict key: name the dict (pydantic's copy of the key is not the client's text)
        loc = loc[:max(loc.index("[key]") - 1, 0)]
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return RequestError("the request body must be a JSON object (send Content-Type: application/json)")
    # drop pydantic's union-branch names ("str", "list[int]"...) that follow a field name
    param = ".".join(p for p in loc if not (p[:1].islower() and ("[" in p or p in _TYPE_NAMES))) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    if param:
        message = f"invalid value for '{param}': {message}"
    else:
        message = f"invalid request body: {message}"
    return RequestError(message, param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers that turn every exception into an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).to_response()

    @app.exception_handler(RequestBodyError)
    async def _bad_body(request: Request, exc: RequestBodyError) -> JSONResponse:
        return exc.error.to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        return APIError(exc.status_code, message).to_response()


class ErrorBoundaryMiddleware:
    """ASGI middleware (the outermost of the app's own): an unexpected exception is logged and answered with
    an OpenAI-style JSON 500, and the request ends normally, so the client's keep-alive connection stays usable.
    Once a response has started nothing can be sent any more, and the exception propagates.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("internal error while serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            error = APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")
            await error.to_response()(scope, receive, send)
