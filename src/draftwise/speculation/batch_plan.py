"""The engine's load-aware K: every decoding sequence's draft depth for one batched pass, with probes.

:func:`plan_with_probes` plans K on the step's measured costs (:func:`draftwise.speculation.cost_model.plan_batch_k`,
marginal allocation of draft rows) and gives a sequence kept at K = 0 a one-token probe now and then, so that its
acceptance estimate can learn that its text became predictable; :func:`learn_outcome` tells a sequence's estimate
(and the engine's long-memory one) what its draft did, and its probe schedule whether a probe was accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from draftwise.speculation.controller import AcceptanceEstimator, ProbeBackoff
from draftwise.speculation.cost_model import batch_step_rate, expected_tokens, plan_batch_k

__all__ = ["PlannedSequence", "learn_outcome", "plan_with_probes"]


class PlannedSequence(Protocol):
    """What the plan reads and keeps per sequence (an engine's :class:`~draftwise.engine.sequence.BatchSequence`).

    Attributes:
        estimator: its acceptance estimate.
        backoff: plain steps before its next probe.
        plain_streak: consecutive steps planned at K = 0 while a draft was offered.
        probing: this step's K = 1 is a probe.
    """

    estimator: AcceptanceEstimator
    backoff: ProbeBackoff
    plain_streak: int
    probing: bool


def plan_with_probes(sequences: Sequence[PlannedSequence], caps: Sequence[int], base_rows: int,
                     pass_seconds: Callable[[int], float], draft_seconds: Callable[[int], float] | None,
                     draft_budget: int) -> list[int]:
    """Load-aware K per sequence, with probes, within ``draft_budget`` draft rows.

    Args:
        sequences: the decoding sequences, in slot order.
        caps: each one's largest K now (0: it does not draft; with a lookup, the tokens it offered).
        base_rows: rows of the pass without any draft (decoding sequences and expected prompt rows).
        pass_seconds: ``rows -> seconds`` of a step (its pass and the engine's own time).
        draft_seconds: ``rows -> seconds`` of one draft-model pass, or None for a lookup.
        draft_budget: draft rows the step can hold.

    Returns:
        ``[K_i]``, one per sequence.
    """
    rates = [s.estimator.rates(cap) for s, cap in zip(sequences, caps)]
    ks = plan_batch_k(rates, caps, base_rows, pass_seconds, draft_seconds, draft_budget)
    _probe(sequences, caps, ks, rates, base_rows, draft_budget, pass_seconds, draft_seconds)
    return ks


def _probe(sequences, caps, ks, rates, base_rows, draft_budget, pass_seconds, draft_seconds) -> None:
    """A sequence kept at K = 0 (its acceptance looked too low) gets a one-token probe after its interval of
    plain steps, when one fully accepted draft token would raise the batch's rate: without it, its acceptance
    estimate would never learn that the text became predictable. The interval doubles after a rejected probe
    (up to the backoff's maximum) and resets after an accepted one. Sets ``ks[i]`` to 1 for a probe."""
    expected = sum(expected_tokens(r[:k]) for r, k in zip(rates, ks))
    rows = base_rows + sum(ks)
    draft_s = 0.0
    if draft_seconds is not None and any(ks):
        draft_s = sum(draft_seconds(sum(1 for k in ks if k > d)) for d in range(max(ks)))
    now = batch_step_rate([expected], pass_seconds(rows), draft_s)
    for i, sequence in enumerate(sequences):
        sequence.probing = False
        if ks[i] > 0 or caps[i] == 0:
            continue
        sequence.plain_streak += 1
        if sequence.plain_streak < sequence.backoff.interval or sum(ks) >= draft_budget:
            continue
        extra = 0.0 if draft_seconds is None else draft_seconds(max(1, sum(1 for k in ks if k > 0)))
        if batch_step_rate([expected + 1.0], pass_seconds(rows + 1), draft_s + extra) <= now:
            continue
        ks[i], sequence.probing, sequence.plain_streak = 1, True, 0


def learn_outcome(sequence: PlannedSequence, memory: AcceptanceEstimator, num_drafted: int,
                  num_accepted: int) -> None:
    """A step's outcome for a sequence the engine plans K for: ``num_accepted`` of ``num_drafted`` draft tokens
    (nothing to learn from a plain step). Its estimate and the engine's long-memory ``memory`` observe it; a probe
    resets its schedule when fully accepted and backs it off otherwise."""
    if not num_drafted:
        return
    sequence.estimator.observe(num_drafted, num_accepted)
    memory.observe(num_drafted, num_accepted)
    if sequence.probing:
        if num_accepted == num_drafted:
            sequence.backoff.reset()
        else:
            sequence.backoff.rejected()
