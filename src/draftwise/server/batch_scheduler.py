"""Many clients, one engine core: continuous batching behind the HTTP server (the server's one scheduler).

For every :class:`draftwise.engine.core.EngineCore` (a lean target with several KV-cache slots, or any
backend as one slot, which serves one request at a time in arrival order): up to ``engine.max_num_seqs``
requests run at once, one :meth:`~draftwise.engine.core.EngineCore.step` (one target pass) at a time in a dedicated thread; the others
wait in a FIFO queue of at most ``max_waiting`` requests (beyond it :meth:`BatchScheduler.submit` raises
:class:`~draftwise.server.scheduler.QueueFullError`, answered 503 ``queue_full``). A request joins the running
batch at the next step after a slot frees, and leaves it the step it finishes.

Cancellation: a waiting request whose client leaves leaves the queue at once (and no longer counts toward its
limit); a running one is cancelled by the engine thread before the next step, which frees its slot.

Shutdown: :meth:`BatchScheduler.close` refuses new requests, fails the
waiting ones at once, and gives the running ones (all of them) a grace period, after which their handles get
:class:`~draftwise.server.scheduler.ServerClosingError` and the engine thread drops them at the next step.
Every request not cancelled by its own client ends with exactly one ``Finished`` or ``Failed`` event.

Text is produced in the engine thread (detokenization and stop strings, :class:`OutputText`), so a stop string
stops the sequence at the next step. A failure fails only the requests whose sequences the engine failed
(:meth:`~draftwise.engine.core.EngineCore.step` confines a failed step to the sequence that caused it where that
can be told apart, and says so in the error where it cannot); the scheduler goes on with the next requests,
and :attr:`health` turns unhealthy after repeated failures (see :class:`EngineHealth`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from draftwise.engine import EngineCore, BatchSequence, StepInfo
from draftwise.server.metrics import RequestRecord
from draftwise.server.scheduler import (
    Failed,
    Finished,
    QueueLifecycle,
    TextDelta,
    _Job,
)
from draftwise.server.text import OutputText
from draftwise.stats import hybrid_steps_line

__all__ = ["BatchScheduler"]

logger = logging.getLogger(__name__)


@dataclass
class _Running:
    """A request inside the engine: its job, sequence, text state and timings (``time.perf_counter()``)."""

    job: _Job
    sequence: BatchSequence
    output: OutputText
    started: float
    first_token_at: float | None = None


class BatchScheduler(QueueLifecycle):
    """Runs requests through one :class:`EngineCore`, many at once (see the module docstring).

    Args:
        engine: the batched engine (this scheduler becomes its only user; its thread runs every step).
        decode: ids -> text, used only by the engine thread.
        record: called with each request's :class:`RequestRecord` (thread-safe).
        max_waiting: requests allowed to wait with no free slot for them; :meth:`submit` raises
            :class:`QueueFullError` beyond (a request arriving while a slot is free never counts).
        record_step: called with every step's :class:`~draftwise.engine.StepInfo` (metrics), or None.
    """

    def __init__(self, engine: EngineCore, decode: Callable[[list[int]], str],
                 record: Callable[[RequestRecord], None], max_waiting: int,
                 record_step: Callable[[StepInfo], None] | None = None) -> None:
        super().__init__(decode, record, max_waiting, "draftwise-batch-engine")
        self._engine = engine
        self._record_step = record_step
        self._active: dict[int, _Running] = {}  # seq_id -> running request (the engine thread writes)
        self._num_active = 0  # what num_running reports (jobs taken from the queue and not yet ended)

    @property
    def num_running(self) -> int:
        """Requests in the running batch, or about to join it at the next step (at most ``engine.max_num_seqs``)."""
        with self._wakeup:
            return min(self._engine.max_num_seqs, self._num_active + len(self._waiting))

    @property
    def num_waiting(self) -> int:
        """Requests queued with no free slot for them (cancelled ones excluded)."""
        with self._wakeup:
            return self._num_queued()

    def _num_queued(self) -> int:
        """Queued jobs beyond the free slots (call under the lock): the ones really waiting."""
        return max(0, len(self._waiting) - (self._engine.max_num_seqs - self._num_active))

    def _queue_full(self) -> bool:
        return self._num_queued() >= self._max_waiting

    def _running_jobs(self) -> list[_Job]:
        return [running.job for running in self._active.values()]

    # ------------------------------------------------------------------ engine thread
    def _take_jobs(self) -> list[_Job] | None:
        """Wait for work; returns the queued jobs that fit in the batch now (None: stop)."""
        with self._wakeup:
            while not self._stopped and not self._waiting and not self._active:
                self._wakeup.wait()
            if self._stopped:
                return None
            jobs = []
            while self._waiting and self._num_active < self._engine.max_num_seqs:
                jobs.append(self._waiting.popleft())
                self._num_active += 1
            return jobs

    def _worker_loop(self) -> None:
        try:
            self._serve()
        finally:  # stopped: the sequences still in the batch (their handles already failed) leave it
            for running in list(self._active.values()):
                self._engine.cancel(running.sequence)
                self._finish(running, "abort")

    def _serve(self) -> None:
        while (jobs := self._take_jobs()) is not None:
            for job in jobs:
                self._admit(job)
            self._drop_cancelled()
            if not self._active:
                continue
            try:
                outputs = self._engine.step()
            except Exception as exc:  # the engine could not confine the failure: every request in it fails
                logger.exception("a batched step failed outside the engine's own recovery; failing all %d "
                                 "requests in it (the cause cannot be told apart)", len(self._active))
                self.health.failed(exc)
                self._fail_all(exc)
                continue
            if self._record_step is not None and self._engine.last_step is not None:
                self._record_step(self._engine.last_step)
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
                    self._deliver_guarded(running, output.token_ids, output.finished, now)

    def _admit(self, job: _Job) -> None:
        """Hand a queued job to the engine (it joins the batch at the next step)."""
        if job.cancelled.is_set():
            self._end_job()
            self._record_unfinished(job, "abort", "abandoned by its client while waiting")
            return
        request = job.request
        try:
            sequence = self._engine.add(request.prompt_ids, request.params, scope=request.scope,
                                        num_speculative_tokens=request.num_speculative_tokens,
                                        arrival_s=request.arrival_s)
        except Exception as exc:  # a request the engine refuses (ValueError: the client's fault -> 400)
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
            self._engine.cancel(running.sequence)
            self._finish(running, "abort")

    def _deliver_guarded(self, running: _Running, token_ids: list[int], finished: bool, now: float) -> None:
        """:meth:`_deliver`, failing only this request if its text cannot be produced (the engine thread must
        not die: every other request would hang)."""
        try:
            self._deliver(running, token_ids, finished, now)
        except Exception as exc:  # noqa: BLE001 - confined to this request
            logger.exception("%s: delivering its output failed", running.job.request.request_id)
            self.health.failed(exc)
            self._engine.cancel(running.sequence)
            self._fail(running, exc)

    def _deliver(self, running: _Running, token_ids: list[int], finished: bool, now: float) -> None:
        """Stream a step's tokens of one sequence; finish it when the engine or a stop string ends it."""
        job = running.job
        if token_ids and running.first_token_at is None:
            running.first_token_at = now
        text = running.output.add_tokens(token_ids)
        if text:
            job.post(TextDelta(text))
        if running.output.stopped and not finished:
            self._engine.cancel(running.sequence)  # a stop string: the sequence leaves the batch now
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
        self._engine.abort_all("error")
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
