"""The proposer interface: the one way the engine core asks for drafts and tells their outcome.

A :class:`Proposer` drafts for a batch of sequences at once (:meth:`Proposer.propose`: up to k tokens deep per
sequence) and is told, after the target verified a sequence's draft, how many of its tokens were accepted
(:meth:`Proposer.accept`; llama.cpp's speculative ``draft`` / ``accept``, transformers'
``update_candidate_strategy``). A draft carries its draft distributions ``draft_probs`` when it was sampled from
a distribution (a draft model at temperature > 0 under rejection sampling), or ``None`` when it is deterministic
(greedy draft model, n-gram lookup, heads, or a draft chosen with the request's Gumbel noise under coupled
sampling). A deterministic draft is verified as a one-hot ``draft_probs``, which keeps speculative sampling
lossless.

Proposers keep whatever state they need per sequence (a draft model's KV cache slot, an n-gram index) and
reconcile it with the committed context they see at each call (rollback by longest common prefix), so rejected
draft tokens need no separate rollback call.

A method that keeps one state per sequence and drafts one context at a time (n-gram lookup, suffix decoding,
the Medusa and EAGLE heads, test scripts) is written as a :class:`SequenceProposer` (a lookup over one context)
and reaches the engine as a :class:`Proposer` through :class:`PerSequenceProposers`, one instance per sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from draftwise.config import SamplingParams
from draftwise.processors.base import LogitsProcessor
from draftwise.sampling import Sampler
from draftwise.tree import chain_parents, check_parents, node_depths

__all__ = ["DraftProposal", "DraftSequence", "PerSequenceProposers", "Proposer", "SequenceProposer", "StepPricing",
           "check_proposal", "common_prefix_length"]


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens offered for one verification pass.

    Attributes:
        token_ids: ``[k]`` draft token ids, k >= 0 (a tree's nodes, in topological order).
        draft_probs: ``[k, vocab]`` float32 distributions the tokens were sampled from (vocab = the target's
            logits width), or None for a deterministic draft. Trees must be deterministic.
        parents: None for a chain; for a draft tree, ``[k]`` parent node indices (-1 = the last committed
            token), see :mod:`draftwise.tree`. A chain-shaped ``parents`` (each node the child of the one
            before) is stored as None: a chain is the tree whose nodes each have one child.
        hybrid_side: the side of the hybrid proposer that made it (``"suffix"``, also for its empty draft, or
            ``"draft_model"``); the engine counts the request's passes by it
            (:meth:`~draftwise.stats.SpeculativeStats.record_hybrid_step`). "" from every other proposer.
        model_drafted: False when a proposer that runs a draft model drafted this step without it (the hybrid's
            suffix side, also for its empty draft): the draft model fell behind, and the step teaches a K policy
            nothing of its costs (:meth:`draftwise.controller.KController.observe`). True otherwise.
        jump_forward: the tokens spell the only continuation text the request's grammar admits (jump-forward,
            not the proposer's draft); counted apart from the proposer's drafts.
    """

    token_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None
    hybrid_side: str = ""
    model_drafted: bool = True
    jump_forward: bool = False

    def __post_init__(self) -> None:
        if self.parents is not None and tuple(self.parents) == chain_parents(len(self.token_ids)):
            object.__setattr__(self, "parents", None)
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.token_ids)} draft tokens"
            )
        if self.parents is not None:
            if len(self.parents) != len(self.token_ids):
                raise ValueError(f"{len(self.parents)} parents for {len(self.token_ids)} tree nodes")
            check_parents(self.parents)
            if self.draft_probs is not None:
                raise ValueError("draft trees must be deterministic (draft_probs None)")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def node_parents(self) -> tuple[int, ...]:
        """Parent of every node, for a chain too (``(-1, 0, ..., k-2)``): what the verifiers take."""
        return self.parents if self.parents is not None else chain_parents(len(self.token_ids))

    @property
    def depth(self) -> int:
        """Longest root-to-node path: the most draft tokens one verification can accept."""
        return max(node_depths(self.parents), default=0) if self.parents is not None else len(self.token_ids)

    def truncated(self, num_nodes: int) -> "DraftProposal":
        """The first ``num_nodes`` tokens / tree nodes (a prefix of a topological order is a tree)."""
        if num_nodes >= len(self.token_ids):
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:num_nodes]
        parents = None if self.parents is None else self.parents[:num_nodes]
        return DraftProposal(self.token_ids[:num_nodes], probs, parents, self.hybrid_side, self.model_drafted,
                             self.jump_forward)


@dataclass(frozen=True)
class StepPricing:
    """What a step's drafts cost, for a proposer that weighs them against the batch (``wants_pricing``).

    Attributes:
        base_rows: rows of the step's target pass without any draft (one per decoding sequence, plus the
            prompt chunks expected in it).
        pass_seconds: ``rows -> seconds`` of that pass (the engine's measured curve and its own time per step).
        draft_pass_seconds: ``rows -> seconds`` of one pass of the proposer's draft model, or None (no draft
            model, or its passes not measured yet).
    """

    base_rows: int
    pass_seconds: Callable[[int], float]
    draft_pass_seconds: Callable[[int], float] | None = None


class DraftSequence(Protocol):
    """What a proposer reads of a sequence (the engine's :class:`draftwise.engine.sequence.BatchSequence`)."""

    seq_id: int  # unique per engine
    slot: int  # its KV-cache slot (a draft model uses the same index in its own cache)
    prompt: list[int]  # [n] prompt token ids
    params: SamplingParams
    sampler: Sampler
    scope: str  # who may share cached state with it
    processors: LogitsProcessor | None  # its logits processors (a grammar, penalties), moved by committed tokens only

    @property
    def context(self) -> list[int]:
        """Prompt + committed output."""


class Proposer(ABC):
    """The interface every proposer offers the engine: drafts for a batch of sequences, and their outcome.

    Life of a sequence: :meth:`open` when it joins the batch, :meth:`import_state` (a kept prefix's state, or
    None), then per step :meth:`propose` (for the sequences that speculate this step) and, after verification,
    :meth:`accept`; :meth:`observe` for a proposer reading the target's features; :meth:`export_state` and
    :meth:`close` when it leaves.

    Attributes:
        name: method name (``"ngram"``, ``"suffix"``, ``"draft_model"``, ``"hybrid"``, ...).
        drafts_first: True when drafting costs next to nothing (a lookup): under load-aware K the engine drafts
            each sequence's largest K first and plans K knowing the tokens actually offered; False (a model): K
            is planned first and only that many tokens are drafted.
        needs_target_hidden: the proposer reads the target's own features (Medusa, EAGLE): the engine asks the
            backend for hidden states and calls :meth:`observe` after the prefill and every verification.
        wants_pricing: :meth:`propose` weighs drafts against the step's measured costs (:class:`StepPricing`);
            the engine then measures its pass costs at start, whatever its K policy.
        has_sides: the proposer drafts each step from one of several sides (the hybrid: suffix decoding or a
            draft model) and marks its proposals with ``hybrid_side``; the engine counts each request's passes
            by side (:meth:`draftwise.stats.SpeculativeStats.start_hybrid_steps`).
    """

    name: str = "proposer"
    drafts_first: bool = False
    needs_target_hidden: bool = False
    wants_pricing: bool = False
    has_sides: bool = False

    @property
    def drafting_model(self) -> Any:
        """The multi-slot draft model this proposer drafts with
        (:class:`~draftwise.proposers.draft_model.DraftModelProposer` with a slot per sequence: its cache slots
        ``num_slots``, ``slots.backend`` and ``pass_costs``, which the engine calibrates and prices), or None."""
        return None

    def open(self, sequence: DraftSequence) -> None:
        """A sequence joined the batch (its slot is set). Default: nothing."""

    def close(self, sequence: DraftSequence) -> None:
        """A sequence left the batch. Default: nothing."""

    def export_state(self, sequence: DraftSequence) -> Any:
        """State worth keeping in the prefix cache with the sequence's target KV (:mod:`draftwise.prefix_cache`;
        an ``nbytes`` attribute, when present, counts against its memory budget). Default: None (stateless)."""
        return None

    def import_state(self, sequence: DraftSequence, state: Any, length: int) -> None:
        """Adopt a kept state for the first ``length`` tokens of the sequence's prompt; ``state`` None (and
        ``length`` 0): the sequence starts without one. Called before its first :meth:`propose`. Default:
        nothing."""

    def observe(self, sequence: DraftSequence, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        """Target features of the positions just committed to the sequence's slot (``needs_target_hidden``).

        Args:
            hidden: ``[m, H]`` the target's last hidden states (after the final norm) at those positions, in
                order: all prompt positions after the prefill; the last committed token and the accepted draft
                tokens after a verification.
            next_token_ids: ``[m]`` the committed token that follows each position.
        """

    @abstractmethod
    def propose(self, requests: Sequence[tuple[DraftSequence, int]],
                pricing: StepPricing | None = None) -> list[DraftProposal]:
        """Draft at most ``k`` (>= 1) tokens deep for each ``(sequence, k)``, after its committed context.

        May return fewer tokens, including none (the engine then takes a plain decoding step). A proposer that
        samples draws through the sequence's ``sampler`` (``sampler.choose(logits, position)``, the draft token at
        sequence position ``len(context) + depth - 1``), so that seeded requests are reproducible and, under
        coupled sampling, its draft shares the target's Gumbel noise. ``pricing``: the step's measured costs
        (given to a proposer that ``wants_pricing``, once measured; None otherwise).

        Returns:
            one proposal per request, in order.
        """

    def accept(self, sequence: DraftSequence, num_accepted: int) -> None:
        """The target verified the sequence's last proposal and accepted its first ``num_accepted`` tokens (a
        tree: the accepted root path's length); the token after them is the target's own. Called after every
        verification of a sequence that speculates (also when it drafted nothing this step), except the step that
        ended it (a stop cuts it; it tells nothing of later steps). Default: nothing (a proposer reconciles its
        state with the context at its next :meth:`propose`)."""


class SequenceProposer(ABC):
    """A proposer written for one sequence at a time (one instance per sequence, or one shared by the consecutive
    requests of a one-slot engine); it reaches the engine through :class:`PerSequenceProposers`.

    Attributes:
        name, drafts_first, needs_target_hidden, wants_pricing: see :class:`Proposer`.
    """

    name: str = "proposer"
    drafts_first: bool = False
    needs_target_hidden: bool = False
    wants_pricing: bool = False

    def start(self, prompt_ids: Sequence[int], *, scope: str = "") -> None:
        """Begin a new request whose prompt is ``prompt_ids`` (reset per-request state). Default: nothing.

        ``scope`` names who sent the request (the server passes the API key's or ``user``'s scope): a proposer
        that learns from earlier requests (suffix decoding) uses only the earlier requests of the same scope.
        """

    def finish(self) -> None:
        """The request that :meth:`start` began has ended (it left the batch). Default: nothing."""

    def export_state(self) -> Any:
        """See :meth:`Proposer.export_state`. Default: None (stateless)."""
        return None

    def import_state(self, state: Any) -> None:
        """Adopt a state from :meth:`export_state` (same scope, same engine), or start empty when ``state`` is
        None. Default: nothing."""

    def observe(self, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        """See :meth:`Proposer.observe` (``hidden [m, H]``, ``next_token_ids [m]``). Default: nothing."""

    @abstractmethod
    def propose(
        self,
        context_ids: Sequence[int],
        k: int,
        params: SamplingParams,
        sampler: Sampler,
    ) -> DraftProposal:
        """Offer at most ``k`` (>= 1) draft tokens to follow ``context_ids`` (prompt + committed output); see
        :meth:`Proposer.propose` (the draft token at depth d is drawn at position ``len(context_ids) + d - 1``)."""


class PerSequenceProposers(Proposer):
    """A :class:`Proposer` of one :class:`SequenceProposer` per sequence, made by ``factory``.

    Args:
        factory: makes the proposer of a new sequence (instances may share read-mostly state, e.g. the suffix
            proposer's cross-request index; an engine of one slot may return the same instance every time).
        name: the method name.
        drafts_first: see :class:`Proposer` (True for lookups, False for a model).
        needs_target_hidden: the factory's proposers read the target's hidden states.
        wants_pricing: the factory's proposers take the step's ``pricing`` (``propose(..., pricing=)``).
    """

    def __init__(self, factory: Callable[[], SequenceProposer], name: str, *, drafts_first: bool = True,
                 needs_target_hidden: bool = False, wants_pricing: bool = False) -> None:
        self._factory = factory
        self.name = name
        self.drafts_first = drafts_first
        self.needs_target_hidden = needs_target_hidden
        self.wants_pricing = wants_pricing
        self._proposers: dict[int, SequenceProposer] = {}

    @classmethod
    def of(cls, proposer: SequenceProposer) -> PerSequenceProposers:
        """One shared instance for every sequence (an engine of one slot runs one sequence at a time)."""
        return cls(lambda: proposer, proposer.name, drafts_first=proposer.drafts_first,
                   needs_target_hidden=proposer.needs_target_hidden, wants_pricing=proposer.wants_pricing)

    def open(self, sequence: DraftSequence) -> None:
        proposer = self._factory()
        if proposer.needs_target_hidden and not self.needs_target_hidden:
            raise ValueError(f"proposer {proposer.name!r} reads the target's hidden states; build it with "
                             "needs_target_hidden=True on a backend that returns them")
        proposer.start(sequence.prompt, scope=sequence.scope)
        self._proposers[sequence.seq_id] = proposer

    def close(self, sequence: DraftSequence) -> None:
        proposer = self._proposers.pop(sequence.seq_id, None)
        if proposer is not None:
            proposer.finish()

    def export_state(self, sequence: DraftSequence) -> Any:
        return self._proposers[sequence.seq_id].export_state()

    def import_state(self, sequence: DraftSequence, state: Any, length: int) -> None:
        self._proposers[sequence.seq_id].import_state(state)

    def observe(self, sequence: DraftSequence, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        self._proposers[sequence.seq_id].observe(hidden, list(next_token_ids))

    def propose(self, requests: Sequence[tuple[DraftSequence, int]],
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


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists.

    One slice comparison when ``a`` is a prefix of ``b`` (the common case); otherwise a binary search over
    prefix equality (O(n log n) element comparisons, all in C).
    """
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low
