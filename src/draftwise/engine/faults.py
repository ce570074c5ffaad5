"""Fault isolation: a failure in a step is confined to the sequence that caused it, where that can be told apart.

A sequence whose own part of a step (admission, verification, its first token) raises fails alone
(:func:`guarded`). When the shared part of a step (drafting and the target pass) raises, the step is retried one
sequence at a time (:func:`retry_alone`; the failed attempt changed no committed state): each sequence that fails
alone too fails with its own error, the others take their step. When every sequence of a step of several fails
alone too, the fault is the engine's, not one request's: each fails with an :class:`UnattributedStepError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from draftwise.engine.sequence import BatchSequence, SequenceOutput

__all__ = ["UnattributedStepError", "guarded", "retry_alone"]

logger = logging.getLogger(__name__)

#: Ends a sequence with ``finish_reason="error"`` and returns its output (the engine's ``_fail``).
Fail = Callable[[BatchSequence, BaseException], SequenceOutput]


class UnattributedStepError(RuntimeError):
    """A batched step failed and so did every one of its sequences when retried alone: the fault is not one
    request's (the engine itself fails), so no request can be told apart as its cause. ``cause`` is the
    batched step's exception."""

    def __init__(self, num_sequences: int, cause: BaseException) -> None:
        super().__init__(f"the batched step failed for all {num_sequences} requests in it, and for each of them "
                         f"retried alone, so the failure cannot be attributed to one request: "
                         f"{type(cause).__name__}: {cause}")
        self.cause = cause


def guarded(fail: Fail, sequence: BatchSequence, work: Callable[[], SequenceOutput | None],
            where: str = "in its own part of the step") -> SequenceOutput | None:
    """``work()`` for one sequence; if it raises, that sequence alone fails (``fail``) and its output is returned."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - this sequence's own failure
        logger.error("sequence %d failed %s: %s: %s", sequence.seq_id, where, type(exc).__name__, exc, exc_info=exc)
        return fail(sequence, exc)


def retry_alone(running: Sequence[BatchSequence], exc: BaseException,
                step_over: Callable[[list[BatchSequence]], list[SequenceOutput]], fail: Fail,
                ) -> list[SequenceOutput]:
    """The shared part of a step over ``running`` raised ``exc``: retry it (``step_over``) one sequence at a time;
    returns the outputs of every sequence (see the module docstring)."""
    if len(running) == 1:
        logger.debug("a step of 1 sequence failed: %s: %s", type(exc).__name__, exc)
        return [fail(running[0], exc)]
    logger.warning("a batched step of %d sequences failed (%s: %s); retrying each alone to find the cause",
                   len(running), type(exc).__name__, exc, exc_info=exc)
    outputs, errors = [], {}
    for sequence in running:
        try:
            outputs.extend(step_over([sequence]))
        except Exception as alone:  # noqa: BLE001 - this sequence's own failure
            errors[sequence.seq_id] = alone
    if len(errors) == len(running):
        logger.error("every one of the %d sequences failed alone too: the failure cannot be attributed to one "
                     "request; failing all of them", len(running))
        return [fail(s, UnattributedStepError(len(running), exc)) for s in running]
    for sequence in running:
        if sequence.seq_id in errors:
            error = errors[sequence.seq_id]
            logger.error("sequence %d caused the failed step (it fails alone: %s: %s); failing it only",
                         sequence.seq_id, type(error).__name__, error)
            outputs.append(fail(sequence, error))
    if not errors:
        logger.warning("each of the %d sequences succeeded alone: the step was retried one sequence at a time",
                       len(running))
    return outputs
