"""The engine core's face of the hybrid proposer: suffix decoding or the batched draft model, chosen per
sequence and step by the one :class:`~draftwise.proposers.hybrid.HybridPolicy`.

Each sequence has its own suffix proposer (sharing one cross-request index, as ``suffix`` in the batch does) and
its own :class:`~draftwise.proposers.hybrid.HybridTrack`; the sequences whose step goes to the draft model draft
together, one draft pass per depth (:class:`~draftwise.engine.draft_slots.BatchedDraftModel`). A sequence that
drafted from its suffix index for a while leaves its draft slot behind; the draft catches it up on the skipped
tokens at its next draft-model step, as the one-request hybrid does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from draftwise.engine.draft_slots import BatchedDraftModel
from draftwise.engine.proposers import BatchProposer
from draftwise.engine.sequence import BatchSequence
from draftwise.proposers.base import DraftProposal
from draftwise.proposers.hybrid import DRAFT_MODEL, SUFFIX, HybridPolicy, HybridTrack, LearnedState
from draftwise.proposers.suffix import SuffixProposer

__all__ = ["BatchedHybrid"]


@dataclass
class _Lane:
    """One sequence's suffix proposer and learning track."""

    suffix: SuffixProposer
    track: HybridTrack


@dataclass
class _ModelStep:
    """A sequence whose step drafts with the draft model."""

    index: int
    sequence: BatchSequence
    k: int
    state: LearnedState
    learns_cost: bool  # its previous step drafted with the model too (no catch-up in this call) on shared state


class BatchedHybrid(BatchProposer):
    """Hybrid drafting for every decoding sequence of a batch (SuffixDecoding's per-step choice, Oliaro et al.
    2024, priced by :class:`~draftwise.proposers.hybrid.HybridPolicy`).

    Args:
        suffix_factory: makes a new sequence's suffix proposer (they may share one cross-request index).
        draft: the batched draft model (its slots: the engine's).
        policy: the choice and what it learns (shared by every sequence; a seeded sampling request learns on
            its own track).
        clock: seconds (injectable for tests).

    Attributes:
        num_suffix_steps, num_draft_steps: sequence-steps drafted by each side.
    """

    name = "hybrid"
    drafts_first = False  # K is planned first (the draft model's passes are priced), then each side drafts it

    def __init__(self, suffix_factory: Callable[[], SuffixProposer], draft: BatchedDraftModel, policy: HybridPolicy,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._suffix_factory = suffix_factory
        self.draft = draft
        self.policy = policy
        self.clock = clock
        self.pass_costs = draft.pass_costs
        self._lanes: dict[int, _Lane] = {}
        self.num_suffix_steps = 0
        self.num_draft_steps = 0

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

    def export_state(self, sequence: BatchSequence) -> Any:
        """The draft model's kept state (the suffix side keeps its own index)."""
        return self.draft.export_state(sequence)

    def import_state(self, sequence: BatchSequence, state: Any, length: int) -> None:
        self.draft.import_state(sequence, state, length)

    def propose(self, requests: Sequence[tuple[BatchSequence, int]]) -> list[DraftProposal]:
        proposals: list[DraftProposal] = [DraftProposal(token_ids=())] * len(requests)
        model_steps: list[_ModelStep] = []
        for index, (sequence, k) in enumerate(requests):
            lane = self._lanes[sequence.seq_id]
            context = sequence.context
            state, shared = self.policy.state_for(lane.track, sequence.params)
            previous = self.policy.learn_outcome(lane.track, context, state)
            suffix_draft = lane.suffix.best_draft(context, k, use_earlier=shared)
            if self.policy.choose(suffix_draft, k, self.draft.tree_nodes(k), state) == SUFFIX:
                self.num_suffix_steps += 1
                proposals[index] = suffix_draft.proposal()
                lane.track.remember(SUFFIX, len(context), proposals[index], suffix_draft.score)
            else:
                model_steps.append(_ModelStep(index, sequence, k, state, shared and previous == DRAFT_MODEL))
        if model_steps:
            self._draft_with_model(model_steps, proposals)
        return proposals

    def _draft_with_model(self, steps: list[_ModelStep], proposals: list[DraftProposal]) -> None:
        """One batched draft call for ``steps``; its seconds per depth teach the shared draft cost when no
        sequence in it caught up on skipped tokens."""
        self.num_draft_steps += len(steps)
        t0 = self.clock()
        drafted = self.draft.propose([(step.sequence, step.k) for step in steps])
        seconds = self.clock() - t0
        for step, proposal in zip(steps, drafted):
            proposals[step.index] = proposal
            self._lanes[step.sequence.seq_id].track.remember(DRAFT_MODEL, len(step.sequence.context), proposal, 0.0)
        depth = max(proposal.depth for proposal in drafted)
        if depth and all(step.learns_cost for step in steps):
            self.policy.learn_draft_cost(self.policy.learned, seconds / depth)
