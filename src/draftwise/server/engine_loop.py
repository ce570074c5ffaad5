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
from dataclasses import dataclass

from draftwise.engine import BatchSequence, EngineCore, SequenceOutput, StepInfo
from draftwise.machine import release_openmp_threads
from draftwise.server.events import Failed, Finished, Job, QueueFullError, RequestHandle, ServerClosingError, TextDelta
from draftwise.server.health import EngineHealth
from draftwise.server.metrics import RequestRecord
from draftwise.server.text import OutputText
from draftwise.server.validation import GenerationRequest
from draftwise.stats import hybrid_steps_line

__all__ = ["EngineLoop"]

logger = logging.getLogger(__name__)

THREAD_NAME = "draftwise-batch-engine"


@dataclass
class _Running:
    """A request inside the engine: its job, sequence, text state and timings (``time.perf_counter()``)."""

    job: Job
    sequence: BatchSequence
    output: OutputText
    started: float
    first_token_at: float | None = None


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
        self._active: dict[int, _Running] = {}  # seq_id -> running request (the engine thread writes)
        self._num_active = 0  # what num_running reports (jobs taken from the queue and not yet ended)
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
        """Requests in the running batch, or about to join it at the next step (at most ``core.max_num_seqs``)."""
        with self._wakeup:
            return min(self._core.max_num_seqs, self._num_active + len(self._waiting))

    @property
    def num_waiting(self) -> int:
        """Requests queued with no free slot for them (cancelled ones excluded)."""
        with self._wakeup:
            return self._num_queued()

    def _num_queued(self) -> int:
        """Queued jobs beyond the free slots (call under the lock): the ones really waiting."""
        return max(0, len(self._waiting) - (self._core.max_num_seqs - self._num_active))

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
            jobs = [running.job for running in self._active.values()]
        for job in jobs:
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
            while self._waiting and self._num_active < self._core.max_num_seqs:
                jobs.append(self._waiting.popleft())
                self._num_active += 1
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
        """Hand a queued job to the engine (it joins the batch at the next step)."""
        if job.cancelled.is_set():
            self._end_job()
            self._record_unfinished(job, "abort", "abandoned by its client while waiting")
            return
        request = job.request
        try:
            sequence = self._core.add(request.prompt_ids, request.params, scope=request.scope,
                                      num_speculative_tokens=request.num_speculative_tokens,
                                      arrival_s=request.arrival_s, processors=request.processors)
        except Exception as exc:  # validation refused what add() refuses: this is the server's fault
            logger.exception("%s: the engine refused a validated request", request.request_id)
            self.health.failed(exc)
            self._end_job()
            job.end(Failed(exc))
            self._record_unfinished(job, "error", f"refused by the engine: {type(exc).__name__}: {exc}")
            return
        output = OutputText(self._decode, request.prompt_ids, request.stops)
        with self._wakeup:
            self._active[sequence.seq_id] = _Running(job, sequence, output, time.perf_counter())

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
        if token_ids and running.first_token_at is None:
            running.first_token_at = now
        consumed = running.output.num_tokens
        text = running.output.add_tokens(token_ids)
        logprobs = tuple(output.logprobs[:running.output.num_tokens - consumed]) if output.logprobs else ()
        prompt_logprobs = tuple(output.prompt_logprobs) if output.prompt_logprobs is not None else None
        if text or logprobs or prompt_logprobs is not None:
            job.post(TextDelta(text, logprobs, prompt_logprobs))
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
            job.post(TextDelta(tail))
        result = running.sequence.result
        reason = "stop" if running.output.stopped else result.finish_reason
        self._finish(running, reason)  # recorded first: a client reading /metrics after its response finds it
        job.end(Finished(reason, running.output.num_tokens, result.stats))

    def _fail_all(self, error: BaseException) -> None:
        self._core.abort_all("error")
        for running in list(self._active.values()):
            self._fail(running, error)

    def _fail(self, running: _Running, error: BaseException) -> None:
        """End a request with :class:`Failed` (its sequence has already left the engine) and record it."""
        logger.error("%s: engine failure: %s: %s", running.job.request.request_id, type(error).__name__, error)
        if running.sequence.seq_id in self._active:
            self._finish(running, "error")
        running.job.end(Failed(error))

    def _end_job(self) -> None:
        with self._wakeup:
            self._num_active -= 1

    def _finish(self, running: _Running, finish_reason: str) -> None:
        """Record a request that left the batch and free its place in the count."""
        with self._wakeup:
            del self._active[running.sequence.seq_id]
            self._num_active -= 1
        request = running.job.request
        stats = running.sequence.result.stats if running.sequence.result is not None else None
        now = time.perf_counter()
        self._record(RequestRecord(
            finished_reason=finish_reason,
            prompt_tokens=len(request.prompt_ids),
            generation_tokens=running.output.num_tokens,
            queue_time_s=running.started - request.arrival_s,
            ttft_s=None if running.first_token_at is None else running.first_token_at - request.arrival_s,
            e2e_s=now - request.arrival_s,
            stats=stats,
        ))
        logger.info("%s: %s, %d prompt + %d generated tokens in %.2f s (queued %.2f s)%s",
                    request.request_id, finish_reason, len(request.prompt_ids), running.output.num_tokens,
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
