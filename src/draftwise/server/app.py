"""The OpenAI-compatible HTTP server (FastAPI): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health`` and ``/metrics`` (and, with ``ServerSettings.enable_docs``, ``/openapi.json``, ``/docs`` and
``/redoc``, behind the API key when one is set).

Build it with :func:`create_app` from an :class:`EngineBundle` (see :func:`draftwise.builder.build_engine`)
and run it with :func:`draftwise.server.serving.serve` (uvicorn, with the graceful shutdown described in
``docs/server.md``), or with any ASGI server. All state lives in the app instance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from draftwise import __version__
from draftwise.builder import EngineBundle
from draftwise.server.body import JSONBodyRoute
from draftwise.server.errors import APIError, ErrorBoundaryMiddleware, error_body, install_error_handlers
from draftwise.server.batch_scheduler import BatchScheduler
from draftwise.server.metrics import ServerMetrics
from draftwise.server.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, bearer_token
from draftwise.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, Usage
from draftwise.server.requests import GenerationRequest, RequestBuilder, TextCodec, cache_scope
from draftwise.server.responses import (
    SSE_DONE,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    make_usage,
    sse,
    usage_chunk,
)
from draftwise.server.scheduler import (
    Failed,
    Finished,
    QueueFullError,
    RequestHandle,
    ServerClosingError,
    TextDelta,
)
from draftwise.server.settings import ServerSettings

__all__ = ["create_app", "ServerState"]

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Everything one app serves with (kept on ``app.state.draftwise``)."""

    bundle: EngineBundle
    settings: ServerSettings
    builder: RequestBuilder
    scheduler: BatchScheduler
    metrics: ServerMetrics
    created: int

    @property
    def model_name(self) -> str:
        """The primary served model name."""
        return self.builder.served_names[0]

    def begin_shutdown(self) -> None:
        """Start a graceful shutdown (call when the server stops accepting connections, e.g. on SIGTERM):
        new and waiting requests get 503 ``server_closing``; the running one gets ``settings.shutdown_grace_s``
        seconds to finish, then fails with ``server_closing`` too. Idempotent."""
        self.scheduler.close(self.settings.shutdown_grace_s)

    def usage(self, request: GenerationRequest, finished: Finished) -> Usage:
        """The response's usage object (OpenAI's counts, cached prompt tokens, and the speculative statistics:
        the method and K this request used, ``"plain"`` and 0 when it turned speculation off)."""
        k = self.bundle.core.num_speculative_tokens
        if request.num_speculative_tokens is not None:
            k = request.num_speculative_tokens
        method = self.bundle.method if k > 0 else "plain"
        return make_usage(len(request.prompt_ids), finished.completion_tokens, finished.stats, method, k)


def create_app(bundle: EngineBundle, settings: ServerSettings | None = None) -> FastAPI:
    """Build the FastAPI app serving one engine.

    Args:
        bundle: the target, optional draft and engine (the app becomes the engine's only user).
        settings: served names, API key, chat template, limits.

    The engine worker thread starts with the app's lifespan (or at the first request) and stops at shutdown.
    """
    settings = settings or ServerSettings()
    state = _build_state(bundle, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        logger.info("serving %s (%s) as %s%s", bundle.target.name, bundle.method, ", ".join(state.builder.served_names),
                    f", up to {bundle.core.max_num_seqs} requests at once (continuous batching)"
                    if bundle.core.max_num_seqs > 1 else ", one request at a time")
        yield
        await run_in_threadpool(state.scheduler.shutdown)

    docs = _docs_paths(settings.enable_docs)
    app = FastAPI(title="draftwise", version=__version__, lifespan=lifespan, openapi_url=docs.openapi,
                  docs_url=docs.swagger, redoc_url=docs.redoc)
    app.router.route_class = JSONBodyRoute  # bodies parsed with errors that name the problem
    app.state.draftwise = state
    install_error_handlers(app)
    # the last added runs first: errors boundary, then the key check, then the body limit
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, protected_paths=docs.all())
    app.add_middleware(ErrorBoundaryMiddleware)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


@dataclass(frozen=True)
class _DocsPaths:
    """Where FastAPI serves the OpenAPI schema and its viewers (None: not served)."""

    openapi: str | None = None
    swagger: str | None = None
    redoc: str | None = None

    def all(self) -> tuple[str, ...]:
        """Every path served for the docs, Swagger UI's OAuth2 redirect page included."""
        paths = (self.openapi, self.swagger, self.swagger and f"{self.swagger}/oauth2-redirect", self.redoc)
        return tuple(path for path in paths if path)


def _docs_paths(enabled: bool) -> _DocsPaths:
    """FastAPI's default docs paths when ``enabled``, else none (the paths are then 404s)."""
    if not enabled:
        return _DocsPaths()
    return _DocsPaths(openapi="/openapi.json", swagger="/docs", redoc="/redoc")


def _build_state(bundle: EngineBundle, settings: ServerSettings) -> ServerState:
    target = bundle.target
    codec = TextCodec(target, settings.chat_template, settings.tokenizer_copies)
    builder = RequestBuilder(codec, target.name, target.backend.max_context, target.backend.vocab_size, settings,
                             max_k=bundle.core.num_speculative_tokens)
    metrics = ServerMetrics(builder.served_names[0])
    scheduler = BatchScheduler(bundle.core, codec.decode, metrics.record, settings.max_waiting_requests,
                               record_step=metrics.record_step)
    metrics.track_queue(lambda: scheduler.num_running, lambda: scheduler.num_waiting)
    return ServerState(bundle, settings, builder, scheduler, metrics, int(time.time()))


# ---------------------------------------------------------------------- routes
def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 ``{"status": "ok"}`` while the engine serves requests, with the queue state and how many requests
        run at once; 503 ``{"status": "unhealthy", "reason": ...}`` when its thread has died or after repeated
        engine failures (:class:`~draftwise.server.scheduler.EngineHealth`), so a load balancer stops sending."""
        body = {"status": "ok", "model": state.model_name, "method": state.bundle.method,
                "requests_running": state.scheduler.num_running, "requests_waiting": state.scheduler.num_waiting,
                "max_num_seqs": state.bundle.core.max_num_seqs,
                "consecutive_engine_failures": state.scheduler.health.consecutive_failures}
        reason = state.scheduler.unhealthy_reason()
        if reason is None:
            return JSONResponse(body)
        return JSONResponse({**body, "status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition."""
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> dict:
        """The served model names (all aliases of the one target)."""
        return ModelList(data=[_model_card(state, name) for name in state.builder.served_names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        """One served model, or 404."""
        return _model_card(state, state.builder.check_model(model_id)).model_dump()


def _model_card(state: ServerState, name: str) -> ModelCard:
    target = state.bundle.target
    return ModelCard(id=name, created=state.created, root=state.builder.target_name,
                     max_model_len=target.backend.max_context, speculative_method=state.bundle.method)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completions, streamed or not."""
        model = state.builder.check_model(body.model)
        prepared = _scoped(await run_in_threadpool(state.builder.completion, body), request, body)
        return await _respond(state, request, prepared, _CompletionFormat(prepared.request_id, model), body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions, streamed or not."""
        model = state.builder.check_model(body.model)
        prepared = _scoped(await run_in_threadpool(state.builder.chat, body), request, body)
        return await _respond(state, request, prepared, _ChatFormat(prepared.request_id, model), body)


class _CompletionFormat:
    """Shapes of ``/v1/completions`` bodies and chunks."""

    object_name = "text_completion"

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def opening(self, include_usage: bool) -> list[dict]:
        return []

    def delta(self, text: str, include_usage: bool) -> dict:
        return completion_chunk(self.request_id, self.created, self.model, text, None, include_usage)

    def closing(self, finish_reason: str, include_usage: bool) -> dict:
        return completion_chunk(self.request_id, self.created, self.model, "", finish_reason, include_usage)

    def body(self, text: str, finish_reason: str, usage: Usage) -> dict:
        return completion_body(self.request_id, self.model, text, finish_reason, usage)


class _ChatFormat(_CompletionFormat):
    """Shapes of ``/v1/chat/completions`` bodies and chunks (the first chunk carries the role)."""

    object_name = "chat.completion.chunk"

    def opening(self, include_usage: bool) -> list[dict]:
        return [chat_chunk(self.request_id, self.created, self.model, {"role": "assistant", "content": ""}, None,
                           include_usage)]

    def delta(self, text: str, include_usage: bool) -> dict:
        return chat_chunk(self.request_id, self.created, self.model, {"content": text}, None, include_usage)

    def closing(self, finish_reason: str, include_usage: bool) -> dict:
        return chat_chunk(self.request_id, self.created, self.model, {}, finish_reason, include_usage)

    def body(self, text: str, finish_reason: str, usage: Usage) -> dict:
        return chat_body(self.request_id, self.model, text, finish_reason, usage)


async def _respond(state: ServerState, request: Request, prepared: GenerationRequest, fmt: _CompletionFormat,
                   body) -> Response:
    handle = _submit(state, prepared)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_stream_events(state, handle, fmt, include_usage), media_type="text/event-stream",
                                 headers=headers)
    collected = await _collect(handle, request, state.settings.disconnect_poll_s)
    if collected is None:
        return Response(status_code=499)  # client closed the request; nobody reads this
    text, finished = collected
    usage = state.usage(prepared, finished)
    return JSONResponse(fmt.body(text, finished.finish_reason, usage))


def _scoped(prepared: GenerationRequest, request: Request, body) -> GenerationRequest:
    """The request with its cache scope: the bearer key it sent and its ``user`` field."""
    token = bearer_token(request.headers.get("authorization", "").encode("latin-1"))
    api_key = token.decode("latin-1") if token else None
    return dataclasses.replace(prepared, scope=cache_scope(api_key, body.user))


def _submit(state: ServerState, prepared: GenerationRequest) -> RequestHandle:
    try:
        return state.scheduler.submit(prepared)
    except QueueFullError as exc:
        raise APIError(503, f"the server is overloaded: {exc}", code="queue_full") from exc
    except ServerClosingError as exc:
        raise APIError(503, str(exc), code="server_closing") from exc


def _failure(error: BaseException) -> APIError:
    """An exception from the worker as an API error (ValueError: the request's fault; else the server's)."""
    if isinstance(error, ServerClosingError):
        return APIError(503, str(error), code="server_closing")
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error")


async def _watch_disconnect(request: Request, handle: RequestHandle, poll_s: float) -> None:
    """Cancel the request when its (non-streaming) client disconnects."""
    while not handle.done:
        await asyncio.sleep(poll_s)
        if await request.is_disconnected():
            logger.info("%s: client disconnected; cancelling", handle.request.request_id)
            handle.cancel()
            return


async def _collect(handle: RequestHandle, request: Request, poll_s: float) -> tuple[str, Finished] | None:
    """Wait for a whole generation; None if the client left first.

    Raises:
        APIError: the generation failed.
    """
    watcher = asyncio.create_task(_watch_disconnect(request, handle, poll_s))
    parts: list[str] = []
    try:
        while True:
            event = await handle.next_event()
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, Finished):
                return "".join(parts), event
            elif isinstance(event, Failed):
                raise _failure(event.error)
            else:
                return None
    finally:
        watcher.cancel()
        handle.cancel()


async def _stream_events(state: ServerState, handle: RequestHandle, fmt: _CompletionFormat,
                         include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``. If the client disconnects,
    the response task is cancelled and ``finally`` cancels the generation."""
    try:
        for chunk in fmt.opening(include_usage):
            yield sse(chunk)
        while True:
            event = await handle.next_event()
            if isinstance(event, TextDelta):
                yield sse(fmt.delta(event.text, include_usage))
            elif isinstance(event, Finished):
                yield sse(fmt.closing(event.finish_reason, include_usage))
                if include_usage:
                    usage = state.usage(handle.request, event)
                    yield sse(usage_chunk(fmt.request_id, fmt.created, fmt.model, fmt.object_name, usage))
                break
            elif isinstance(event, Failed):
                error = _failure(event.error)
                yield sse(error_body(error.message, error.type, error.param, error.code))
                break
            else:
                return
        yield SSE_DONE
    finally:
        handle.cancel()
