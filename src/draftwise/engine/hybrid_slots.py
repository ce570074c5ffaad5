"""The engine core's face of the hybrid proposer: suffix decoding or the batched draft model, chosen per
sequence and step by the one :class:`~draftwise.proposers.hybrid.HybridPolicy`, for all sequences of a step
together on the engine's measured pass costs (:func:`~draftwise.proposers.hybrid.assign_sides`).

Each sequence has its own suffix proposer (sharing one cross-request index, as ``suffix`` in the batch does) and
its own :class:`~draftwise.proposers.hybrid.HybridTrack`; the sequences whose step goes to the draft model draft
together, one draft pass per depth (:class:`~draftwise.engine.draft_slots.BatchedDraftModel`). A sequence that
drafted from its suffix index for a while leaves its draft slot behind; the draft catches it up on the skipped
tokens at its next draft-model step (priced: those rows are the first draft pass's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from draftwise.engine.draft_slots import BatchedDraftModel
from draftwise.engine.proposers import BatchProposer, StepPricing
from draftwise.engine.sequence import BatchSequence
from draftwise.proposers.base import DraftProposal
from draftwise.proposers.hybrid import (
    DRAFT_MODEL,
    SUFFIX,
    HybridPolicy,
    HybridStepCounts,
    HybridTrack,
    LearnedState,
    assign_sides,
)
from draftwise.proposers.suffix import SuffixDraft, SuffixProposer

__all__ = ["BatchedHybrid"]


@dataclass
class _Lane:
    """One sequence's suffix proposer and learning track."""

    suffix: SuffixProposer
    track: HybridTrack


@dataclass
class _KeptHybrid:
    """What a finished sequence leaves in the prefix cache: the draft model's KV state (None: not kept) and the
    suffix side's request index (:class:`~draftwise.proposers.suffix.KeptSuffixIndex`)."""

    draft: Any
    suffix: Any

    @property
    def nbytes(self) -> int:
        """Bytes of both states (the draft model's KV state and the suffix index's estimate)."""
        return int(getattr(self.draft, "nbytes", 0)) + int(getattr(self.suffix, "nbytes", 0))


@dataclass
class _Candidate:
    """A sequence's step before its side is chosen."""

    sequence: BatchSequence
    k: int
    state: LearnedState
    suffix_draft: SuffixDraft
    learns_cost: bool  # its previous step drafted with the model too (no catch-up in this call) on shared state


class BatchedHybrid(HybridStepCounts, BatchProposer):
    """Hybrid drafting for every decoding sequence of a batch (SuffixDecoding's per-step choice, Oliaro et al.
    2024, priced by :class:`~draftwise.proposers.hybrid.HybridPolicy`).

    Args:
        suffix_factory: makes a new sequence's suffix proposer (they may share one cross-request index).
        draft: the batched draft model (its slots: the engine's).
        policy: the choice and what it learns (shared by every sequence; a seeded sampling request learns on
            its own track).
        clock: seconds (injectable for tests).

    Attributes:
        num_suffix_steps, num_draft_steps, num_plain_steps: sequence-steps by side, all sequences together (the
            policy's :attr:`~draftwise.proposers.hybrid.HybridPolicy.steps`; each sequence's own are its
            statistics' ``hybrid_steps``).
    """

    name = "hybrid"
    drafts_first = False  # K is planned first (the draft model's passes are priced), then each side drafts it
    wants_pricing = True  # the sides are chosen for the whole step, on the engine's measured pass costs

    def __init__(self, suffix_factory: Callable[[], SuffixProposer], draft: BatchedDraftModel, policy: HybridPolicy,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._suffix_factory = suffix_factory
        self.draft = draft
        self.policy = policy
        self.clock = clock
        self._lanes: dict[int, _Lane] = {}

    @property
    def drafting_model(self) -> BatchedDraftModel:
        return self.draft

    def open(self, sequence: BatchSequence) -> None:
        suffix = self._suffix_factory()
        suffix.start(sequence.prompt, scope=sequence.scope)
        self._lanes[sequence.seq_id] = _Lane(suffix, HybridTrack())
        self.draft.open(sequence)

    def close(self, sequence: BatchSequence) -> None:
        lane = self._lanes.pop(sequence.seq_id, None)
        if lane is not None:
            lane.suffix.finish()
        self.draft.close(sequence)

    def export_state(self, sequence: BatchSequence) -> _KeptHybrid:
        """Both sides' kept states: the draft model's KV state and the suffix side's request index."""
        lane = self._lanes.get(sequence.seq_id)
        return _KeptHybrid(self.draft.export_state(sequence), None if lane is None else lane.suffix.export_state())

    def import_state(self, sequence: BatchSequence, state: Any, length: int) -> None:
        kept = state if isinstance(state, _KeptHybrid) else _KeptHybrid(None, None)
        self.draft.import_state(sequence, kept.draft, length)
        lane = self._lanes.get(sequence.seq_id)
        if lane is not None:
            lane.suffix.import_state(kept.suffix)

    def propose(self, requests: Sequence[tuple[BatchSequence, int]],
                pricing: StepPricing | None = None) -> list[DraftProposal]:
        """Each sequence's suffix draft or a draft-model draft (or none: a plain step), chosen together by
        :func:`~draftwise.proposers.hybrid.assign_sides` over the step's measured ``pricing``; without it, each
        sequence alone by :meth:`HybridPolicy.choose` (the one-request hybrid's rule)."""
        candidates = [self._candidate(sequence, k) for sequence, k in requests]
        sides = self._sides(candidates, pricing)
        proposals: list[DraftProposal] = [DraftProposal(token_ids=())] * len(candidates)
        model_steps = [i for i, side in enumerate(sides) if side == DRAFT_MODEL]
        for i, (candidate, side) in enumerate(zip(candidates, sides)):
            if side == SUFFIX:
                proposals[i] = self.policy.tag(SUFFIX, candidate.suffix_draft.proposal())
                self._track(candidate).remember(SUFFIX, len(candidate.sequence.context), proposals[i],
                                                candidate.suffix_draft.score)
        if model_steps:
            self._draft_with_model([candidates[i] for i in model_steps], model_steps, proposals)
        return proposals

    def _candidate(self, sequence: BatchSequence, k: int) -> _Candidate:
        """Score the sequence's previous draft and look up its suffix draft."""
        lane = self._lanes[sequence.seq_id]
        context = sequence.context
        state, shared = self.policy.state_for(lane.track, sequence.params)
        previous = self.policy.learn_outcome(lane.track, context, state)
        suffix_draft = lane.suffix.best_draft(context, k, use_earlier=shared)
        return _Candidate(sequence, k, state, suffix_draft, shared and previous == DRAFT_MODEL)

    def _sides(self, candidates: list[_Candidate], pricing: StepPricing | None) -> list[str]:
        if pricing is None or pricing.draft_pass_seconds is None:
            return [self.policy.choose(c.suffix_draft, c.k, self.draft.tree_nodes(c.k), c.state) for c in candidates]
        options = [self.policy.options(c.suffix_draft, c.k, self.draft.tree_nodes(c.k), c.state,
                                       self.draft.lacking(c.sequence)) for c in candidates]
        return assign_sides(options, pricing.base_rows, pricing.pass_seconds, pricing.draft_pass_seconds)

    def _track(self, candidate: _Candidate) -> HybridTrack:
        return self._lanes[candidate.sequence.seq_id].track

    def _draft_with_model(self, steps: list[_Candidate], indices: list[int], proposals: list[DraftProposal]) -> None:
        """One batched draft call for ``steps``; its seconds per depth teach the shared draft cost when no
        sequence in it caught up on skipped tokens."""
        t0 = self.clock()
        drafted = self.draft.propose([(step.sequence, step.k) for step in steps])
        seconds = self.clock() - t0
        for index, step, proposal in zip(indices, steps, drafted):
            proposal = proposals[index] = self.policy.tag(DRAFT_MODEL, proposal)
            self._track(step).remember(DRAFT_MODEL, len(step.sequence.context), proposal, 0.0)
        depth = max(proposal.depth for proposal in drafted)
        if depth and all(step.learns_cost for step in steps):
            self.policy.learn_draft_cost(self.policy.learned, seconds / depth)
