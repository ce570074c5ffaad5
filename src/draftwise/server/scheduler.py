"""What the server's scheduler is built from: request events and handles, the waiting queue with its
lifecycle (:class:`QueueLifecycle`), and the engine's health (:class:`EngineHealth`).

The one scheduler, :class:`draftwise.server.batch_scheduler.BatchScheduler`, runs every engine (the lean
runtime's many slots, or any backend as one slot) in a dedicated thread; the asyncio side receives text deltas
through a per-request :class:`asyncio.Queue`. A request whose client leaves is cancelled: if it is still
waiting it leaves the queue at once (and no longer counts toward the queue limit), if it is running the engine
thread cancels it before the next step.

Every request that is not cancelled by its own client ends with exactly one :class:`Finished` or
:class:`Failed` event, shutdown included: :meth:`QueueLifecycle.close` fails the waiting requests at once and
the running ones after a grace period, with :class:`ServerClosingError`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from draftwise.machine import release_openmp_threads
from draftwise.server.metrics import RequestRecord
from draftwise.server.requests import GenerationRequest
from draftwise.stats import SpeculativeStats

__all__ = ["EngineHealth", "QueueLifecycle", "RequestHandle", "TextDelta", "Finished", "Failed", "Aborted", "QueueFullError",
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
    """The server is shutting down; queued requests are not served (the caller should answer 503)."""


class _Job:
    """One request's shared state between the event loop and the engine thread."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()  # stop working on it (client gone, or shutdown)
        self._ended = False
        self._end_lock = threading.Lock()

    def post(self, event: Event) -> None:
        """Deliver an event to the event loop (from any thread); dropped if the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: nobody is listening any more
            self.cancelled.set()

    def end(self, event: Finished | Failed) -> bool:
        """Post the request's terminal event unless one was posted already; True if this call posted it."""
        with self._end_lock:
            if self._ended:
                return False
            self._ended = True
        self.post(event)
        return True


class RequestHandle:
    """The event-loop side of a queued request. Read events with :meth:`next_event` until a
    :class:`Finished`, :class:`Failed` or :class:`Aborted`; call :meth:`cancel` when the client leaves."""

    def __init__(self, job: _Job, withdraw: Callable[[_Job], None]) -> None:
        self._job = job
        self._withdraw = withdraw
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
        """Stop the request (idempotent; call on the event loop): a waiting request leaves the queue, a running
        one stops at the next engine step; a pending :meth:`next_event` returns :class:`Aborted`."""
        if self.done or self._job.cancelled.is_set():
            return
        self._job.cancelled.set()
        self._withdraw(self._job)
        self._job.events.put_nowait(Aborted())


class EngineHealth:
    """Whether the engine serves requests, as ``/health`` reports it to a load balancer.

    The engine is unhealthy after ``unhealthy_after`` engine failures in a row (a request or step that failed
    inside the engine, not one the engine refused as the client's fault: :class:`ValueError`) with no success
    in between; the next success makes it healthy again. Thread-safe.

    Args:
        unhealthy_after: consecutive engine failures that make it unhealthy (>= 1).
    """

    def __init__(self, unhealthy_after: int = 3) -> None:
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        self.unhealthy_after = unhealthy_after
        self._lock = threading.Lock()
        self._consecutive = 0
        self._last_error = ""

    def failed(self, error: BaseException) -> None:
        """Count one engine failure (a :class:`ValueError`, the client's fault, is not counted)."""
        if isinstance(error, ValueError):
            return
        with self._lock:
            self._consecutive += 1
            self._last_error = f"{type(error).__name__}: {error}"

    def succeeded(self) -> None:
        """The engine served a request or step: healthy again."""
        with self._lock:
            self._consecutive = 0

    @property
    def consecutive_failures(self) -> int:
        """Engine failures since the last success."""
        with self._lock:
            return self._consecutive

    def unhealthy_reason(self) -> str | None:
        """Why the engine is unhealthy, or None when it is healthy."""
        with self._lock:
            if self._consecutive < self.unhealthy_after:
                return None
            return f"the engine failed {self._consecutive} times in a row; last error: {self._last_error}"


class QueueLifecycle:
    """What every scheduler shares: the waiting queue with its limit, the engine thread's start and stop,
    graceful shutdown, cancellation of waiting requests, and the record of requests that produced nothing.

    Subclasses implement ``_worker_loop`` (the engine thread) and ``_running_jobs`` (the requests the engine
    holds now), and may refine ``_queue_full``.

    Args:
        decode: ids -> text, used only by the engine thread (see :class:`TextCodec`).
        record: called with each request's :class:`RequestRecord` (metrics), from the engine thread or from
            the thread that cancels or closes; must be thread-safe.
        max_waiting: requests allowed to wait (cancelled ones leave the queue at once and do not count);
            :meth:`submit` raises :class:`QueueFullError` beyond.
        thread_name: the engine thread's name.
    """

    def __init__(self, decode: Callable[[list[int]], str], record: Callable[[RequestRecord], None],
                 max_waiting: int, thread_name: str) -> None:
        self._decode = decode
        self._record = record
        self._max_waiting = max_waiting
        self._thread_name = thread_name
        self._waiting: deque[_Job] = deque()
        self._wakeup = threading.Condition()  # guards _waiting, _closing, _stopped and the subclass's running state
        self._closing = False
        self._stopped = False
        self._grace_timer: threading.Timer | None = None
        self._thread: threading.Thread | None = None
        self.health = EngineHealth()

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        """Start the engine thread (idempotent). The calling thread, which loaded the models, first releases its
        OpenMP worker threads (:func:`draftwise.machine.release_openmp_threads`): kept beside the engine
        thread's own, they made every parallel region of the engine wake its workers through the kernel."""
        with self._wakeup:
            if self._thread is None and not self._stopped:
                release_openmp_threads()
                self._thread = threading.Thread(target=self._worker_loop, name=self._thread_name, daemon=True)
                self._thread.start()

    def close(self, grace_s: float) -> None:
        """Begin shutting down (idempotent): refuse new requests, fail every waiting request at once with
        :class:`ServerClosingError`, and give the running requests ``grace_s`` seconds to finish before they are
        stopped and fail with :class:`ServerClosingError` too. The engine thread keeps running until
        :meth:`shutdown`."""
        with self._wakeup:
            if self._closing:
                return
            self._closing = True
            waiting = list(self._waiting)
            self._waiting.clear()
        for job in waiting:
            job.cancelled.set()
            if job.end(Failed(ServerClosingError("the server is shutting down; retry on another server"))):
                self._record_unfinished(job, "abort", "refused: the server is shutting down")
        if grace_s <= 0:
            self._expire_running()
        else:
            self._grace_timer = threading.Timer(grace_s, self._expire_running)
            self._grace_timer.daemon = True
            self._grace_timer.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close at once (see :meth:`close`; running requests fail now unless a grace period is already under
        way, which is then cut short) and stop the engine thread (waits up to ``timeout_s``)."""
        self.close(0.0)
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._expire_running()
        with self._wakeup:
            self._stopped = True
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", timeout_s)

    def unhealthy_reason(self) -> str | None:
        """Why the scheduler cannot serve (its engine thread died, or :attr:`health` is unhealthy), or None."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopped:
            return "the engine thread has stopped"
        return self.health.unhealthy_reason()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; call from the event loop that will read its events.

        Raises:
            QueueFullError: ``max_waiting`` requests are already waiting.
            ServerClosingError: the server is shutting down.
        """
        self.start()
        job = _Job(request, asyncio.get_running_loop())
        with self._wakeup:
            if self._closing:
                raise ServerClosingError("the server is shutting down; retry on another server")
            if self._queue_full():
                raise QueueFullError(f"{self._max_waiting} requests are already waiting; retry later")
            self._waiting.append(job)
            self._wakeup.notify()
        return RequestHandle(job, self._withdraw)

    def _queue_full(self) -> bool:
        """True when no further request may wait (called under the lock)."""
        return len(self._waiting) >= self._max_waiting

    def _withdraw(self, job: _Job) -> None:
        """Take a cancelled job out of the queue, if it is still there (else the engine thread has it)."""
        with self._wakeup:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
        self._record_unfinished(job, "abort", "abandoned by its client while waiting")

    def _expire_running(self) -> None:
        """End of the grace period: fail the running requests (their handles get the event now, even if the
        engine is in the middle of a long step) and have the engine thread drop them at its next step."""
        with self._wakeup:
            jobs = self._running_jobs()
        for job in jobs:
            job.cancelled.set()
            job.end(Failed(ServerClosingError("the server shut down before the request finished")))

    def _running_jobs(self) -> list[_Job]:
        """The jobs the engine holds now (called under the lock)."""
        raise NotImplementedError

    def _worker_loop(self) -> None:
        raise NotImplementedError

    def _record_unfinished(self, job: _Job, finished_reason: str, why: str) -> None:
        """Count a request that produced no result: ``"abort"`` (client gone, or shutdown) or ``"error"``."""
        request = job.request
        waited = time.perf_counter() - request.arrival_s
        self._record(RequestRecord(finished_reason, len(request.prompt_ids), 0, waited, None, waited, None))
        logger.info("%s: %s", request.request_id, why)
