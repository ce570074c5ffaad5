"""The draft step of the engine core: each decoding sequence's K and its proposer's draft, within the step's draft
rows, and what the K policies learn from a step's outcome.

K is fixed (each sequence's cap), a request's own :class:`~draftwise.speculation.controller.KController` (AutoK),
or load-aware for the batch (:func:`~draftwise.speculation.batch_plan.plan_with_probes`, on the step's measured
costs). A proposer whose drafting costs next to nothing (a lookup, ``drafts_first``) drafts each sequence's cap
first and the plan keeps what pays; a draft model drafts only the planned K.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from draftwise.backends.slots import SlotBackend
from draftwise.engine.constraints import constrain, forced_draft
from draftwise.engine.scheduler import StepBudget, fit_rows, within_rows
from draftwise.engine.sequence import BatchSequence
from draftwise.methods import K_POLICIES
from draftwise.proposers.base import DraftProposal, Proposer, StepPricing
from draftwise.speculation.batch_plan import learn_outcome, plan_with_probes
from draftwise.speculation.controller import AcceptanceEstimator, KController
from draftwise.speculation.cost_model import PassCostCurve
from draftwise.speculation.pass_costs import StepClock, draft_pass_seconds, step_seconds

__all__ = ["Drafter", "Drafts", "check_speculation_options", "step_pricing"]

_EMPTY = DraftProposal(token_ids=())


@dataclass(frozen=True)
class Drafts:
    """A step's drafts: ``proposals`` (one per decoding sequence, possibly empty), ``asked`` (whether each was
    asked to draft: its drafting time is charged to it) and ``seconds`` (drafting time)."""

    proposals: list[DraftProposal]
    asked: list[bool]
    seconds: float


def step_pricing(pass_costs: PassCostCurve | None, overhead_s: float, drafting: Proposer | None, base_rows: int,
                 sequences: int) -> StepPricing | None:
    """A step's measured costs (None before any measurement): the target pass over ``sequences`` sequences plus the
    engine's own ``overhead_s`` per step, and a ``drafting`` model's passes (None for a lookup, whose drafting costs
    nothing worth counting). The load-aware K plans on them; a proposer that ``wants_pricing`` gets them."""
    if pass_costs is None or not len(pass_costs):
        return None
    return StepPricing(base_rows, step_seconds(pass_costs, sequences, overhead_s),
                       draft_pass_seconds(drafting.pass_costs if drafting is not None else None))


def check_speculation_options(proposer: Proposer | None, num_speculative_tokens: int, max_num_seqs: int,
                              k_policy: str, controller_factory: Callable[[], KController] | None,
                              max_probe_interval: int, backend: SlotBackend) -> None:
    """Refuse an engine's speculation options over ``backend`` (see :class:`~draftwise.engine.core.EngineCore`).

    Raises:
        ValueError: K < 1 with a proposer, a draft model with fewer slots than ``max_num_seqs``, an unknown
            ``k_policy``, per-request controllers with a load-aware policy, ``max_probe_interval`` < 4, or a
            proposer reading the target's hidden states on a backend that does not return them.
    """
    if proposer is not None and num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1 with a proposer, got {num_speculative_tokens}")
    drafting = proposer.drafting_model if proposer is not None else None
    if drafting is not None and drafting.num_slots < max_num_seqs:
        raise ValueError(f"the draft model's cache has {drafting.num_slots} slots for {max_num_seqs} sequences")
    if k_policy not in K_POLICIES:
        raise ValueError(f"unknown k_policy {k_policy!r}; choose one of {K_POLICIES}")
    if controller_factory is not None and k_policy != "fixed":
        raise ValueError("per-request K controllers and a load-aware batch policy exclude each other")
    if max_probe_interval < 4:
        raise ValueError(f"need max_probe_interval >= 4, got {max_probe_interval}")
    if proposer is not None and proposer.needs_target_hidden and not backend.supports_hidden_states:
        raise ValueError(f"proposer {proposer.name!r} reads the target's hidden states; {backend.name} is "
                         "not a PyTorch backend (use --backend torch)")


class Drafter:
    """The engine core's K policies around its proposer.

    Args:
        proposer: the engine's proposer (None: plain decoding, every draft empty).
        k_cap: a sequence's largest K now (:meth:`~draftwise.engine.scheduler.Scheduler.k_cap`).
        k_policy: ``"fixed"`` or ``"auto"`` (load-aware for the batch).
        memory: the engine's long-memory acceptance estimate (load-aware K learns into it).
        clock: the engine's step clock (a proposer observing the target's features is draft time, not the
            engine's own).
        supports_tree: the backend verifies draft trees; ``backend_name``: its name, for errors.
    """

    def __init__(self, proposer: Proposer | None, k_cap: Callable[[BatchSequence], int], k_policy: str,
                 memory: AcceptanceEstimator, clock: StepClock, supports_tree: bool, backend_name: str) -> None:
        self.proposer = proposer
        self.k_cap = k_cap
        self.k_policy = k_policy
        self.memory = memory
        self.clock = clock
        self.supports_tree = supports_tree
        self.backend_name = backend_name

    def draft(self, budget: StepBudget, pricing: Callable[[int, int], StepPricing | None]) -> Drafts:
        """Every decoding sequence's draft within ``budget.draft_rows``; ``pricing(base_rows, sequences)``: the
        step's measured costs (the load-aware plan's, and a proposer's that ``wants_pricing``).

        Raises:
            RuntimeError: the proposer returned a tree for a backend that verifies chains only, or too deep a draft.
        """
        decoding, draft_rows = budget.decoding, budget.draft_rows
        caps = [self.k_cap(s) for s in decoding]
        for i, sequence in enumerate(decoding):  # a request's own policy chooses its K (AutoK)
            if sequence.controller is not None:
                caps[i] = max(0, min(caps[i], sequence.controller.choose_k()))
        asked = [c > 0 for c in caps]
        t0 = time.perf_counter()
        forced = [forced_draft(s.processors, c) if s.processors is not None else None for s, c in zip(decoding, caps)]
        caps = [0 if f is not None else c for f, c in zip(forced, caps)]  # a grammar's forced tokens: no proposer
        if self.proposer is None or not any(caps):
            proposals = self._constrained(decoding, [_EMPTY] * len(decoding), forced, draft_rows)
            return Drafts(proposals, asked, time.perf_counter() - t0)
        priced = pricing(budget.base_rows, budget.num_sequences)
        given = priced if self.proposer.wants_pricing else None
        if self.k_policy == "fixed":  # a lookup drafts its cap, a model only what the row budget holds
            ks = caps if self.proposer.drafts_first else within_rows(caps, draft_rows)
            proposals = fit_rows(self._propose(decoding, ks, given), draft_rows)
        elif self.proposer.drafts_first:  # a lookup offers its cap; the plan keeps what pays
            offered = self._propose(decoding, caps, given)
            ks = self._plan(decoding, [min(c, len(p)) for c, p in zip(caps, offered)], priced, draft_rows)
            proposals = [p.truncated(k) if k else _EMPTY for p, k in zip(offered, ks)]
        else:  # a model drafts only the planned K
            proposals = self._propose(decoding, self._plan(decoding, caps, priced, draft_rows), given)
        proposals = self._constrained(decoding, proposals, forced, draft_rows)
        return Drafts(proposals, asked, time.perf_counter() - t0)

    @staticmethod
    def _constrained(decoding: list[BatchSequence], proposals: list[DraftProposal],
                     forced: list[DraftProposal | None], draft_rows: int) -> list[DraftProposal]:
        """Each sequence's draft under its processors (:mod:`draftwise.engine.constraints`): its grammar's forced
        tokens where there are any (jump-forward), else the proposer's draft cut at the first refused token;
        within the step's draft rows."""
        constrained = []
        for sequence, proposal, jump in zip(decoding, proposals, forced):
            if jump is not None:
                proposal = jump
            elif sequence.processors is not None:
                proposal = constrain(sequence.processors, proposal)
            constrained.append(proposal)
        return fit_rows(constrained, draft_rows)

    def observe(self, sequence: BatchSequence, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> float:
        """Hand the proposer the target's hidden states ``[m, H]`` of the positions just committed to the
        sequence's slot and the ``[m]`` tokens that follow them; returns the seconds it took (draft time)."""
        t0 = time.perf_counter()
        self.proposer.observe(sequence, hidden, next_token_ids)
        seconds = time.perf_counter() - t0
        self.clock.exclude(seconds)
        return seconds

    @staticmethod
    def start(sequence: BatchSequence) -> None:
        """A sequence was admitted: its controller (if any) learns its prompt, and the prompt tokens reused."""
        if sequence.controller is not None:
            sequence.controller.start(len(sequence.prompt), sequence.params.max_tokens,
                                      cached_tokens=sequence.num_computed)

    def learn(self, sequence: BatchSequence, num_drafted: int, num_accepted: int, draft_s: float, pass_s: float,
              overhead_s: float, *, model_drafted: bool = True, finished: bool = False) -> None:
        """Report a step's outcome to the sequence's K policy: its controller (with the step's seconds and the
        engine's own ``overhead_s`` per step), or the load-aware plan's acceptance estimates and probe schedule.
        ``model_drafted``: False for a ``hybrid`` step the suffix side drafted (its draft model fell behind);
        ``finished``: the step ended the request (perhaps cut by a stop), which tells nothing about later steps."""
        if not finished and sequence.controller is not None:
            sequence.controller.observe(num_drafted, num_accepted, draft_s, pass_s, overhead_s=overhead_s,
                                        model_drafted=model_drafted)
        elif not finished:
            learn_outcome(sequence, self.memory, num_drafted, num_accepted)
        if num_drafted:
            sequence.plain_streak = 0

    @staticmethod
    def _plan(decoding: list[BatchSequence], caps: list[int], pricing: StepPricing, draft_rows: int) -> list[int]:
        return plan_with_probes(decoding, caps, pricing.base_rows, pricing.pass_seconds, pricing.draft_pass_seconds,
                                draft_rows)

    def _propose(self, decoding: list[BatchSequence], ks: list[int], pricing: StepPricing | None = None,
                 ) -> list[DraftProposal]:
        """The proposer's drafts for the sequences with ``k > 0`` (an empty one for the others); ``pricing``
        goes to a proposer that ``wants_pricing``."""
        wanted = [i for i, k in enumerate(ks) if k > 0]
        proposals = [_EMPTY] * len(decoding)
        for i, proposal in zip(wanted, self.proposer.propose([(decoding[i], ks[i]) for i in wanted], pricing)):
            if proposal.is_tree and not self.supports_tree:
                raise RuntimeError(f"proposer {self.proposer.name!r} returned a draft tree; {self.backend_name} "
                                   "verifies chains only")
            proposals[i] = proposal
        return proposals
