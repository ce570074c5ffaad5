"""A multi-slot lean draft model that drafts for every decoding sequence of the batch at once."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.backends.base import KVState
from draftwise.backends.lean.backend import LeanCausalLM
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.lean.rows import chain_rows
from draftwise.backends.slots import concat_rows
from draftwise.cost_model import PassCostCurve
from draftwise.engine.proposers import BatchProposer
from draftwise.engine.sequence import BatchSequence
from draftwise.proposers.base import DraftProposal, common_prefix_length
from draftwise.proposers.draft_model import fit_vocab

__all__ = ["BatchedDraftModel"]


@dataclass(frozen=True)
class _DraftSlotState:
    """A batched draft model's kept state: the tokens its slot held and their keys/values."""

    tokens: tuple[int, ...]
    kv: KVState

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class BatchedDraftModel(BatchProposer):
    """A draft model drafting for every sequence of the batch at once (Leviathan et al. 2023 per sequence).

    The draft is a lean model with as many slots as the engine (a sequence uses the same slot index in both).
    A call: one pass over the tokens each drafting sequence's slot lacks (at least its last committed token;
    the prompt after joining; longer catch-ups are split into passes of at most ``max_pass_rows`` rows), whose
    last row per sequence gives the logits of its first draft token; then one pass per further draft depth over
    one row per sequence still drafting. Tokens are drawn with each sequence's sampler (greedy, coupled with the
    target's noise, or rejection with ``draft_probs``). A slot is rolled back to the longest common prefix
    with the sequence's context at each call (rejected drafts are simply overwritten).

    Args:
        draft: the draft as a lean model (its cache needs the engine's number of slots).
        target_vocab_size: the target's logits width (draft logits are cut or padded to it).
        max_pass_rows: rows per catch-up pass.
    """

    name = "draft_model"
    drafts_first = False

    def __init__(self, draft: LeanCausalLM | LeanLlama, target_vocab_size: int, max_pass_rows: int = 512) -> None:
        self.model = draft.model if isinstance(draft, LeanCausalLM) else draft
        self.target_vocab_size = target_vocab_size
        self.max_pass_rows = max_pass_rows
        self.vocab_size = self.model.config.vocab_size
        self.pass_costs = PassCostCurve()
        self._cached: dict[int, list[int]] = {}  # seq_id -> tokens in its draft slot

    @property
    def num_slots(self) -> int:
        return self.model.cache.num_slots

    def open(self, sequence: BatchSequence) -> None:
        self._cached[sequence.seq_id] = []
        self.model.cache.lengths[sequence.slot] = 0

    def close(self, sequence: BatchSequence) -> None:
        self._cached.pop(sequence.seq_id, None)
        if 0 <= sequence.slot < self.num_slots:
            self.model.cache.lengths[sequence.slot] = 0

    def export_state(self, sequence: BatchSequence) -> _DraftSlotState | None:
        cached = self._cached.get(sequence.seq_id, [])
        length = common_prefix_length(cached, sequence.context)  # not the drafts past the committed tokens
        if length <= 0:
            return None
        payload = self.model.cache.export_slot(sequence.slot, length)
        return _DraftSlotState(tuple(cached[:length]), KVState(payload, length, sum(k.nbytes + v.nbytes for k, v in payload)))

    def import_state(self, sequence: BatchSequence, state: _DraftSlotState | None, length: int) -> None:
        if state is None:
            return
        length = min(length, len(state.tokens), common_prefix_length(state.tokens, sequence.prompt))
        if length <= 0:
            return
        self.model.cache.import_slot(sequence.slot, state.kv.payload, length)
        self._cached[sequence.seq_id] = list(state.tokens[:length])

    def propose(self, requests: Sequence[tuple[BatchSequence, int]]) -> list[DraftProposal]:
        room = [min(k, self.model.config.max_context - len(s.prompt) - len(s.generated)) for s, k in requests]
        active = [i for i, k in enumerate(room) if k > 0]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        logits = self._catch_up([requests[i][0] for i in active])  # [len(active), V]
        for depth in range(max((room[i] for i in active), default=0)):
            feed = []
            for row, i in enumerate(active):
                sequence = requests[i][0]
                if depth >= room[i]:
                    continue
                token, p = sequence.sampler.choose(logits[row], len(sequence.context) + depth)
                tokens[i].append(token)
                if p is not None:
                    probs[i].append(p)
                if depth + 1 < room[i]:
                    feed.append(i)
            if not feed:
                break
            pieces = [(requests[i][0], [tokens[i][-1]]) for i in feed]
            logits = self._run(pieces, [len(requests[i][0].context) + depth for i in feed])
            active = feed
        return [DraftProposal(tuple(t), torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _catch_up(self, sequences: list[BatchSequence]) -> torch.Tensor:
        """Feed every sequence's slot what it lacks of its context; returns the logits after each context
        (``[len(sequences), target_vocab]``)."""
        pieces, starts = [], []
        for sequence in sequences:
            context, cached = sequence.context, self._cached[sequence.seq_id]
            common = min(common_prefix_length(cached, context), len(context) - 1)
            del cached[common:]
            pieces.append((sequence, context[common:]))
            starts.append(common)
        if not pieces:
            return torch.empty(0, self.target_vocab_size)
        # split into passes of at most max_pass_rows rows; a sequence's logits come from its last row
        out: dict[int, torch.Tensor] = {}
        pending = [(s, toks, start) for (s, toks), start in zip(pieces, starts)]
        while pending:
            batch, rest, used = [], [], 0
            for sequence, toks, start in pending:
                take = min(len(toks), self.max_pass_rows - used)
                if take <= 0:
                    rest.append((sequence, toks, start))
                    continue
                batch.append((sequence, toks[:take], start, take == len(toks)))
                if take < len(toks):
                    rest.append((sequence, toks[take:], start + take))
                used += take
            logits = self._run([(s, t) for s, t, _, _ in batch], [start for _, _, start, _ in batch],
                               want=[done for *_, done in batch])
            row = 0
            for sequence, _, _, done in batch:
                if done:
                    out[sequence.seq_id] = logits[row]
                    row += 1
            pending = rest
        return torch.stack([out[s.seq_id] for s in sequences])

    def _run(self, pieces: list[tuple[BatchSequence, list[int]]], starts: list[int],
             want: list[bool] | None = None) -> torch.Tensor:
        """One draft pass over chains ``pieces`` starting at ``starts``; returns the last row's logits of each
        piece (``want[i]`` False: none for piece i), cut or padded to the target's width."""
        batches, last_rows, row = [], [], 0
        for i, ((sequence, toks), start) in enumerate(zip(pieces, starts)):
            readable = [t if t < self.vocab_size else 0 for t in toks]  # an id only the target's vocab has
            batches.append(chain_rows(readable, start, sequence.slot))
            row += len(toks)
            if want is None or want[i]:
                last_rows.append(row - 1)
        rows = concat_rows(batches)
        t0 = time.perf_counter()
        logits, _ = self.model.forward_rows(rows, logit_rows=torch.tensor(last_rows, dtype=torch.long))
        self.pass_costs.observe(len(rows), max(time.perf_counter() - t0, 1e-9))
        for (sequence, toks), start in zip(pieces, starts):
            cached = self._cached[sequence.seq_id]
            if len(cached) == start:
                cached.extend(toks)
            self.model.cache.lengths[sequence.slot] = start + len(toks)
        return fit_vocab(logits, self.target_vocab_size)
