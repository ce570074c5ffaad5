"""The engine core's scheduler: which requests hold a slot, and which rows each gets in a step's one pass.

As in vLLM v1's scheduler there is no prefill phase nor decoding phase: within a token budget per step
(``max_num_batched_tokens``), every running sequence whose prompt is in its slot gets its last committed token and
its draft, and prompts still being prefilled share what is left in chunks (at least ``min_prefill_tokens`` per
step while a prompt waits, so decoding does not starve a new request), oldest first. A step is scheduled in two
moves around drafting: :meth:`Scheduler.budget` says how many draft rows the step can hold, and
:meth:`Scheduler.plan` lays the drafts and prompt chunks out as one :class:`StepPlan`: each sequence's
:class:`~draftwise.backends.slots.Piece` and the rows of the pass's logits and hidden states that are its own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from draftwise.backends.slots import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, Piece, chunk_counts
from draftwise.engine.sequence import BatchSequence
from draftwise.proposers.base import DraftProposal

__all__ = ["ScheduledSequence", "Scheduler", "StepBudget", "StepInfo", "StepPlan", "fit_rows", "within_rows"]


@dataclass(frozen=True)
class StepInfo:
    """One step of the engine (for metrics and logs).

    Attributes:
        rows: rows in the target pass; ``prefill_rows`` / ``draft_rows`` of them: prompt chunks and draft tokens.
        num_sequences: sequences with rows in the pass; ``num_decoding``: of them, decoding ones.
        committed_tokens: output tokens committed by the step (all sequences).
        pass_s, draft_s: seconds of the target pass and of drafting.
        ks: draft tokens (rows) of every decoding sequence (0: plain step), in slot order.
        overhead_s: the engine's estimate of its own seconds per step after this one (the median over recent
            steps, :attr:`draftwise.engine.core.EngineCore.step_overhead`; 0 until the step is measured).
    """

    rows: int
    prefill_rows: int
    draft_rows: int
    num_sequences: int
    num_decoding: int
    committed_tokens: int
    pass_s: float
    draft_s: float
    ks: tuple[int, ...]
    overhead_s: float = 0.0


@dataclass(frozen=True)
class StepBudget:
    """A step's rows before drafting.

    Attributes:
        decoding: running sequences whose prompt is in their slot, in slot order (each drafts).
        prefilling: running sequences with prompt tokens left, in slot order.
        base_rows: rows of the pass without any draft: one per decoding sequence, plus the prompt rows expected.
        draft_rows: draft rows the step can hold.
        prefill_reserve: prompt rows kept for prefilling whatever the drafts take.
        num_sequences: sequences expected in the pass (the decoding ones, and one prefilling one if any).
    """

    decoding: list[BatchSequence]
    prefilling: list[BatchSequence]
    base_rows: int
    draft_rows: int
    prefill_reserve: int
    num_sequences: int


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's part of a step's pass.

    Attributes:
        sequence: the sequence.
        piece: its rows: its last committed token and its draft, or a chunk of its prompt.
        logit_rows: where its rows' logits lie in the pass's ``logits [rows with logits, V]`` (a prompt chunk has
            one row, when it ends the prompt, or none; every row for a request asking for prompt logprobs).
        hidden_rows: where its hidden states lie in the pass's ``hidden [rows, H]`` (when the pass returns them).
        proposal: a decoding sequence's draft (possibly empty); None for a prompt chunk.
    """

    sequence: BatchSequence
    piece: Piece
    logit_rows: slice
    hidden_rows: slice
    proposal: DraftProposal | None = None


@dataclass(frozen=True)
class StepPlan:
    """One step's pass: the decoding sequences' rows first, then the prompt chunks, in that order in the pass.

    Attributes:
        decodes: per decoding sequence (slot order), its last token and draft.
        prefills: per prefilling sequence that gets rows (oldest first), its prompt chunk.
    """

    decodes: tuple[ScheduledSequence, ...]
    prefills: tuple[ScheduledSequence, ...]

    @cached_property
    def pieces(self) -> list[Piece]:
        """The pass's pieces, in row order."""
        return [s.piece for s in self.decodes + self.prefills]

    @property
    def rows(self) -> int:
        return sum(len(piece.token_ids) for piece in self.pieces)

    @property
    def draft_rows(self) -> int:
        return sum(len(s.proposal) for s in self.decodes)

    @property
    def prefill_rows(self) -> int:
        return sum(len(s.piece.token_ids) for s in self.prefills)

    def info(self, committed_tokens: int, pass_s: float, draft_s: float) -> StepInfo:
        """The step's :class:`StepInfo`."""
        return StepInfo(rows=self.rows, prefill_rows=self.prefill_rows, draft_rows=self.draft_rows,
                        num_sequences=len(self.decodes) + len(self.prefills), num_decoding=len(self.decodes),
                        committed_tokens=committed_tokens, pass_s=pass_s, draft_s=draft_s,
                        ks=tuple(len(s.proposal) for s in self.decodes))


class Scheduler:
    """Admission (waiting requests take free slots, oldest first), the token budget and prompt chunking.

    Args:
        max_num_seqs: slots (sequences running at once): ``0..max_num_seqs - 1``.
        max_num_batched_tokens: rows per pass (decode rows, draft rows and prompt chunks together).
        min_prefill_tokens: prompt rows per step at least while a prompt waits (at most the budget).
        max_pieces: sequences a pass can hold.
        max_context: the target's context length (tokens).
        needs_hidden: every piece asks for its rows' hidden states.

    Raises:
        ValueError: a budget < 1.
    """

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, min_prefill_tokens: int, max_pieces: int,
                 max_context: int, needs_hidden: bool) -> None:
        if max_num_batched_tokens < 1 or min_prefill_tokens < 1:
            raise ValueError("need max_num_batched_tokens >= 1 and min_prefill_tokens >= 1")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_prefill_tokens = min(min_prefill_tokens, max_num_batched_tokens)
        self.max_pieces = max_pieces
        self.max_context = max_context
        self.needs_hidden = needs_hidden
        self.waiting: deque[BatchSequence] = deque()
        self.running: dict[int, BatchSequence] = {}  # slot -> sequence
        self.free = list(range(max_num_seqs))

    # ------------------------------------------------------------------ admission
    def add(self, sequence: BatchSequence) -> None:
        """Queue a new sequence (it waits for a free slot)."""
        self.waiting.append(sequence)

    def admit(self) -> Iterator[BatchSequence]:
        """Give waiting sequences free slots, one at a time, oldest first (a slot freed while the caller handles
        one, e.g. by its failing, is offered to the next). A sequence not :attr:`~BatchSequence.ready` (its
        sibling's prompt, which it forks, is not in the sibling's slot yet) keeps its place in the queue."""
        held: list[BatchSequence] = []
        try:
            while self.waiting and self.free:
                sequence = self.waiting.popleft()
                if not sequence.ready:
                    held.append(sequence)
                    continue
                sequence.slot = self.free.pop(0)
                sequence.admitted_s = time.perf_counter()
                self.running[sequence.slot] = sequence
                yield sequence
        finally:
            self.waiting.extendleft(reversed(held))

    def drop_waiting(self, sequence: BatchSequence) -> None:
        """A waiting sequence leaves the queue (nothing when it is not waiting)."""
        if sequence.slot < 0 and sequence in self.waiting:
            self.waiting.remove(sequence)

    def drain_waiting(self) -> list[BatchSequence]:
        """Every waiting sequence leaves the queue; returns them, oldest first."""
        drained = list(self.waiting)
        self.waiting.clear()
        return drained

    def release(self, sequence: BatchSequence) -> None:
        """A running sequence leaves: its slot is free again."""
        del self.running[sequence.slot]
        self.free.append(sequence.slot)
        self.free.sort()
        sequence.slot = -1

    def in_slot_order(self) -> list[BatchSequence]:
        """The running sequences, in slot order."""
        return [self.running[slot] for slot in sorted(self.running)]

    # ------------------------------------------------------------------ one step
    def k_cap(self, sequence: BatchSequence) -> int:
        """The sequence's largest K now: within its max K, the tokens still wanted and the context room (a step
        commits at most K + 1 tokens and writes K + 1 cache entries on top of ``len(context) - 1``)."""
        remaining = sequence.params.max_tokens - len(sequence.generated)
        room = self.max_context - len(sequence.prompt) - len(sequence.generated)
        return max(0, min(sequence.max_k, remaining - 1, room - 1))

    def budget(self, running: Sequence[BatchSequence]) -> StepBudget:
        """The rows of a step over ``running`` (slot order) before drafting: prompt rows are reserved first
        (``min_prefill_tokens``), the decoding sequences' drafts may take the rest."""
        decoding = [s for s in running if not s.prompt_left]
        prefilling = [s for s in running if s.prompt_left]
        pending = sum(s.prompt_left for s in prefilling)
        reserve = min(pending, self.min_prefill_tokens)
        free_rows = self.max_num_batched_tokens - len(decoding)
        expected_prefill = min(pending, max(reserve, free_rows))
        return StepBudget(decoding, prefilling, base_rows=len(decoding) + expected_prefill,
                          draft_rows=max(0, free_rows - reserve), prefill_reserve=reserve,
                          num_sequences=len(decoding) + min(len(prefilling), 1 if expected_prefill else 0))

    def plan(self, budget: StepBudget, proposals: Sequence[DraftProposal]) -> StepPlan:
        """Lay out the step's pass: each decoding sequence's last token and draft (``proposals``, one per
        ``budget.decoding``; a tree cut at the context's end), then prompt chunks in the rows the drafts left."""
        proposals = [self._fit_context(s, p) for s, p in zip(budget.decoding, proposals)]
        free_rows = self.max_num_batched_tokens - len(budget.decoding) - sum(len(p) for p in proposals)
        chunks = self._prefill_chunks(budget.prefilling, max(budget.prefill_reserve, free_rows),
                                      self.max_pieces - len(budget.decoding))
        parts = [(s, self._verify_piece(s, p), p) for s, p in zip(budget.decoding, proposals)]
        parts += [(s, self._prefill_piece(s, count), None) for s, count in chunks]
        scheduled = self._lay_out(parts)
        return StepPlan(tuple(scheduled[:len(proposals)]), tuple(scheduled[len(proposals):]))

    def _lay_out(self, parts: list[tuple[BatchSequence, Piece, DraftProposal | None]]) -> list[ScheduledSequence]:
        """Each part's rows of the pass's logits and hidden states, parts in pass order."""
        scheduled, logit_row, hidden_row = [], 0, 0
        for sequence, piece, proposal in parts:
            hidden_rows = len(piece.token_ids) if self.needs_hidden else 0
            scheduled.append(ScheduledSequence(sequence, piece, slice(logit_row, logit_row + piece.num_logits),
                                               slice(hidden_row, hidden_row + hidden_rows), proposal))
            logit_row, hidden_row = logit_row + piece.num_logits, hidden_row + hidden_rows
        return scheduled

    def _fit_context(self, sequence: BatchSequence, proposal: DraftProposal) -> DraftProposal:
        """A tree pass writes one cache entry per node on top of the context: cut it at the context's end."""
        if proposal.is_tree:
            return proposal.truncated(self.max_context - len(sequence.prompt) - len(sequence.generated))
        return proposal

    def _prefill_chunks(self, prefilling: list[BatchSequence], budget: int, pieces_left: int
                        ) -> list[tuple[BatchSequence, int]]:
        """Prompt chunks for this step, oldest sequence first, within ``budget`` rows and the pieces a pass can
        still hold (:func:`~draftwise.backends.slots.chunk_counts`)."""
        ordered = sorted(prefilling, key=lambda s: s.seq_id)
        counts = chunk_counts([s.prompt_left for s in ordered], budget, pieces_left)
        return [(s, count) for s, count in zip(ordered, counts) if count > 0]

    def _verify_piece(self, sequence: BatchSequence, proposal: DraftProposal) -> Piece:
        """A decoding sequence's rows: its last committed token, then its draft (a chain or a tree)."""
        context = sequence.context
        return Piece(sequence.slot, len(context) - 1, [context[-1], *proposal.token_ids],
                     parents=proposal.parents if proposal.is_tree else None, logits=LOGITS_ALL,
                     hidden=self.needs_hidden)

    def _prefill_piece(self, sequence: BatchSequence, count: int) -> Piece:
        """The next ``count`` prompt tokens of a prefilling sequence (logits of the last one when it ends the
        prompt; of every one when the sequence asked for its prompt's log-probabilities)."""
        start = sequence.num_computed
        done = start + count == len(sequence.prompt)
        logits = LOGITS_LAST if done else LOGITS_NONE
        if sequence.prompt_logprobs is not None:
            logits = LOGITS_ALL
        return Piece(sequence.slot, start, sequence.prompt[start:start + count], logits=logits,
                     hidden=self.needs_hidden)


def within_rows(caps: Sequence[int], budget: int) -> list[int]:
    """Fixed K: each sequence's cap, oldest slot first, within the step's draft-row budget."""
    ks = []
    for cap in caps:
        ks.append(min(cap, budget))
        budget -= ks[-1]
    return ks


def fit_rows(proposals: Sequence[DraftProposal], budget: int) -> list[DraftProposal]:
    """Cut drafts (a tree has a row per node) to the step's draft-row budget."""
    fitted = []
    for proposal in proposals:
        if len(proposal) > budget:
            proposal = proposal.truncated(max(0, budget))
        fitted.append(proposal)
        budget -= len(proposal)
    return fitted
