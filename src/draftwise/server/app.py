"""The OpenAI-compatible HTTP server (FastAPI): ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` (translated to a chat completion, :mod:`draftwise.server.responses_api`), ``/health`` and
``/metrics`` (and, with ``ServerSettings.enable_docs``, ``/openapi.json``, ``/docs`` and
``/redoc``, behind the API key when one is set).

Build it with :func:`create_app` from an :class:`EngineBundle` (see :func:`draftwise.builder.build_engine`)
and run it with :func:`draftwise.server.serving.serve` (uvicorn, with the graceful shutdown described in
``docs/server.md``), or with any ASGI server. All state lives in the app instance.

A generation request goes: route (here) -> request validation (:mod:`draftwise.server.validation`: the body
becomes a :class:`GenerationRequest`, or a 4xx :class:`RequestError`) -> the engine loop
(:mod:`draftwise.server.engine_loop`, which steps the engine core in its thread and posts the request's events,
:mod:`draftwise.server.events`) -> the response (here, shaped by :mod:`draftwise.server.responses`). Any failure
after validation is a 5xx.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from draftwise import __version__
from draftwise.builder import EngineBundle
from draftwise.server.body import JSONBodyRoute
from draftwise.server.engine_loop import EngineLoop
from draftwise.server.errors import (
    APIError,
    ErrorBoundaryMiddleware,
    RequestError,
    error_body,
    install_error_handlers,
    validation_error,
)
from draftwise.logprobs import TokenLogprob, cumulative_logprob
from draftwise.server.events import Failed, Finished, QueueFullError, RequestHandle, ServerClosingError, TextDelta
from draftwise.server.logprobs import (
    CompletionLogprobs,
    TokenBytes,
    chat_logprobs,
    joined_logprobs,
    prompt_logprobs_field,
)
from draftwise.server.metrics import ServerMetrics
from draftwise.server.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware, bearer_token
from draftwise.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, Usage
from draftwise.server.responses import (
    SSE_DONE,
    chat_body,
    chat_choice,
    chat_chunk,
    completion_body,
    completion_choice,
    completion_chunk,
    make_usage,
    sse,
    usage_chunk,
)
from draftwise.server.responses_api import ChatOutcome, build_response, conversation, new_response_id, to_chat
from draftwise.server.responses_protocol import InputItem, ResponsesInputError, ResponsesRequest
from draftwise.server.responses_store import ResponseStore
from draftwise.server.responses_stream import ResponsesStream, sse_event
from draftwise.server.settings import ServerSettings
from draftwise.server.text import TextCodec
from draftwise.server.tool_parsers.base import request_call_ids
from draftwise.server.validation import EngineLimits, GenerationRequest, RequestValidator, cache_scope
from draftwise.stats import choices_stats

__all__ = ["create_app", "ServerState"]

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """Everything one app serves with (kept on ``app.state.draftwise``)."""

    bundle: EngineBundle
    settings: ServerSettings
    validator: RequestValidator
    engine_loop: EngineLoop
    metrics: ServerMetrics
    created: int
    response_store: ResponseStore  # conversations of kept /v1/responses answers (previous_response_id)
    token_bytes: TokenBytes  # ids -> each token's bytes (logprobs' token strings)

    @property
    def model_name(self) -> str:
        """The primary served model name."""
        return self.validator.served_names[0]

    def begin_shutdown(self) -> None:
        """Start a graceful shutdown (call when the server stops accepting connections, e.g. on SIGTERM):
        new and waiting requests get 503 ``server_closing``; the running one gets ``settings.shutdown_grace_s``
        seconds to finish, then fails with ``server_closing`` too. Idempotent."""
        self.engine_loop.close(self.settings.shutdown_grace_s)

    def usage(self, request: GenerationRequest, finished: list[Finished]) -> Usage:
        """The response's usage object over its choices' ``finished`` events (OpenAI's counts: the prompt once,
        the completion tokens of every choice generated summed, ``best_of``'s unreturned ones too, as OpenAI bills
        them; cached prompt tokens, and the speculative statistics summed over
        the choices: the method and K this request used, ``"plain"`` and 0 when it turned speculation off)."""
        k = self.bundle.core.num_speculative_tokens
        if request.num_speculative_tokens is not None:
            k = request.num_speculative_tokens
        method = self.bundle.method if k > 0 else "plain"
        ordered = sorted(finished, key=lambda event: event.index)
        return make_usage(len(request.prompt_ids), sum(event.completion_tokens for event in ordered),
                          choices_stats([event.stats for event in ordered]), method, k)


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
        state.engine_loop.start()
        logger.info("serving %s (%s) as %s%s", bundle.target.name, bundle.method,
                    ", ".join(state.validator.served_names),
                    f", up to {bundle.core.max_num_seqs} requests at once (continuous batching)"
                    if bundle.core.max_num_seqs > 1 else ", one request at a time")
        yield
        await run_in_threadpool(state.engine_loop.shutdown)

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
    core = bundle.core
    codec = TextCodec(bundle.target, settings.chat_template, settings.tokenizer_copies)
    validator = RequestValidator(codec, EngineLimits.of(core), settings, bundle.target.name)
    metrics = ServerMetrics(validator.served_names[0])
    engine_loop = EngineLoop(core, codec.decode, metrics.record, settings.max_waiting_requests,
                             record_step=metrics.record_step)
    metrics.track_queue(lambda: engine_loop.num_running, lambda: engine_loop.num_waiting)
    token_bytes = partial(codec.token_bytes, vocab_size=core.backend.vocab_size)
    return ServerState(bundle, settings, validator, engine_loop, metrics, int(time.time()), ResponseStore(),
                       token_bytes)


# ---------------------------------------------------------------------- routes
def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        """200 ``{"status": "ok"}`` while the engine serves requests, with the queue state and how many requests
        run at once; 503 ``{"status": "unhealthy", "reason": ...}`` when its thread has died or after repeated
        engine failures (:class:`~draftwise.server.health.EngineHealth`: every failure after validation counts),
        so a load balancer stops sending."""
        loop = state.engine_loop
        body = {"status": "ok", "model": state.model_name, "method": state.bundle.method,
                "requests_running": loop.num_running, "requests_waiting": loop.num_waiting,
                "max_num_seqs": state.bundle.core.max_num_seqs,
                "consecutive_engine_failures": loop.health.consecutive_failures}
        reason = loop.unhealthy_reason()
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
        return ModelList(data=[_model_card(state, name) for name in state.validator.served_names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        """One served model, or 404."""
        return _model_card(state, state.validator.check_model(model_id)).model_dump()


def _model_card(state: ServerState, name: str) -> ModelCard:
    target = state.bundle.target
    return ModelCard(id=name, created=state.created, root=state.validator.target_name,
                     max_model_len=target.backend.max_context, speculative_method=state.bundle.method)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completions, streamed or not."""
        prepared = await run_in_threadpool(state.validator.completion, body, _api_key(request))
        return await _respond(state, request, prepared, _CompletionFormat(prepared, state.token_bytes), body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions, streamed or not."""
        prepared = await run_in_threadpool(state.validator.chat, body, _api_key(request))
        return await _respond(state, request, prepared, _ChatFormat(prepared, state.token_bytes), body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API (the subset agents send), served as the equivalent chat completion."""
        api_key = _api_key(request)
        scope = cache_scope(api_key, None)
        history, chat = _responses_chat(state, body, scope)
        prepared = await run_in_threadpool(state.validator.chat, chat, api_key)
        created_at, response_id = time.time(), new_response_id()
        fmt = _ChatFormat(prepared, state.token_bytes)
        if body.stream:
            translator = ResponsesStream(body, response_id=response_id, created_at=created_at, model=prepared.model)
            events = _responses_events(state, _submit(state, prepared), fmt, translator, scope, history)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        chat_reply = await _chat_reply(state, request, prepared, fmt)
        if chat_reply is None:
            return Response(status_code=499)
        response = build_response(body, ChatOutcome.from_chat_body(chat_reply), response_id=response_id,
                                  created_at=created_at)
        _keep_response(state, body, scope, history, response)
        return JSONResponse(response)


def _responses_chat(state: ServerState, body: ResponsesRequest, scope: str,
                    ) -> tuple[tuple[InputItem, ...], ChatCompletionRequest]:
    """The kept conversation ``previous_response_id`` names and the chat request ``body`` becomes.

    Raises:
        RequestError: an unknown ``previous_response_id``, an input item or field this server does not serve,
            or a translated request the chat endpoint refuses (named by its chat field).
    """
    try:
        history = state.response_store.history(scope, body.previous_response_id) if body.previous_response_id \
            else ()
        return history, ChatCompletionRequest.model_validate(to_chat(body, history))
    except ResponsesInputError as exc:
        raise RequestError(exc.message, param=exc.param) from exc
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from exc


def _keep_response(state: ServerState, body: ResponsesRequest, scope: str, history: tuple[InputItem, ...],
                   response: dict) -> None:
    """Keep a finished response's conversation for a later ``previous_response_id`` (unless ``store: false``)."""
    if body.store is not False and response.get("status") != "failed":
        state.response_store.keep(scope, response["id"], conversation(body, history, response))


@dataclass
class _Collected:
    """One choice's whole output as the events brought it: its index, text, its tokens' logprobs (when asked
    for), the prompt's (when asked for), and its end."""

    index: int
    finished: Finished | None = None
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finish_reason(self) -> str:
        return self.finished.finish_reason

    def add(self, delta: TextDelta) -> None:
        self.parts.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


class _CompletionFormat:
    """Shapes of ``/v1/completions`` bodies and chunks, for each of the request's choices (``index``), with
    OpenAI's legacy ``logprobs`` object and vLLM's ``prompt_logprobs`` when the client asked for them (its fields,
    :attr:`GenerationRequest.logprobs`: the engine may compute more). With ``echo``, each choice's text starts
    with the prompt's (streamed: in each choice's first chunk), and with ``logprobs`` too its ``logprobs`` start
    with the prompt's tokens' (streamed: on the choice's first delta, which brings the prompt's logprobs, so the
    echoed text waits for it)."""

    object_name = "text_completion"

    def __init__(self, request: GenerationRequest, token_bytes: TokenBytes) -> None:
        self.request_id, self.model, self.created = request.request_id, request.model, int(time.time())
        self.n, self.echo = request.n, request.echo
        self.token_bytes = token_bytes
        self.num_logprobs, self.num_prompt_logprobs = request.logprobs, request.prompt_logprobs
        self.wants_logprobs = request.logprobs is not None
        self.prompt_ids = request.prompt_ids
        self._echoes_logprobs = bool(self.echo) and self.wants_logprobs
        self._offsets = [CompletionLogprobs(token_bytes) for _ in range(self.n)]  # text_offset runs on per choice

    def opening(self, include_usage: bool) -> list[dict]:
        if not self.echo or self._echoes_logprobs:
            return []
        return [completion_chunk(self.request_id, self.created, self.model, self.echo, None, include_usage, index)
                for index in range(self.n)]

    def delta(self, event: TextDelta, include_usage: bool) -> list[dict]:
        echoed = self._echoes_logprobs and event.prompt_logprobs is not None  # the choice's first delta
        text = self.echo + event.text if echoed else event.text
        logprobs = self._logprobs(self._offsets[event.index], event.logprobs, event.prompt_logprobs)
        return [completion_chunk(self.request_id, self.created, self.model, text, None, include_usage,
                                 event.index, logprobs, self._prompt(event.prompt_logprobs))]

    def closing(self, finish_reason: str, index: int, include_usage: bool) -> list[dict]:
        return [completion_chunk(self.request_id, self.created, self.model, "", finish_reason, include_usage,
                                 index)]

    def body(self, choices: list[_Collected], usage: Usage) -> dict:
        return completion_body(self.request_id, self.model, [self._choice(c) for c in choices], usage)

    def _choice(self, choice: _Collected):
        logprobs = self._logprobs(CompletionLogprobs(self.token_bytes), choice.logprobs, choice.prompt_logprobs)
        return completion_choice(choice.index, self.echo + choice.text, choice.finish_reason, logprobs,
                                 self._prompt(choice.prompt_logprobs))

    def _logprobs(self, offsets: CompletionLogprobs, entries: Sequence[TokenLogprob],
                  prompt_entries: Sequence[TokenLogprob | None] | None) -> dict | None:
        """The ``logprobs`` object of a choice's tokens ``entries`` (a delta's, or all), when the client asked;
        with ``echo``, led by the prompt's tokens' when ``prompt_entries`` (the engine's prompt logprobs) come."""
        if not self.wants_logprobs:
            return None
        if self._echoes_logprobs and prompt_entries is not None:
            prompt = offsets.prompt(self.prompt_ids, prompt_entries, self.num_logprobs)
            return joined_logprobs(prompt, offsets.next(entries))
        return offsets.next(entries)

    def _prompt(self, entries: Sequence[TokenLogprob | None] | None) -> list | None:
        """vLLM's ``prompt_logprobs`` field when the client asked for it (None otherwise)."""
        if entries is None or self.num_prompt_logprobs is None:
            return None
        return prompt_logprobs_field(entries, self.token_bytes, self.num_prompt_logprobs)


class _ChatFormat(_CompletionFormat):
    """Shapes of ``/v1/chat/completions`` bodies and chunks (each choice's first chunk carries the role).

    With a tool parser (a request with tools), each choice's reply is read for tool calls: streamed, its
    accumulated text is re-parsed at every delta (a speculative step may add several tokens at once), content is
    sent up to a possible call marker and each call as OpenAI's tool-call deltas; the finish reason of a reply
    that made calls is ``tool_calls``. A delta's token logprobs ride on its first chunk (on an empty delta ``{}``
    when the parser holds its text back). vLLM's ``prompt_logprobs`` are the request's, not a choice's: on the
    body, and streamed on the first chunk of choice 0 that carries them.
    """

    object_name = "chat.completion.chunk"

    def __init__(self, request: GenerationRequest, token_bytes: TokenBytes) -> None:
        super().__init__(request, token_bytes)
        self.parser = request.tool_parser
        self._prompt_ids = request.prompt_ids
        self._calls = None if self.parser is None else [
            self.parser.stream(request_call_ids(self.parser, request.prompt_ids, index)) for index in range(self.n)]
        self._texts = [""] * self.n

    def opening(self, include_usage: bool) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None, index, include_usage)
                for index in range(self.n)]

    def delta(self, event: TextDelta, include_usage: bool) -> list[dict]:
        index = event.index
        if self._calls is None:
            deltas = [{"content": event.text}] if event.text else []
        else:
            self._texts[index] += event.text
            deltas = list(self._calls[index].feed(self._texts[index]))
        logprobs = chat_logprobs(event.logprobs, self.token_bytes) if self.wants_logprobs else None
        prompt = self._prompt(event.prompt_logprobs) if index == 0 else None
        if not deltas and (event.logprobs or prompt is not None):
            deltas = [{}]
        return [self._chunk(delta, None, index, include_usage, *((logprobs, prompt) if i == 0 else ()))
                for i, delta in enumerate(deltas)]

    def closing(self, finish_reason: str, index: int, include_usage: bool) -> list[dict]:
        if self._calls is None:
            return [self._chunk({}, finish_reason, index, include_usage)]
        calls = self._calls[index]
        chunks = [self._chunk(delta, None, index, include_usage) for delta in calls.finish(self._texts[index])]
        if calls.tool_calls_sent and finish_reason == "stop":
            finish_reason = "tool_calls"
        return chunks + [self._chunk({}, finish_reason, index, include_usage)]

    def body(self, choices: list[_Collected], usage: Usage) -> dict:
        prompt = next((self._prompt(c.prompt_logprobs) for c in choices if c.prompt_logprobs is not None), None)
        return chat_body(self.request_id, self.model, [self._choice(c) for c in choices], usage, prompt)

    def _choice(self, choice: _Collected):
        logprobs = chat_logprobs(choice.logprobs, self.token_bytes) if self.wants_logprobs else None
        if self.parser is None:
            return chat_choice(choice.index, choice.text, choice.finish_reason, logprobs=logprobs)
        parsed = self.parser.extract(choice.text, request_call_ids(self.parser, self._prompt_ids, choice.index))
        calls = [call.to_openai() for call in parsed.tool_calls]
        finish_reason = "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason
        return chat_choice(choice.index, parsed.content, finish_reason, calls, logprobs)

    def _chunk(self, delta: dict, finish_reason: str | None, index: int, include_usage: bool,
               logprobs: dict | None = None, prompt_logprobs: list | None = None) -> dict:
        return chat_chunk(self.request_id, self.created, self.model, delta, finish_reason, include_usage, index,
                          logprobs, prompt_logprobs)


async def _respond(state: ServerState, request: Request, prepared: GenerationRequest, fmt: _CompletionFormat,
                   body) -> Response:
    handle = _submit(state, prepared)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_stream_events(state, handle, fmt, include_usage), media_type="text/event-stream",
                                 headers=headers)
    reply = await _reply(state, request, prepared, fmt, handle)
    if reply is None:
        return Response(status_code=499)  # client closed the request; nobody reads this
    return JSONResponse(reply)


async def _chat_reply(state: ServerState, request: Request, prepared: GenerationRequest,
                      fmt: _CompletionFormat) -> dict | None:
    """Run a request to its end and return its (chat or completion) body; None when the client left."""
    return await _reply(state, request, prepared, fmt, _submit(state, prepared))


async def _reply(state: ServerState, request: Request, prepared: GenerationRequest, fmt: _CompletionFormat,
                 handle: RequestHandle) -> dict | None:
    collected = await _collect(handle, request, state.settings.disconnect_poll_s)
    if collected is None:
        return None
    usage = state.usage(prepared, [choice.finished for choice in collected])
    return fmt.body(_best(collected, prepared.returned), usage)


def _best(choices: list[_Collected], returned: int | None) -> list[_Collected]:
    """``best_of``: the ``returned`` choices with the highest cumulative logprob (the sum of their tokens',
    :func:`~draftwise.logprobs.cumulative_logprob`), best first and numbered 0..returned-1, as vLLM does; every
    choice when ``returned`` is None."""
    if returned is None:
        return choices
    ranked = sorted(choices, key=lambda choice: cumulative_logprob(choice.logprobs), reverse=True)[:returned]
    return [replace(choice, index=index) for index, choice in enumerate(ranked)]


def _api_key(request: Request) -> str | None:
    """The bearer token the request sent (its cache scope is kept apart by it), or None."""
    token = bearer_token(request.headers.get("authorization", "").encode("latin-1"))
    return token.decode("latin-1") if token else None


def _submit(state: ServerState, prepared: GenerationRequest) -> RequestHandle:
    try:
        return state.engine_loop.submit(prepared)
    except QueueFullError as exc:
        raise APIError(503, f"the server is overloaded: {exc}", code="queue_full") from exc
    except ServerClosingError as exc:
        raise APIError(503, str(exc), code="server_closing") from exc


def _failure(error: BaseException) -> APIError:
    """A failure after the request was queued, as an API error: always the server's (a 5xx, whatever the
    exception's type; the client's faults were refused by validation): 503 ``server_closing`` for a shutdown,
    else 500."""
    if isinstance(error, ServerClosingError):
        return APIError(503, str(error), code="server_closing")
    return APIError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error")


async def _watch_disconnect(request: Request, handle: RequestHandle, poll_s: float) -> None:
    """Cancel the request when its (non-streaming) client disconnects."""
    while not handle.done:
        await asyncio.sleep(poll_s)
        if await request.is_disconnected():
            logger.info("%s: client disconnected; cancelling", handle.request.request_id)
            handle.cancel()
            return


async def _collect(handle: RequestHandle, request: Request, poll_s: float) -> list[_Collected] | None:
    """Wait for a whole generation: each of its choices (in index order) with its :class:`Finished`; None if the
    client left first.

    Raises:
        APIError: the generation failed.
    """
    watcher = asyncio.create_task(_watch_disconnect(request, handle, poll_s))
    collected = [_Collected(index) for index in range(handle.request.n)]
    try:
        while True:
            event = await handle.next_event()
            if isinstance(event, TextDelta):
                collected[event.index].add(event)
            elif isinstance(event, Finished):
                collected[event.index].finished = event
                if handle.done:
                    return collected
            elif isinstance(event, Failed):
                raise _failure(event.error)
            else:
                return None
    finally:
        watcher.cancel()
        handle.cancel()


async def _chunks(state: ServerState, handle: RequestHandle, fmt: _CompletionFormat,
                  include_usage: bool) -> AsyncIterator[dict]:
    """The request's chunks in OpenAI's format (dicts), then its usage chunk when asked; a failure is one
    OpenAI error body (``{"error": ...}``) and ends the chunks. Stops early, without an error, when the request
    was cancelled. ``finally`` cancels the generation (the client left and the response task was cancelled)."""
    finished: list[Finished] = []
    try:
        for chunk in fmt.opening(include_usage):
            yield chunk
        while True:
            event = await handle.next_event()
            if isinstance(event, TextDelta):
                for chunk in fmt.delta(event, include_usage):
                    yield chunk
            elif isinstance(event, Finished):
                for chunk in fmt.closing(event.finish_reason, event.index, include_usage):
                    yield chunk
                finished.append(event)
                if not handle.done:
                    continue
                if include_usage:
                    usage = state.usage(handle.request, finished)
                    yield usage_chunk(fmt.request_id, fmt.created, fmt.model, fmt.object_name, usage)
                return
            elif isinstance(event, Failed):
                error = _failure(event.error)
                yield error_body(error.message, error.type, error.param, error.code)
                return
            else:
                raise asyncio.CancelledError  # cancelled: no [DONE]
    finally:
        handle.cancel()


async def _stream_events(state: ServerState, handle: RequestHandle, fmt: _CompletionFormat,
                         include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``."""
    try:
        async for chunk in _chunks(state, handle, fmt, include_usage):
            yield sse(chunk)
    except asyncio.CancelledError:
        return
    yield SSE_DONE


async def _responses_events(state: ServerState, handle: RequestHandle, fmt: _CompletionFormat,
                            translator: ResponsesStream, scope: str, history: tuple[InputItem, ...],
                            ) -> AsyncIterator[str]:
    """``/v1/responses`` streaming: the chat chunks translated into the Responses events (no ``[DONE]``);
    the finished response's conversation is kept for ``previous_response_id``."""
    for event in translator.start():
        yield sse_event(event)
    try:
        async for chunk in _chunks(state, handle, fmt, include_usage=True):
            if "error" in chunk:
                events = translator.fail(chunk["error"]["message"])
            else:
                events = translator.feed(chunk)
                if chunk.get("usage") and not chunk.get("choices"):  # the usage chunk ends the stream
                    events += translator.finish()
            for event in events:
                yield sse_event(event)
    except asyncio.CancelledError:
        return
    if translator.response is not None:
        _keep_response(state, translator.request, scope, history, translator.response)
