"""One engine, many clients: a FIFO queue served by one worker thread.

The engine holds one KV cache, so requests run one at a time, in arrival order (fair: nobody is overtaken).
Generation is synchronous CPU/GPU work, so it runs in a dedicated thread; the asyncio side receives text
deltas through a per-request :class:`asyncio.Queue`. A request whose client leaves is cancelled: if it is
still waiting it is skipped, if it is running its generation is closed at the next engine step and the
engine moves on to the next request.

Text is produced in the worker (detokenization and stop strings, :class:`OutputText`), so a stop string
stops the generation at once, without a round trip through the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from draftwise.engine import SpeculativeEngine
from draftwise.server.metrics import RequestRecord
from draftwise.server.requests import GenerationRequest
from draftwise.server.text import OutputText
from draftwise.stats import SpeculativeStats

__all__ = ["Scheduler", "RequestHandle", "TextDelta", "Finished", "Failed", "Aborted", "QueueFullError",
           "ServerClosingError"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- events (worker -> event loop)
@dataclass(frozen=True)
class TextDelta:
    """New output text (never empty)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The request is complete.

    Attributes:
        finish_reason: ``"stop"`` (EOS, a stop token id or a stop string) or ``"length"``.
        completion_tokens: generated tokens counted for ``usage`` (up to and including the token that
            completed a stop string).
        stats: the engine's statistics for the request.
    """

    finish_reason: str
    completion_tokens: int
    stats: SpeculativeStats


@dataclass(frozen=True)
class Failed:
    """The request failed inside the worker; ``error`` is the exception."""

    error: BaseException


@dataclass(frozen=True)
class Aborted:
    """The request was cancelled on this side (client gone); no more events follow."""


Event = TextDelta | Finished | Failed | Aborted


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should answer 503."""


class ServerClosingError(RuntimeError):
    """The server is shutting down; queued requests are not served."""


class _Job:
    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()

    def post(self, event: Event) -> None:
        """Deliver an event to the event loop (from the worker thread); dropped if the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: nobody is listening any more
            self.cancelled.set()


class RequestHandle:
    """The event-loop side of a queued request. Read events with :meth:`next_event` until a
    :class:`Finished`, :class:`Failed` or :class:`Aborted`; call :meth:`cancel` when the client leaves."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        self.done = False

    @property
    def request(self) -> GenerationRequest:
        """The request being served."""
        return self._job.request

    async def next_event(self) -> Event:
        """Wait for the next event (must be awaited on the loop that submitted the request)."""
        event = await self._job.events.get()
        if isinstance(event, (Finished, Failed, Aborted)):
            self.done = True
        return event

    def cancel(self) -> None:
        """Stop the request (idempotent; call on the event loop): a waiting request is skipped, a running one
        stops at the next engine step; a pending :meth:`next_event` returns :class:`Aborted`."""
        if self.done or self._job.cancelled.is_set():
            return
        self._job.cancelled.set()
        self._job.events.put_nowait(Aborted())


class Scheduler:
    """Serialises requests through one engine in FIFO order.

    Args:
        engine: the engine (one request at a time).
        decode: ids -> text, thread-safe (see :class:`TextCodec`).
        record: called in the worker thread with each request's :class:`RequestRecord` (metrics).
        max_waiting: requests allowed to wait; :meth:`submit` raises :class:`QueueFullError` beyond.
    """

    def __init__(self, engine: SpeculativeEngine, decode: Callable[[list[int]], str],
                 record: Callable[[RequestRecord], None], max_waiting: int) -> None:
        self._engine = engine
        self._decode = decode
        self._record = record
        self._max_waiting = max_waiting
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._running: _Job | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker_loop, name="draftwise-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Cancel the running request, fail the waiting ones, and stop the worker (waits up to timeout_s)."""
        self._closing.set()
        running = self._running
        if running is not None:
            running.cancelled.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", timeout_s)

    @property
    def num_running(self) -> int:
        """1 while a request is being generated, else 0."""
        return 0 if self._running is None else 1

    @property
    def num_waiting(self) -> int:
        """Requests queued behind the running one."""
        return self._queue.qsize()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; call from the event loop that will read its events.

        Raises:
            QueueFullError: more than ``max_waiting`` requests are waiting.
            ServerClosingError: the server is shutting down.
        """
        if self._closing.is_set():
            raise ServerClosingError("the server is shutting down")
        if self._queue.qsize() >= self._max_waiting:
            raise QueueFullError(f"{self._max_waiting} requests are already waiting; retry later")
        self.start()
        job = _Job(request, asyncio.get_running_loop())
        self._queue.put(job)
        return RequestHandle(job)

    # ------------------------------------------------------------------ worker thread
    def _worker_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._closing.is_set():
                job.post(Failed(ServerClosingError("the server is shutting down")))
                continue
            if job.cancelled.is_set():
                self._record_abandoned(job)
                continue
            self._running = job
            try:
                self._execute(job)
            except Exception as exc:  # the engine failed: report it, keep serving
                logger.exception("request %s failed", job.request.request_id)
                job.post(Failed(exc))
                self._record_abandoned(job)
            finally:
                self._running = None

    def _execute(self, job: _Job) -> None:
        request = job.request
        started = time.perf_counter()
        output = OutputText(self._decode, request.prompt_ids, request.stops)
        generation = self._engine.stream(request.prompt_ids, request.params)
        first_token_at = None
        chunks = iter(generation)
        try:
            for chunk in chunks:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                text = output.add_tokens(chunk)
                if text:
                    job.post(TextDelta(text))
                if output.stopped or job.cancelled.is_set():
                    break
        finally:
            chunks.close()  # stops the engine if we left early; fills generation.result
        result = generation.result
        assert result is not None
        aborted = job.cancelled.is_set() and not output.stopped
        if aborted:
            finish_reason = "abort"
        else:
            tail = output.finish()
            if tail:
                job.post(TextDelta(tail))
            finish_reason = "stop" if output.stopped else result.finish_reason
            job.post(Finished(finish_reason, output.num_tokens, result.stats))
        self._finish(job, finish_reason, output.num_tokens, started, first_token_at, result.stats)

    def _finish(self, job: _Job, finish_reason: str, num_tokens: int, started: float,
                first_token_at: float | None, stats: SpeculativeStats) -> None:
        request = job.request
        now = time.perf_counter()
        self._record(RequestRecord(
            finished_reason=finish_reason,
            prompt_tokens=len(request.prompt_ids),
            generation_tokens=num_tokens,
            queue_time_s=started - request.arrival_s,
            ttft_s=None if first_token_at is None else first_token_at - request.arrival_s,
            e2e_s=now - request.arrival_s,
            stats=stats,
        ))
        logger.info(
            "%s: %s, %d prompt + %d generated tokens in %.2f s (queued %.2f s), acceptance %s, tau %.2f",
            request.request_id, finish_reason, len(request.prompt_ids), num_tokens, now - started,
            started - request.arrival_s, stats.acceptance_rate, stats.mean_accepted_length,
        )

    def _record_abandoned(self, job: _Job) -> None:
        request = job.request
        waited = time.perf_counter() - request.arrival_s
        self._record(RequestRecord("abort", len(request.prompt_ids), 0, waited, None, waited, None))
        logger.info("%s: abandoned by its client before it finished", request.request_id)
