"""ASGI middleware that guards the app before any route runs: the API key check and the request body size limit.

Both answer with an OpenAI-style JSON error (a 4xx :class:`~draftwise.server.errors.RequestError`) without
touching the route, so an unauthenticated or oversized request costs neither JSON parsing nor tokenization.
"""

from __future__ import annotations

import hmac
import logging

from draftwise.server.errors import RequestError

__all__ = ["ApiKeyMiddleware", "BodySizeLimitMiddleware", "bearer_token"]

logger = logging.getLogger(__name__)


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of an ``Authorization`` header value when its scheme is ``Bearer`` (matched
    case-insensitively, as RFC 7235 section 2.1 requires), else None. ``b"bearer  KEY "`` gives ``b"KEY"``."""
    scheme, _, credentials = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return credentials.strip() or None


class ApiKeyMiddleware:
    """``/v1/*`` requests (and those to ``protected_paths``) need ``Authorization: Bearer <api_key>``, else 401
    ``invalid_api_key`` (checked before the body is read, so an unauthenticated client learns nothing else).
    ``/health`` and ``/metrics`` stay open.

    Args:
        app: the ASGI app to guard.
        api_key: the key (non-empty; compared in constant time).
        protected_paths: exact paths guarded as well (the API docs, when they are served).
    """

    def __init__(self, app, api_key: str, protected_paths: tuple[str, ...] = ()) -> None:
        if not api_key:
            raise ValueError("api_key must be non-empty")
        self.app = app
        self._expected = api_key.encode()
        self._protected_paths = frozenset(protected_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]) and not self._authorized(scope):
            error = RequestError("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key", status=401)
            await error.to_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1") or path in self._protected_paths

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                token = bearer_token(value)
                return token is not None and hmac.compare_digest(token, self._expected)
        return False


class _BodyTooLarge(Exception):
    """The request body passed the limit while it was being received."""


class BodySizeLimitMiddleware:
    """Rejects request bodies larger than ``max_bytes`` with 413 ``request_too_large``.

    A ``Content-Length`` above the limit is refused before any byte of the body is read. Otherwise the body is
    received here, counting bytes as they arrive (a chunked upload has no ``Content-Length``), and refused as
    soon as the count passes the limit; a body within the limit is handed to the app unchanged. The 413 carries
    ``Connection: close``, since the rest of the body is never read.

    Args:
        app: the ASGI app to guard.
        max_bytes: the largest body accepted, in bytes.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"{declared} bytes")
            return
        try:
            body = await self._receive_body(receive)
        except _BodyTooLarge:
            await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
            return
        if body is None:  # the client left during the upload: nobody to answer
            return
        await self.app(scope, _replay(body, receive), send)

    async def _receive_body(self, receive) -> bytes | None:
        """The whole body, or None when the client left first."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyTooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, scope, receive, send, size: str) -> None:
        logger.info("refused a %s request body to %s (limit %d bytes)", size, scope.get("path"), self.max_bytes)
        error = RequestError(f"the request body is too large ({size}): this server accepts at most "
                             f"{self.max_bytes} bytes (--max-request-bytes)", code="request_too_large", status=413)
        await error.to_response(headers={"Connection": "close"})(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server rejects malformed lengths itself
    return None


def _replay(body: bytes, receive):
    """A ``receive`` that first returns the buffered body in one message, then defers to the real one (so
    the app still learns about a client disconnect)."""
    pending = True

    async def replayed():
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
