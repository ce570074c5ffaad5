"""Hybrid proposer: per step, suffix decoding's draft when its match pays more than the draft model, the draft
model's draft otherwise, chosen by expected committed tokens per second.

SuffixDecoding (Oliaro et al., https://arxiv.org/abs/2411.04975) reports that suffix drafts win on repetitive
(agentic) text and a model-based drafter elsewhere, and combines them per step by the suffix match's score.
Here the choice is the cost model of Leviathan et al. 2023, Sec. 3.4, per step:

- suffix: ``(1 + f * score) / verify(n_s + 1)``, with ``score`` the draft's expected accepted tokens from its
  empirical path probabilities (:attr:`SuffixDraft.score`), ``n_s`` its node count and ``f`` a correction
  learned from this proposer's own suffix steps (accepted / predicted, exponentially forgotten, 1 at first);
- draft model: ``E(K) / (K * c_d + verify(K + 1))``, with ``E(K)`` the expected committed tokens from the
  draft model's measured per-position acceptance and ``c_d`` its seconds per drafted token.

When the suffix index has no match, the other option is a plain step (no draft: 1 token per ``verify(1)``),
so a draft model that is not expected to pay is not run. In the batched engine the same comparison is made for
all decoding sequences at once over the step's measured pass costs (:func:`assign_sides`): there a draft row
lengthens the pass every sequence waits for, and one draft pass serves every sequence drafting at that depth.

``verify(n)`` (seconds of a step whose target pass is over n tokens) is the engine's measured pass plus its own
time per step (:class:`draftwise.speculation.cost_model.StepOverhead`, which favours drafting where passes are short), given
with each step (``pricing``); before the engine has measured, and for the initial ``c_d``, a :class:`StepCosts`
object: the builder passes the cached :func:`draftwise.speculation.calibration.calibrate_cost_model` result (its
``verify_cost`` and ``draft_seconds_per_token``). Acceptance uses
:class:`draftwise.speculation.controller.AcceptanceEstimator` and :func:`draftwise.speculation.controller.expected_tokens` (the
project's one definition of those quantities). The suffix lookup's own time is paid either way and left out.

The engine reports each verified draft's outcome (:meth:`HybridProposer.accept`: how many of its tokens were
accepted), which teaches the side that drafted it. The draft model's cost per token is refined from steps that
follow a draft-model step (after suffix steps its first call also feeds the skipped tokens, which is not a
per-token cost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from draftwise.config import SamplingParams
from draftwise.speculation.controller import AcceptanceEstimator, expected_tokens
from draftwise.proposers.base import DraftProposal, DraftSequence, Proposer, StepPricing
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.suffix import (
    SuffixDraft,
    SuffixProposer,
    uses_earlier_requests,
)
from draftwise.stats import HYBRID_SIDES, hybrid_step_side
from draftwise.tree import children_of, node_depths

__all__ = ["HybridPolicy", "HybridProposer", "HybridTrack", "LearnedState", "SideOptions",
           "StepCosts", "accepted_length", "assign_sides"]

logger = logging.getLogger(__name__)

SUFFIX, DRAFT_MODEL = "suffix", "draft_model"


class StepCosts(Protocol):
    """What the hybrid reads of a cost model (:class:`draftwise.speculation.calibration.CostModel` fits)."""

    draft_seconds_per_token: float

    def verify_cost(self, num_tokens: int) -> float:
        """Seconds of a target pass over ``num_tokens`` (>= 1) new tokens."""


@dataclass(frozen=True)
class _Pending:
    """The previous step's draft, to learn its outcome at the next call."""

    source: str
    context_len: int
    token_ids: tuple[int, ...]
    parents: tuple[int, ...] | None
    predicted: float  # the suffix draft's score (0 for the draft model)


def accepted_length(token_ids: Sequence[int], parents: Sequence[int] | None, committed: Sequence[int]) -> int:
    """How many draft tokens the target accepted, given the tokens it committed after the draft's context.

    A chain's accepted tokens are its longest prefix equal to ``committed``; a tree's, its longest root path
    equal to a prefix of ``committed``. (The token committed after the accepted ones never equals a rejected
    draft token: greedy verification would have accepted it, and rejection sampling's residual gives it no
    mass.)
    """
    if parents is None:
        accepted = 0
        for drafted, actual in zip(token_ids, committed):
            if drafted != actual:
                break
            accepted += 1
        return accepted
    children = children_of(parents)
    node, accepted = -1, 0
    for actual in committed:
        node = next((child for child in children[node] if token_ids[child] == actual), None)
        if node is None:
            break
        accepted += 1
    return accepted


@dataclass(frozen=True)
class SideOptions:
    """One sequence's two ways to draft a step, in expected committed tokens (bonus token included) and rows.

    Attributes:
        suffix_expected: with its suffix draft (1.0 when the draft is empty: a plain step).
        suffix_rows: the suffix draft's nodes (0 when empty).
        model_expected: with a draft-model draft ``model_depth`` tokens deep.
        model_rows: that draft's nodes (``model_depth`` for a chain).
        model_depth: its depth (one draft pass per depth).
        model_catch_up: rows of its first draft pass: the context tokens the draft has not read yet (1 when it
            drafted the previous step; more after suffix steps or a new turn).
    """

    suffix_expected: float
    suffix_rows: int
    model_expected: float
    model_rows: int
    model_depth: int
    model_catch_up: int = 1


def assign_sides(options: Sequence[SideOptions], base_rows: int, pass_seconds: Callable[[int], float],
                 draft_pass_seconds: Callable[[int], float]) -> list[str]:
    """Each sequence's side (``"suffix"`` or ``"draft_model"``) for one step over all of them, chosen for the
    most expected committed tokens per second of the step (Leviathan et al. 2023, Sec. 3.4, summed over a batch):

    ``sum_i E_i / (pass_seconds(base_rows + sum_i rows_i) + sum_{d < max depth} draft_pass_seconds(n_d))``

    with ``n_d`` the sequences on the draft model drafting deeper than d, except the first pass, which feeds
    every such sequence's catch-up rows (``n_0 = sum_i model_catch_up_i``). Every sequence starts on its suffix
    draft (or a plain step); then, one at a time, the sequence whose move to the draft model leaves the best
    rate moves (forward selection, at most n^2 / 2 rate evaluations for n sequences), and the best set along
    the way is kept (a draft pass costs about as much for one row as for a few, so two moves may pay where one
    does not). For one sequence this is the per-step comparison of its two rates.

    Args:
        options: per sequence, its two options.
        base_rows: rows of the pass without any draft (one per decoding sequence, plus prompt chunks).
        pass_seconds: ``rows -> seconds`` of the target pass.
        draft_pass_seconds: ``rows -> seconds`` of one draft-model pass over that many sequences' rows.
    """
    def rate(model: set[int]) -> float:
        expected = sum(o.model_expected if i in model else o.suffix_expected for i, o in enumerate(options))
        rows = base_rows + sum(o.model_rows if i in model else o.suffix_rows for i, o in enumerate(options))
        depths = [options[i].model_depth for i in model]
        first = sum(options[i].model_catch_up for i in model)
        draft_s = sum(draft_pass_seconds(first if d == 0 else sum(1 for depth in depths if depth > d))
                      for d in range(max(depths, default=0)))
        total = pass_seconds(rows) + draft_s
        return expected / total if total > 0 else 0.0

    remaining = [i for i, o in enumerate(options) if o.model_depth > 0 and o.model_expected > o.suffix_expected]
    moved: set[int] = set()
    best, best_rate = set(), rate(set())
    while remaining:  # forward selection: the move that leaves the best rate, then the next; best set kept
        rates = {i: rate(moved | {i}) for i in remaining}
        step = max(remaining, key=lambda i: (rates[i], -i))
        moved.add(step)
        remaining.remove(step)
        if rates[step] > best_rate:
            best, best_rate = set(moved), rates[step]
    return [DRAFT_MODEL if i in best else SUFFIX for i in range(len(options))]


@dataclass
class LearnedState:
    """What the hybrid learns from its own steps.

    Attributes:
        acceptance: the draft model's per-position acceptance.
        draft_seconds_per_token: the draft model's seconds per drafted token.
        suffix_accepted, suffix_predicted: exponentially forgotten sums of accepted tokens and of predicted
            ones (scores) over suffix steps.
    """

    acceptance: AcceptanceEstimator
    draft_seconds_per_token: float
    suffix_accepted: float = 0.0
    suffix_predicted: float = 0.0


class HybridPolicy:
    """The hybrid's per-step choice and what it learns (see the module docstring), for :class:`HybridProposer`.

    What it learns (:attr:`learned`) carries over between requests. A seeded sampling request instead starts
    from the priors and learns from itself only (its :class:`HybridTrack`), with the initial costs (no measured
    times), and its suffix drafts ignore earlier requests
    (:func:`draftwise.proposers.suffix.uses_earlier_requests`): its text then depends only on its seed and prompt.

    Args:
        costs: target verify costs and the draft model's initial seconds per token (:class:`StepCosts`).
        max_k: positions the acceptance estimator tracks initially (K).
        suffix_prior: pseudo-tokens of the suffix correction's prior (f = 1), > 0.
        suffix_decay: forgetting factor of the suffix correction's sums per suffix step, in (0, 1].
        learn_costs: refine the draft model's seconds per token from measured steps.
        cost_smoothing: weight of a new measurement in the running averages, in (0, 1].

    Raises:
        ValueError: on out-of-range arguments.

    Attributes:
        learned: the state learned over requests.
        steps: passes by side over every request (:data:`draftwise.stats.HYBRID_SIDES`, counted by
            :meth:`tag` with the rule each request's statistics use, :func:`draftwise.stats.hybrid_step_side`).
    """

    def __init__(self, costs: StepCosts, *, max_k: int = 5, suffix_prior: float = 4.0, suffix_decay: float = 0.95,
                 learn_costs: bool = True, cost_smoothing: float = 0.1) -> None:
        if suffix_prior <= 0 or not (0.0 < suffix_decay <= 1.0) or not (0.0 < cost_smoothing <= 1.0):
            raise ValueError("need suffix_prior > 0, 0 < suffix_decay <= 1 and 0 < cost_smoothing <= 1")
        self.costs = costs
        self.max_k = max_k
        self.suffix_prior = suffix_prior
        self.suffix_decay = suffix_decay
        self.learn_costs = learn_costs
        self.cost_smoothing = cost_smoothing
        self.learned = self.initial_state()
        self.steps = dict.fromkeys(HYBRID_SIDES, 0)

    def initial_state(self) -> LearnedState:
        """The priors: acceptance from :class:`AcceptanceEstimator`'s defaults, the cost model's draft cost."""
        return LearnedState(AcceptanceEstimator(self.max_k), float(self.costs.draft_seconds_per_token))

    def state_for(self, track: HybridTrack, params: SamplingParams) -> tuple[LearnedState, bool]:
        """The state a request's step reads and updates, and whether it may use earlier requests (the shared
        :attr:`learned` then; a seeded sampling request's own state otherwise)."""
        if uses_earlier_requests(params):
            return self.learned, True
        track.own_state = track.own_state or self.initial_state()
        return track.own_state, False

    def suffix_correction(self, state: LearnedState | None = None) -> float:
        """f: accepted / predicted tokens of the suffix drafts so far (prior: 1)."""
        state = state or self.learned
        return (state.suffix_accepted + self.suffix_prior) / (state.suffix_predicted + self.suffix_prior)

    def options(self, draft: SuffixDraft, k: int, nodes: int, state: LearnedState | None = None,
                catch_up: int = 1) -> SideOptions:
        """A step's two options: this suffix draft (expected tokens ``1 + f * score``, at most its length + 1)
        or a draft-model draft ``k`` tokens deep of ``nodes`` nodes (the draft's measured acceptance by
        position) whose first pass feeds ``catch_up`` rows."""
        state = state or self.learned
        suffix_expected = 1.0 + min(self.suffix_correction(state) * draft.score, float(len(draft)))
        model_expected = expected_tokens(state.acceptance.rates(k)) if k > 0 else 1.0
        return SideOptions(suffix_expected, len(draft), model_expected, nodes if k > 0 else 0, k, catch_up)

    def choose(self, draft: SuffixDraft, k: int, nodes: int, state: LearnedState | None = None,
               step_seconds: Callable[[int], float] | None = None) -> str:
        """One request's side for a step (:func:`assign_sides` for one sequence, priced by ``step_seconds`` (rows
        -> seconds of the step's target pass with the engine's own time per step, as the engine measures it) or,
        without it, :attr:`costs`' verify times, and the learned seconds per draft token; a catch-up after suffix
        steps is not priced): ``"suffix"`` when its suffix draft (or, when that is empty, a plain step) is
        expected to commit tokens at least as fast as the draft model, else ``"draft_model"``."""
        state = state or self.learned
        option = self.options(draft, k, nodes, state)
        step_seconds = step_seconds or self.costs.verify_cost
        return assign_sides([option], 1, step_seconds, lambda rows: state.draft_seconds_per_token)[0]

    def tag(self, side: str, proposal: DraftProposal) -> DraftProposal:
        """``proposal`` marked with the side that made it (``hybrid_side``, which the engine counts per request;
        ``model_drafted`` False for the suffix side), counted in :attr:`steps`."""
        self.steps[hybrid_step_side(side, len(proposal))] += 1
        return replace(proposal, hybrid_side=side, model_drafted=side != SUFFIX)

    def learn(self, state: LearnedState, pending: _Pending, num_accepted: int) -> None:
        """Fold a verified draft's outcome (``num_accepted`` of its tokens, a tree: its accepted path's length)
        into ``state``: a suffix draft's accepted tokens against its predicted score, a draft-model draft's
        acceptance by position."""
        if not pending.token_ids:
            return
        if pending.source == SUFFIX:
            state.suffix_accepted = self.suffix_decay * state.suffix_accepted + num_accepted
            state.suffix_predicted = self.suffix_decay * state.suffix_predicted + pending.predicted
        else:
            depth = len(pending.token_ids) if pending.parents is None else max(node_depths(pending.parents))
            state.acceptance.observe(depth, num_accepted)

    def learn_draft_cost(self, state: LearnedState, seconds_per_token: float) -> None:
        """Fold a measured draft-model cost (seconds per drafted token) into ``state``."""
        if self.learn_costs and seconds_per_token > 0:
            state.draft_seconds_per_token += self.cost_smoothing * (seconds_per_token - state.draft_seconds_per_token)


@dataclass
class HybridTrack:
    """One request's place in the hybrid's learning: its pending draft (scored when the engine reports its
    outcome, :meth:`HybridProposer.accept`), the side of its last step, and, for a seeded sampling request, its
    own :class:`LearnedState`."""

    pending: _Pending | None = None
    own_state: LearnedState | None = None
    last_source: str = ""

    def remember(self, source: str, context_len: int, proposal: DraftProposal, predicted: float) -> None:
        """Keep this step's draft until its outcome comes (``predicted``: a suffix draft's score, else 0)."""
        self.pending = _Pending(source, context_len, proposal.token_ids, proposal.parents, predicted)
        self.last_source = source


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

    sequence: DraftSequence
    k: int
    state: LearnedState
    suffix_draft: SuffixDraft
    learns_cost: bool  # its previous step drafted with the model too (no catch-up in this call) on shared state


class HybridProposer(Proposer):
    """Suffix decoding or a draft model, chosen per sequence and step by a :class:`HybridPolicy` (SuffixDecoding's
    per-step choice, Oliaro et al. 2024, priced as in the module docstring), for all sequences of a step together.

    Each sequence has its own suffix proposer (all sharing one cross-request index) and its own
    :class:`HybridTrack`; the sequences whose step goes to the draft model draft together, one draft pass per
    depth (:class:`~draftwise.proposers.draft_model.DraftModelProposer`). A sequence that drafted from its suffix
    index for a while leaves its draft slot behind; the draft catches it up on the skipped tokens at its next
    draft-model step. The outcome of each step's draft comes through :meth:`accept`.

    How a step's sides are chosen: with the engine's measured ``pricing`` of the target's and the draft's passes
    (a draft with a slot per sequence), for all sequences together (:func:`assign_sides`, catch-up rows priced);
    otherwise each sequence alone by :meth:`HybridPolicy.choose`, on the engine's measured step
    (``pricing.pass_seconds``) for a one-slot draft, on ``costs`` before anything is measured.

    Args:
        suffix: the suffix proposer shared by the consecutive requests of a one-slot engine (it keeps its request
            index between them and archives a request's output when the next starts), or a factory making one per
            sequence (they may share one cross-request index; their indexes go to the prefix cache with the
            draft's state).
        draft: the draft-model proposer (its slots: the engine's).
        costs: target verify costs and the draft model's initial seconds per token (:class:`StepCosts`), or the
            :class:`HybridPolicy` to choose with (shared, e.g. with scripted settings; the next arguments are
            then ignored).
        max_k, suffix_prior, suffix_decay, learn_costs, cost_smoothing: see :class:`HybridPolicy`.
        clock: seconds (injectable for tests).
        priced_by_engine: take the engine's measured step costs (``wants_pricing``; default) where it has them;
            False: ``costs`` price every step (scripted costs in tests).

    Raises:
        ValueError: on out-of-range arguments.

    Attributes:
        policy: the choice and what it learned (``learned`` is its state).
        suffix: the shared suffix proposer (None when each sequence makes its own).
        num_suffix_steps, num_draft_steps, num_plain_steps: sequence-steps by side over every request (the
            policy's :attr:`~HybridPolicy.steps`; each request's own are its statistics' ``hybrid_steps``).
    """

    name = "hybrid"
    drafts_first = False  # K is planned first (the draft model's passes are priced), then each side drafts it
    has_sides = True

    def __init__(self, suffix: SuffixProposer | Callable[[], SuffixProposer], draft: DraftModelProposer,
                 costs: StepCosts | HybridPolicy, *, max_k: int = 5, suffix_prior: float = 4.0,
                 suffix_decay: float = 0.95, learn_costs: bool = True, cost_smoothing: float = 0.1,
                 clock: Callable[[], float] = time.perf_counter, priced_by_engine: bool = True) -> None:
        self.wants_pricing = priced_by_engine  # the engine's measured step: its passes and its own time per step
        self.policy = costs if isinstance(costs, HybridPolicy) else HybridPolicy(
            costs, max_k=max_k, suffix_prior=suffix_prior, suffix_decay=suffix_decay, learn_costs=learn_costs,
            cost_smoothing=cost_smoothing)
        self.suffix = suffix if isinstance(suffix, SuffixProposer) else None
        self._suffix_factory = (lambda: suffix) if isinstance(suffix, SuffixProposer) else suffix
        self.draft = draft
        self.clock = clock
        self._lanes: dict[int, _Lane] = {}

    @property
    def drafting_model(self) -> DraftModelProposer | None:
        return self.draft.drafting_model

    @property
    def learned(self) -> LearnedState:
        """The state learned over requests (the policy's)."""
        return self.policy.learned

    @property
    def num_suffix_steps(self) -> int:
        return self.policy.steps[SUFFIX]

    @property
    def num_draft_steps(self) -> int:
        return self.policy.steps[DRAFT_MODEL]

    @property
    def num_plain_steps(self) -> int:
        return self.policy.steps["plain"]

    def suffix_correction(self, state: LearnedState | None = None) -> float:
        """See :meth:`HybridPolicy.suffix_correction`."""
        return self.policy.suffix_correction(state)

    def choose(self, draft: SuffixDraft, k: int, state: LearnedState | None = None,
               step_seconds: Callable[[int], float] | None = None) -> str:
        """:meth:`HybridPolicy.choose` for this proposer's draft model (a chain or its tree's nodes)."""
        return self.policy.choose(draft, k, self.draft.tree_nodes(k), state, step_seconds)

    def open(self, sequence: DraftSequence) -> None:
        suffix = self._suffix_factory()
        suffix.start(sequence.prompt, scope=sequence.scope)
        self._lanes[sequence.seq_id] = _Lane(suffix, HybridTrack())
        self.draft.open(sequence)

    def close(self, sequence: DraftSequence) -> None:
        lane = self._lanes.pop(sequence.seq_id, None)
        if lane is not None and self.suffix is None:  # a shared suffix proposer archives at its next start
            lane.suffix.finish()
        self.draft.close(sequence)

    def export_state(self, sequence: DraftSequence) -> Any:
        """The draft model's kept state and, for per-sequence suffix proposers, the suffix side's request index
        (a shared suffix proposer keeps its own between requests)."""
        if self.suffix is not None:
            return self.draft.export_state(sequence)
        lane = self._lanes.get(sequence.seq_id)
        return _KeptHybrid(self.draft.export_state(sequence), None if lane is None else lane.suffix.export_state())

    def import_state(self, sequence: DraftSequence, state: Any, length: int) -> None:
        if self.suffix is not None:
            self.draft.import_state(sequence, state, length)
            return
        kept = state if isinstance(state, _KeptHybrid) else _KeptHybrid(None, None)
        self.draft.import_state(sequence, kept.draft, length)
        lane = self._lanes.get(sequence.seq_id)
        if lane is not None:
            lane.suffix.import_state(kept.suffix)

    def propose(self, requests: Sequence[tuple[DraftSequence, int]],
                pricing: StepPricing | None = None) -> list[DraftProposal]:
        """Each sequence's suffix draft or a draft-model draft (or none: a plain step), its side chosen as the
        class docstring says."""
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

    def accept(self, sequence: DraftSequence, num_accepted: int) -> None:
        """Learn from the sequence's last draft: ``num_accepted`` of its tokens were accepted (its side's
        acceptance, or the suffix correction, in the state it read)."""
        lane = self._lanes.get(sequence.seq_id)
        if lane is None or lane.track.pending is None:
            return
        pending, lane.track.pending = lane.track.pending, None
        state, _ = self.policy.state_for(lane.track, sequence.params)
        self.policy.learn(state, pending, num_accepted)

    def _candidate(self, sequence: DraftSequence, k: int) -> _Candidate:
        """Look up the sequence's suffix draft, with the state its step reads."""
        lane = self._lanes[sequence.seq_id]
        context = sequence.context
        state, shared = self.policy.state_for(lane.track, sequence.params)
        suffix_draft = lane.suffix.best_draft(context, k, use_earlier=shared)
        return _Candidate(sequence, k, state, suffix_draft, shared and lane.track.last_source == DRAFT_MODEL)

    def _sides(self, candidates: list[_Candidate], pricing: StepPricing | None) -> list[str]:
        if pricing is None or pricing.draft_pass_seconds is None:
            measured = pricing is not None and self.draft.drafting_model is None
            step_seconds = pricing.pass_seconds if measured else None
            return [self.choose(c.suffix_draft, c.k, c.state, step_seconds) for c in candidates]
        options = [self.policy.options(c.suffix_draft, c.k, self.draft.tree_nodes(c.k), c.state,
                                       self.draft.lacking(c.sequence)) for c in candidates]
        return assign_sides(options, pricing.base_rows, pricing.pass_seconds, pricing.draft_pass_seconds)

    def _track(self, candidate: _Candidate) -> HybridTrack:
        return self._lanes[candidate.sequence.seq_id].track

    def _draft_with_model(self, steps: list[_Candidate], indices: list[int], proposals: list[DraftProposal]) -> None:
        """One draft call for ``steps``; its seconds per depth teach the shared draft cost when every sequence in
        it drafted its previous step with the model too (no catch-up on skipped tokens)."""
        t0 = self.clock()
        drafted = self.draft.propose([(step.sequence, step.k) for step in steps])
        seconds = self.clock() - t0
        for index, step, proposal in zip(indices, steps, drafted):
            proposal = proposals[index] = self.policy.tag(DRAFT_MODEL, proposal)
            self._track(step).remember(DRAFT_MODEL, len(step.sequence.context), proposal, 0.0)
        depth = max(proposal.depth for proposal in drafted)
        if depth and all(step.learns_cost for step in steps):
            self.policy.learn_draft_cost(self.policy.learned, seconds / depth)
