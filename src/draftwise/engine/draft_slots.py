"""The engine core's face of the one draft model (:class:`draftwise.proposers.draft_model.DraftSlots`): drafts
for every decoding sequence of the batch at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from draftwise.backends.base import CausalLM
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.slots import SlotBackend
from draftwise.methods import FIXED_DRAFT_CONFIDENCE
from draftwise.engine.proposers import BatchProposer, StepPricing
from draftwise.engine.sequence import BatchSequence
from draftwise.proposers.base import DraftProposal
from draftwise.proposers.draft_model import DraftRequest, DraftSlots, check_tree_shape, tree_nodes

__all__ = ["BatchedDraftModel"]


class BatchedDraftModel(BatchProposer):
    """A draft model drafting for every sequence of the batch at once (Leviathan et al. 2023 per sequence):
    :class:`~draftwise.proposers.draft_model.DraftSlots` with one draft slot per engine slot (a sequence uses the
    same slot index in both).

    Args:
        draft: the draft: a lean model whose cache has the engine's number of slots, a slot backend, or any
            CausalLM (one slot, for an engine of one slot).
        target_vocab_size: the target's logits width (draft logits are cut or padded to it).
        max_pass_rows: rows per catch-up pass.
        tree_width, tree_budget: draft trees (see :class:`~draftwise.proposers.draft_model.DraftRequest`) on a
            lean draft; width 1 drafts chains.
        verify_seconds: the target's ``rows -> seconds`` pass cost, to size trees by (see
            :func:`~draftwise.proposers.draft_model.sized_tree`).
        window: each sequence's draft reads at most this many tokens of its context (None: all; see
            :class:`~draftwise.proposers.draft_model.DraftSlots`).
        confidence_threshold: chains stop below this path probability, one number or one per depth (0: always
            ``k`` deep; see :class:`~draftwise.proposers.draft_model.DraftSlots`).

    Raises:
        ValueError: ``tree_width`` or ``tree_budget`` < 1, ``tree_width`` > 1 on a draft that cannot grow trees,
            ``window`` too small, or ``confidence_threshold`` invalid
            (:func:`~draftwise.proposers.draft_model.min_path_scores`).

    Attributes:
        pass_costs: the draft's measured seconds per pass by row count (its ``DraftSlots``' curve; the engine
            calibrates it at start and prices the draft's passes with it).
    """

    name = "draft_model"
    drafts_first = False

    def __init__(self, draft: SlotBackend | CausalLM | LeanLlama, target_vocab_size: int,
                 max_pass_rows: int = 512, tree_width: int = 1, tree_budget: int | None = None,
                 verify_seconds: Callable[[int], float] | None = None, window: int | None = None,
                 confidence_threshold: float | Sequence[float] = FIXED_DRAFT_CONFIDENCE) -> None:
        check_tree_shape(tree_width, tree_budget)
        self.slots = DraftSlots(draft, target_vocab_size, max_pass_rows, verify_seconds, window, confidence_threshold)
        if tree_width > 1 and not self.slots.supports_trees:
            raise ValueError(f"{self.slots.backend.name}: tree_width {tree_width} needs a draft on the lean runtime")
        self.tree_width = tree_width
        self.tree_budget = tree_budget
        self.model: LeanLlama | None = getattr(self.slots.backend, "model", None)  # the lean draft, when lean
        self.pass_costs = self.slots.pass_costs

    @property
    def drafting_model(self) -> BatchedDraftModel:
        return self

    @property
    def num_slots(self) -> int:
        return self.slots.backend.num_slots

    def lacking(self, sequence: BatchSequence) -> int:
        """Rows the sequence's next draft feeds in its first pass: what its draft slot lacks of its context."""
        return self.slots.lacking(sequence.seq_id, sequence.context)

    def tree_nodes(self, k: int) -> int:
        """Draft nodes a draft ``k`` tokens deep has at most (:func:`~draftwise.proposers.draft_model.tree_nodes`)."""
        return tree_nodes(k, self.tree_width, self.tree_budget)

    def open(self, sequence: BatchSequence) -> None:
        self.slots.reset(sequence.seq_id, sequence.slot)

    def close(self, sequence: BatchSequence) -> None:
        self.slots.forget(sequence.seq_id)
        if 0 <= sequence.slot < self.num_slots:
            self.slots.backend.set_length(sequence.slot, 0)

    def export_state(self, sequence: BatchSequence) -> Any:
        # the committed tokens only, not the drafts past them
        return self.slots.export(sequence.seq_id, sequence.slot, sequence.context)

    def import_state(self, sequence: BatchSequence, state: Any, length: int) -> None:
        if state is None:
            return  # open() emptied the slot
        length = self.slots.reusable(state, sequence.prompt, length)
        if length > 0:
            self.slots.adopt(sequence.seq_id, sequence.slot, state, length)

    def propose(self, requests: Sequence[tuple[BatchSequence, int]],
                pricing: StepPricing | None = None) -> list[DraftProposal]:
        return self.slots.draft([DraftRequest(s.seq_id, s.slot, s.context, s.sampler, k, self.tree_width,
                                              self.tree_budget) for s, k in requests])
