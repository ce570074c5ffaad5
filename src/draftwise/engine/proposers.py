"""How the engine core asks for drafts: one :class:`BatchProposer` for all running sequences.

A model-free proposer (n-gram, suffix) or any :class:`~draftwise.proposers.base.Proposer` runs one instance
per sequence through :class:`PerSequenceProposers`; a multi-slot lean draft model drafts for every sequence in
one pass per depth (:class:`draftwise.engine.draft_slots.BatchedDraftModel`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draftwise.engine.sequence import BatchSequence
from draftwise.proposers.base import DraftProposal, Proposer

__all__ = ["BatchProposer", "PerSequenceProposers", "StepPricing", "check_proposal"]


@dataclass(frozen=True)
class StepPricing:
    """What a step's drafts cost, for a proposer that weighs them against the batch (``wants_pricing``).

    Attributes:
        base_rows: rows of the step's target pass without any draft (one per decoding sequence, plus the
            prompt chunks expected in it).
        pass_seconds: ``rows -> seconds`` of that pass (the engine's measured curve).
        draft_pass_seconds: ``rows -> seconds`` of one pass of the proposer's draft model, or None.
    """

    base_rows: int
    pass_seconds: Callable[[int], float]
    draft_pass_seconds: Callable[[int], float] | None = None


class BatchProposer(ABC):
    """Drafts for the decoding sequences of a batch (one state per sequence).

    Attributes:
        name: method name (``"ngram"``, ``"suffix"``, ``"draft_model"``, ...).
        drafts_first: True when drafting costs next to nothing (a lookup): under load-aware K the engine drafts
            each sequence's largest K first and plans K knowing the tokens actually offered; False (a draft
            model): K is planned first and only that many tokens are drafted.
        needs_target_hidden: the proposer reads the target's hidden states (Medusa, EAGLE): the engine asks the
            backend for them and calls :meth:`observe`.
        wants_pricing: :meth:`propose` weighs drafts against the step's measured costs (:class:`StepPricing`);
            the engine then measures its pass costs at start, whatever its K policy.
    """

    name: str = "proposer"
    drafts_first: bool = True
    needs_target_hidden: bool = False
    wants_pricing: bool = False

    @property
    def drafting_model(self) -> BatchProposer | None:
        """The multi-slot draft model this proposer drafts with
        (:class:`~draftwise.engine.draft_slots.BatchedDraftModel`: its cache slots and pass costs), or None."""
        return None

    def open(self, sequence: BatchSequence) -> None:
        """A sequence joined the batch (its slot is set). Default: nothing."""

    def close(self, sequence: BatchSequence) -> None:
        """A sequence left the batch. Default: nothing."""

    def export_state(self, sequence: BatchSequence) -> Any:
        """State worth keeping in the prefix cache with the sequence's target KV (default None)."""
        return None

    def import_state(self, sequence: BatchSequence, state: Any, length: int) -> None:
        """Adopt a kept state for the first ``length`` tokens of the sequence's prompt; ``state`` None (and
        ``length`` 0): the sequence starts without one. Default: nothing."""

    def observe(self, sequence: BatchSequence, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        """The target's hidden states ``[m, H]`` of the positions just committed to the sequence's slot and the
        ``[m]`` tokens that follow them (``needs_target_hidden`` only). Default: nothing."""

    @abstractmethod
    def propose(self, requests: Sequence[tuple[BatchSequence, int]],
                pricing: StepPricing | None = None) -> list[DraftProposal]:
        """Draft at most ``k`` tokens deep for each ``(sequence, k)`` (k >= 1), after its committed context;
        ``pricing``: the step's costs (given to a proposer that ``wants_pricing``, when measured).

        Raises:
            RuntimeError: a proposer returned more than k tokens deep.
        """


class PerSequenceProposers(BatchProposer):
    """One :class:`~draftwise.proposers.base.Proposer` per sequence, made by ``factory``.

    Args:
        factory: makes the proposer of a new sequence (instances may share read-mostly state, e.g. the suffix
            proposer's cross-request index; an engine of one slot may return the same instance every time).
        name: the method name.
        drafts_first: see :class:`BatchProposer` (True for lookups, False for a model).
        needs_target_hidden: the factory's proposers read the target's hidden states.
        wants_pricing: the factory's proposers take the step's ``pricing`` (:attr:`Proposer.wants_pricing`).
    """

    def __init__(self, factory: Callable[[], Proposer], name: str, *, drafts_first: bool = True,
                 needs_target_hidden: bool = False, wants_pricing: bool = False) -> None:
        self._factory = factory
        self.name = name
        self.drafts_first = drafts_first
        self.needs_target_hidden = needs_target_hidden
        self.wants_pricing = wants_pricing
        self._proposers: dict[int, Proposer] = {}

    @classmethod
    def of(cls, proposer: Proposer) -> PerSequenceProposers:
        """One shared instance for every sequence (an engine of one slot runs one sequence at a time)."""
        return cls(lambda: proposer, proposer.name, drafts_first=proposer.name in ("ngram", "suffix"),
                   needs_target_hidden=proposer.needs_target_hidden, wants_pricing=proposer.wants_pricing)

    def open(self, sequence: BatchSequence) -> None:
        proposer = self._factory()
        if proposer.needs_target_hidden and not self.needs_target_hidden:
            raise ValueError(f"proposer {proposer.name!r} reads the target's hidden states; build it with "
                             "needs_target_hidden=True on a backend that returns them")
        proposer.start(sequence.prompt, scope=sequence.scope)
        self._proposers[sequence.seq_id] = proposer

    def close(self, sequence: BatchSequence) -> None:
        proposer = self._proposers.pop(sequence.seq_id, None)
        if proposer is not None:
            proposer.finish()

    def export_state(self, sequence: BatchSequence) -> Any:
        return self._proposers[sequence.seq_id].export_state()

    def import_state(self, sequence: BatchSequence, state: Any, length: int) -> None:
        self._proposers[sequence.seq_id].import_state(state)

    def observe(self, sequence: BatchSequence, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        self._proposers[sequence.seq_id].observe(hidden, list(next_token_ids))

    def propose(self, requests: Sequence[tuple[BatchSequence, int]],
                pricing: StepPricing | None = None) -> list[DraftProposal]:
        proposals = []
        priced = {"pricing": pricing} if self.wants_pricing else {}
        for sequence, k in requests:
            proposal = self._proposers[sequence.seq_id].propose(sequence.context, k, sequence.params, sequence.sampler,
                                                                **priced)
            check_proposal(proposal, k, self.name)
            proposals.append(proposal)
        return proposals


def check_proposal(proposal: DraftProposal, k: int, name: str) -> None:
    """Refuse a proposal deeper than ``k`` tokens.

    Raises:
        RuntimeError: it is.
    """
    if proposal.depth > k:
        raise RuntimeError(f"proposer {name!r} returned {proposal.depth} tokens deep for k={k}")
