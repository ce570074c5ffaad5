"""A request's life between the event loop and the engine thread: its events and its handle.

The engine loop (:class:`draftwise.server.engine_loop.EngineLoop`) runs the engine in a dedicated thread; the
asyncio side reads what happens to a request as events from its :class:`RequestHandle`, through a per-request
:class:`asyncio.Queue`: :class:`TextDelta` s, and one :class:`Finished` per choice (``n`` of them, each with its
choice's ``index``), unless a :class:`Failed` or :class:`Aborted` ends the request first. A :class:`Job` is the
state the two sides share.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from draftwise.logprobs import TokenLogprob
from draftwise.server.validation import GenerationRequest
from draftwise.stats import SpeculativeStats

__all__ = ["Aborted", "Event", "Failed", "Finished", "Job", "QueueFullError", "RequestHandle", "ServerClosingError",
           "TextDelta"]


# ---------------------------------------------------------------------- events (engine thread -> event loop)
@dataclass(frozen=True)
class TextDelta:
    """New output text of choice ``index``, and the log-probabilities of the tokens consumed with it (a request
    that asked for them); never both empty. ``prompt_logprobs``: the first delta of a choice that asked for its
    prompt's carries them (None for the first prompt token)."""

    text: str
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class Finished:
    """The request is complete.

    Attributes:
        finish_reason: ``"stop"`` (EOS, a stop token id or a stop string) or ``"length"``.
        completion_tokens: generated tokens counted for ``usage`` (up to and including the token that
            completed a stop string).
        stats: the engine's statistics for the request.
        index: the choice that finished (``0..n-1``); the request is complete once all ``n`` have.
    """

    finish_reason: str
    completion_tokens: int
    stats: SpeculativeStats
    index: int = 0


@dataclass(frozen=True)
class Failed:
    """The request failed after it was queued; ``error`` is the exception. Whatever its type, this is the
    server's fault (a 5xx): every fault of the client's is refused by request validation before queueing
    (:class:`draftwise.server.errors.RequestError`)."""

    error: BaseException


@dataclass(frozen=True)
class Aborted:
    """The request was cancelled on this side (client gone); no more events follow."""


Event = TextDelta | Finished | Failed | Aborted


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should answer 503."""


class ServerClosingError(RuntimeError):
    """The server is shutting down; queued requests are not served (the caller should answer 503)."""


class Job:
    """One request's shared state between the event loop and the engine thread."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()  # stop working on it (client gone, or shutdown)
        self._ended = False
        self._choices_left = request.n  # choices whose Finished is still to come
        self._end_lock = threading.Lock()

    def post(self, event: Event) -> None:
        """Deliver an event to the event loop (from any thread); dropped if the loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # loop closed: nobody is listening any more
            self.cancelled.set()

    def end(self, event: Finished | Failed) -> bool:
        """Post a choice's :class:`Finished` or the request's :class:`Failed` unless the request has ended (all its
        choices finished, or it failed); True if this call posted it."""
        with self._end_lock:
            if self._ended:
                return False
            self._choices_left -= 1
            self._ended = isinstance(event, Failed) or self._choices_left == 0
        self.post(event)
        return True


class RequestHandle:
    """The event-loop side of a queued request. Read events with :meth:`next_event` until :attr:`done` (every
    choice's :class:`Finished`, or a :class:`Failed` or :class:`Aborted`); call :meth:`cancel` when the client
    leaves."""

    def __init__(self, job: Job, withdraw: Callable[[Job], None]) -> None:
        self._job = job
        self._withdraw = withdraw
        self._choices_left = job.request.n
        self.done = False

    @property
    def request(self) -> GenerationRequest:
        """The request being served."""
        return self._job.request

    async def next_event(self) -> Event:
        """Wait for the next event (must be awaited on the loop that submitted the request)."""
        event = await self._job.events.get()
        if isinstance(event, Finished):
            self._choices_left -= 1
        if isinstance(event, (Failed, Aborted)) or self._choices_left == 0:
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
