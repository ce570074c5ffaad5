"""Many clients, one engine core: the server's engine loop (:class:`EngineLoop`), with continuous batching.

For every :class:`draftwise.engine.core.EngineCore` (a lean target with several KV-cache slots, or any backend
as one slot, which serves one request at a time in arrival order): up to ``core.max_num_seqs`` requests run at
once, one :meth:`~draftwise.engine.core.EngineCore.step` (one target pass) at a time in a dedicated thread; the
others wait in a FIFO queue of at most ``max_waiting`` requests (beyond it :meth:`EngineLoop.submit` raises
:class:`~draftwise.server.events.QueueFullError`, answered 503 ``queue_full``). A request joins the running batch
at the next step after a slot frees, and leaves it the step it finishes. The asyncio side reads each request's
events from its :class:`~draftwise.server.events.RequestHandle`.

Cancellation: a waiting request whose client leaves leaves the queue at once (and no longer counts toward its
limit); a running one is cancelled by the engine thread before the next step, which frees its slot.

Shutdown: :meth:`EngineLoop.close` refuses new requests, fails the waiting ones at once, and gives the running
ones (all of them) a grace period, after which their handles get
:class:`~draftwise.server.events.ServerClosingError` and the engine thread drops them at the next step. Every
request not cancelled by its own client ends with exactly one ``Finished`` or ``Failed`` event.

Text is produced in the engine thread (detokenization and stop strings, :class:`OutputText`), so a stop string
stops the sequence at the next step.

A request with ``n`` choices takes ``n`` seats of the batch at once: it leaves the queue when ``n`` are free, its
choices are ``n`` sequences added together (choice i with seed + i, the others forking the first one's prompt KV:
``prompt_source``), each streaming its own text and finishing on its own; the request is recorded once (prompt
tokens once, generated tokens summed) when its last choice ends, and a failure of one choice fails them all.

Failures: every request reaching this loop has passed request validation (:mod:`draftwise.server.validation`),
which refuses whatever :meth:`EngineCore.add` would; so any exception from here on, whatever its type, is the
server's fault (a 5xx) and counts in :attr:`EngineLoop.health`. A failure fails only the requests whose
sequences the engine failed (:meth:`~draftwise.engine.core.EngineCore.step` confines a failed step to the
sequence that caused it where that can be told apart, and says so in the error where it cannot); the loop goes
on with the next requests, and :attr:`~EngineLoop.health` turns unhealthy after repeated failures.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from draftwise.engine import BatchSequence, EngineCore, SequenceOutput, StepInfo
from draftwise.machine import release_openmp_threads
from draftwise.server.events import Failed, Finished, Job, QueueFullError, RequestHandle, ServerClosingError, TextDelta
from draftwise.server.health import EngineHealth
from draftwise.server.metrics import RequestRecord
from draftwise.server.text import OutputText
from draftwise.server.validation import GenerationRequest
from draftwise.stats import choices_stats, hybrid_steps_line

__all__ = ["EngineLoop"]

logger = logging.getLogger(__name__)

THREAD_NAME = "draftwise-batch-engine"


@dataclass(eq=False)
class _Request:
    """A request inside the engine: its job, its choices and timings (``time.perf_counter()``)."""

    job: Job
    started: float
    first_token_at: float | None = None
    choices: list[_Running] = field(default_factory=list)
    left: int = 0  # choices still in the batch


@dataclass(eq=False)
class _Running:
    """One choice of a request inside the engine: its sequence, text state and how it ended."""

    request: _Request
    index: int
    sequence: BatchSequence
    output: OutputText
    reason: str = ""  # set when it left the batch

    @property
    def job(self) -> Job:
        return self.request.job


class EngineLoop:
    """Runs requests through one :class:`EngineCore`, many at once (see the module docstring).

    Args:
        core: the engine core (this loop becomes its only user; its thread runs every step).
        decode: ids -> text, used only by the engine thread (see :class:`~draftwise.server.text.TextCodec`).
        record: called with each request's :class:`RequestRecord` (metrics), from the engine thread or from
            the thread that cancels or closes; must be thread-safe.
        max_waiting: requests allowed to wait with no free slot for them; :meth:`submit` raises
            :class:`QueueFullError` beyond (a request arriving while a slot is free never counts; cancelled
            ones leave the queue at once and do not count).
        record_step: called with every step's :class:`~draftwise.engine.StepInfo` (metrics), or None.
    """

    def __init__(self, core: EngineCore, decode: Callable[[list[int]], str],
                 record: Callable[[RequestRecord], None], max_waiting: int,
                 record_step: Callable[[StepInfo], None] | None = None) -> None:
        self._core = core
        self._decode = decode
        self._record = record
        self._max_waiting = max_waiting
        self._record_step = record_step
        self._waiting: deque[Job] = deque()
        self._active: dict[int, _Running] = {}  # seq_id -> running choice (the engine thread writes)
        self._num_active = 0  # what num_running reports (seats of jobs taken from the queue and not yet ended)
        self._wakeup = threading.Condition()  # guards the queue, the running state, _closing and _stopped
        self._closing = False
        self._stopped = False
        self._grace_timer: threading.Timer | None = None
        self._thread: threading.Thread | None = None
        self.health = EngineHealth()

    # ------------------------------------------------------------------ control (any thread)
    def start(self) -> None:
        """Start the engine thread (idempotent). The calling thread, which loaded the models, first releases its
        OpenMP worker threads (:func:`draftwise.machine.release_openmp_threads`): kept beside the engine
        thread's own, they made every parallel region of the engine wake its workers through the kernel."""
        with self._wakeup:
            if self._thread is None and not self._stopped:
                release_openmp_threads()
                self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
                self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a validated request; call from the event loop that will read its events.

        Raises:
            QueueFullError: ``max_waiting`` requests are already waiting with no free slot.
            ServerClosingError: the server is shutting down.
        """
        self.start()
        job = Job(request, asyncio.get_running_loop())
        with self._wakeup:
            if self._closing:
                raise ServerClosingError("the server is shutting down; retry on another server")
            if self._num_queued() >= self._max_waiting:
                raise QueueFullError(f"{self._max_waiting} requests are already waiting; retry later")
            self._waiting.append(job)
            self._wakeup.notify()
        return RequestHandle(job, self._withdraw)

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
        """Why the loop cannot serve (its engine thread died, or :attr:`health` is unhealthy), or None."""
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopped:
            return "the engine thread has stopped"
        return self.health.unhealthy_reason()

    @property
    def num_running(self) -> int:
        """Sequences (a request's choices) in the running batch, or about to join it at the next step (at most
        ``core.max_num_seqs``)."""
        with self._wakeup:
            return min(self._core.max_num_seqs, self._num_active + sum(job.request.n for job in self._waiting))

    @property
    def num_waiting(self) -> int:
        """Requests queued with no free slot for them (cancelled ones excluded)."""
        with self._wakeup:
            return self._num_queued()

    def _num_queued(self) -> int:
        """Queued jobs beyond the free seats (call under the lock): the ones really waiting (a job of n choices
        needs n seats)."""
        free = self._core.max_num_seqs - self._num_active
        for taken, job in enumerate(self._waiting):
            free -= job.request.n
            if free < 0:
                return len(self._waiting) - taken
        return 0

    def _withdraw(self, job: Job) -> None:
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
            requests = {running.request for running in self._active.values()}  # a request's choices share it
        for job in (request.job for request in requests):
            job.cancelled.set()
            job.end(Failed(ServerClosingError("the server shut down before the request finished")))

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._serve()
        finally:  # stopped: the sequences still in the batch (their handles already failed) leave it
            for running in list(self._active.values()):
                self._core.cancel(running.sequence)
                self._finish(running, "abort")

    def _take_jobs(self) -> list[Job] | None:
        """Wait for work; returns the queued jobs that fit in the batch now (None: stop)."""
        with self._wakeup:
            while not self._stopped and not self._waiting and not self._active:
                self._wakeup.wait()
            if self._stopped:
                return None
            jobs = []
            while self._waiting and self._num_active + self._waiting[0].request.n <= self._core.max_num_seqs:
                jobs.append(self._waiting.popleft())
                self._num_active += jobs[-1].request.n
            return jobs

    def _serve(self) -> None:
        while (jobs := self._take_jobs()) is not None:
            for job in jobs:
                self._admit(job)
            self._drop_cancelled()
            if not self._active:
                continue
            try:
                outputs = self._core.step()
            except Exception as exc:  # the engine could not confine the failure: every request in it fails
                logger.exception("a batched step failed outside the engine's own recovery; failing all %d "
                                 "requests in it (the cause cannot be told apart)", len(self._active))
                self.health.failed(exc)
                self._fail_all(exc)
                continue
            if self._record_step is not None and self._core.last_step is not None:
                self._record_step(self._core.last_step)
            now = time.perf_counter()
            errors = [output for output in outputs if output.error is not None]
            for output in errors:
                self.health.failed(output.error)
            if len(errors) < len(outputs) or not outputs:
                self.health.succeeded()
            for output in outputs:
                running = self._active.get(output.sequence.seq_id)
                if running is None:
                    continue
                if output.error is not None:
                    self._fail(running, output.error)
                else:
                    self._deliver_guarded(running, output, now)

    def _admit(self, job: Job) -> None:
        """Hand a queued job's choices to the engine (they join the batch at the next step; the first prefills
        the prompt, the others fork it)."""
        if job.cancelled.is_set():
            self._end_job(job)
            self._record_unfinished(job, "abort", "abandoned by its client while waiting")
            return
        request = job.request
        sequences: list[BatchSequence] = []
        try:
            for index in range(request.n):
                sequences.append(self._core.add(
                    request.prompt_ids, request.choice_params(index), scope=request.scope,
                    num_speculative_tokens=request.num_speculative_tokens, arrival_s=request.arrival_s,
                    processors=request.choice_processors_of(index), prompt_source=sequences[0] if index else None))
        except Exception as exc:  # validation refused what add() refuses: this is the server's fault
            logger.exception("%s: the engine refused a validated request", request.request_id)
            for sequence in sequences:
                self._core.cancel(sequence)
            self.health.failed(exc)
            self._end_job(job)
            job.end(Failed(exc))
            self._record_unfinished(job, "error", f"refused by the engine: {type(exc).__name__}: {exc}")
            return
        running = _Request(job, time.perf_counter(), left=len(sequences))
        running.choices = [_Running(running, index, sequence, OutputText(self._decode, request.prompt_ids,
                                                                         request.stops))
                           for index, sequence in enumerate(sequences)]
        with self._wakeup:
            for choice in running.choices:
                self._active[choice.sequence.seq_id] = choice

    def _drop_cancelled(self) -> None:
        """Cancel the sequences whose client left (or whose request shutdown failed): frees their slots."""
        for running in [r for r in self._active.values() if r.job.cancelled.is_set()]:
            self._core.cancel(running.sequence)
            self._finish(running, "abort")

    def _deliver_guarded(self, running: _Running, output: SequenceOutput, now: float) -> None:
        """:meth:`_deliver`, failing only this request if its text cannot be produced (the engine thread must
        not die: every other request would hang)."""
        try:
            self._deliver(running, output, now)
        except Exception as exc:  # noqa: BLE001 - confined to this request
            logger.exception("%s: delivering its output failed", running.job.request.request_id)
            self.health.failed(exc)
            self._core.cancel(running.sequence)
            self._fail(running, exc)

    def _deliver(self, running: _Running, output: SequenceOutput, now: float) -> None:
        """Stream a step's tokens of one sequence (with the logprobs of those its text consumed: up to a stop
        string's last token); finish it when the engine or a stop string ends it."""
        job, token_ids, finished = running.job, output.token_ids, output.finished
        if token_ids and running.request.first_token_at is None:
            running.request.first_token_at = now
        consumed = running.output.num_tokens
        text = running.output.add_tokens(token_ids)
        logprobs = tuple(output.logprobs[:running.output.num_tokens - consumed]) if output.logprobs else ()
        prompt_logprobs = tuple(output.prompt_logprobs) if output.prompt_logprobs is not None else None
        if text or logprobs or prompt_logprobs is not None:
            job.post(TextDelta(text, running.index, logprobs, prompt_logprobs))
        if running.output.stopped and not finished:
            self._core.cancel(running.sequence)  # a stop string: the sequence leaves the batch now
            finished = True
        if not finished:
            return
        if job.cancelled.is_set() and not running.output.stopped:
            self._finish(running, "abort")
            return
        tail = running.output.finish()
        if tail:
            job.post(TextDelta(tail, running.index))
        result = running.sequence.result
        reason = "stop" if running.output.stopped else result.finish_reason
        self._finish(running, reason)  # recorded first: a client reading /metrics after its response finds it
        job.end(Finished(reason, running.output.num_tokens, result.stats, running.index))

    def _fail_all(self, error: BaseException) -> None:
        self._core.abort_all("error")
        for running in list(self._active.values()):
            self._fail(running, error)

    def _fail(self, running: _Running, error: BaseException) -> None:
        """End a request with :class:`Failed` (the failed choice's sequence has already left the engine; its
        other choices are cancelled) and record it."""
        if running.sequence.seq_id in self._active:
            logger.error("%s: engine failure: %s: %s", running.job.request.request_id, type(error).__name__, error)
        for choice in running.request.choices:
            if choice.sequence.seq_id in self._active:
                if choice is not running:
                    self._core.cancel(choice.sequence)
                self._finish(choice, "error")
        running.job.end(Failed(error))

    def _end_job(self, job: Job) -> None:
        """A job taken from the queue never reached the engine: its seats are free again."""
        with self._wakeup:
            self._num_active -= job.request.n

    def _finish(self, running: _Running, finish_reason: str) -> None:
        """A choice left the batch: free its seat; once the request's last choice has left, record the request."""
        with self._wakeup:
            del self._active[running.sequence.seq_id]
            self._num_active -= 1
        running.reason = finish_reason
        running.request.left -= 1
        if running.request.left == 0:
            self._record_request(running.request)

    def _record_request(self, running: _Request) -> None:
        """Record a request whose choices have all left the batch (its reason: ``"error"`` or ``"abort"`` when any
        choice ended so, else the first choice's)."""
        request = running.job.request
        reasons = [choice.reason for choice in running.choices]
        reason = next((r for r in ("error", "abort") if r in reasons), reasons[0])
        results = [choice.sequence.result for choice in running.choices]
        stats = choices_stats([r.stats for r in results]) if all(r is not None for r in results) else None
        generated = sum(choice.output.num_tokens for choice in running.choices)
        now = time.perf_counter()
        self._record(RequestRecord(
            finished_reason=reason,
            prompt_tokens=len(request.prompt_ids),
            generation_tokens=generated,
            queue_time_s=running.started - request.arrival_s,
            ttft_s=None if running.first_token_at is None else running.first_token_at - request.arrival_s,
            e2e_s=now - request.arrival_s,
            stats=stats,
        ))
        choices = f" ({request.n} choices)" if request.n > 1 else ""
        logger.info("%s: %s, %d prompt + %d generated tokens%s in %.2f s (queued %.2f s)%s",
                    request.request_id, reason, len(request.prompt_ids), generated, choices,
                    now - running.started, running.started - request.arrival_s, _speculation(stats))

    def _record_unfinished(self, job: Job, finished_reason: str, why: str) -> None:
        """Count a request that produced no result: ``"abort"`` (client gone, or shutdown) or ``"error"``."""
        request = job.request
        waited = time.perf_counter() - request.arrival_s
        self._record(RequestRecord(finished_reason, len(request.prompt_ids), 0, waited, None, waited, None))
        logger.info("%s: %s", request.request_id, why)


def _speculation(stats) -> str:
    """The log line's speculation part: acceptance and tau when anything was drafted, and the hybrid's steps by
    side (``hybrid steps: suffix 12, draft model 5, plain 3``) when the hybrid ran."""
    if stats is None:
        return ""
    line = ""
    if stats.num_draft_tokens:
        line = f", acceptance {stats.acceptance_rate:.2f}, tau {stats.mean_accepted_length:.2f}"
    if stats.hybrid_steps:
        line += f", {hybrid_steps_line(stats.hybrid_steps)}"
    return line
