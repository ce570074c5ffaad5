"""Draft-model proposer: a second, smaller causal LM with the target's tokenizer proposes K tokens
autoregressively (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

One mechanism, :class:`DraftSlots`, serves every engine: a draft model over a slot backend
(:mod:`draftwise.backends.slots`), drafting for one sequence (any backend as one slot) or for many at once (a
lean multi-slot draft: one catch-up pass, then one pass per draft depth over every drafting sequence). Each
slot is rolled back to the longest common prefix with its sequence's committed context at every call, so
rejected draft tokens are discarded without the engine's help. :class:`DraftModelProposer` is its
one-sequence :class:`~draftwise.proposers.base.Proposer` face (the hybrid proposer, ``check``'s probe, the
library); the engine core's batch face is :class:`draftwise.engine.draft_slots.BatchedDraftModel`.

Draft tokens are drawn through the request's :class:`~draftwise.sampling.Sampler`: greedy (argmax), rejection
(a draw from the processed draft distribution, returned as ``draft_probs``) or coupled (the Gumbel-argmax with
the target's noise for the same sequence position, so a well-matched draft picks the target's token with high
probability; the draft is then deterministic given the noise and ``draft_probs`` is None).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.backends.base import CausalLM, KVState
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.slots import (
    LOGITS_LAST,
    LOGITS_NONE,
    OneSlot,
    Piece,
    SlotBackend,
    as_slot_backend,
    chunk_counts,
)
from draftwise.config import SamplingParams
from draftwise.cost_model import PassCostCurve
from draftwise.proposers.base import DraftProposal, Proposer, common_prefix_length
from draftwise.sampling import Sampler

__all__ = ["DraftSlots", "DraftModelProposer", "fit_vocab"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DraftState:
    """A draft model's kept state: the tokens its slot holds and the exported keys/values (None when the
    draft's backend cannot export its cache)."""

    tokens: tuple[int, ...]
    kv: KVState | None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's drafting request: ``key`` (its identity), its draft ``slot``, committed ``context``
    (``[n]`` prompt + output), ``sampler`` and at most ``k`` tokens."""

    key: int
    slot: int
    context: Sequence[int]
    sampler: Sampler
    k: int


class DraftSlots:
    """A draft model drafting chains for one or many sequences (Leviathan et al. 2023 per sequence).

    A call: one pass over the tokens each drafting sequence's slot lacks (at least its last committed token;
    the prompt after joining; longer catch-ups are split into passes of at most ``max_pass_rows`` rows), whose
    last row per sequence gives the logits of its first draft token; then one pass per further draft depth
    over one row per sequence still drafting. Tokens are drawn with each sequence's sampler (greedy, coupled
    with the target's noise, or rejection with ``draft_probs``).

    Args:
        draft: the draft as a slot backend, a lean model (its slots) or any CausalLM (one slot).
        target_vocab_size: the target's logits width (draft logits are cut or zero-padded to it, so a draft
            whose embedding is padded differently still yields ``[k, target_vocab]`` distributions; ids the
            target cannot produce are never proposed).
        max_pass_rows: rows per catch-up pass.

    Attributes:
        pass_costs: the measured seconds of its passes per row count.
    """

    def __init__(self, draft: SlotBackend | CausalLM | LeanLlama, target_vocab_size: int,
                 max_pass_rows: int = 512) -> None:
        self.backend = as_slot_backend(draft)
        self.target_vocab_size = target_vocab_size
        self.max_pass_rows = max_pass_rows
        self.vocab_size = self.backend.vocab_size
        self.pass_costs = PassCostCurve()
        self._cached: dict[int, list[int]] = {}  # key -> tokens in its slot, in order

    def cached(self, key: int) -> list[int]:
        """The tokens ``key``'s slot holds."""
        return self._cached.setdefault(key, [])

    def reset(self, key: int, slot: int) -> None:
        """Empty ``key``'s slot."""
        self._cached[key] = []
        self.backend.set_length(slot, 0)

    def forget(self, key: int) -> None:
        """``key`` left (its slot is someone else's now)."""
        self._cached.pop(key, None)

    def export(self, key: int, slot: int, context: Sequence[int] | None = None) -> _DraftState | None:
        """The slot's kept state: its tokens up to the common prefix with ``context`` (None: all it holds),
        with their keys/values when the backend can export; None when it holds nothing."""
        cached = self.cached(key)
        length = len(cached) if context is None else common_prefix_length(cached, context)
        if length <= 0:
            return None
        kv = self.backend.export_slot(slot, length) if self.backend.supports_export else None
        return _DraftState(tuple(cached[:length]), kv)

    def adopt(self, key: int, slot: int, state: _DraftState | None, length: int | None = None) -> None:
        """Load a kept state (its first ``length`` tokens; None: all); None empties the slot.

        A state without keys/values comes from a draft backend that cannot export its cache (llama.cpp): the
        slot then keeps only the part of its live contents that equals the state's tokens, and the next call
        prefills the rest of the context.
        """
        if state is None:
            self.reset(key, slot)
        elif state.kv is not None:
            n = len(state.tokens) if length is None else min(length, len(state.tokens))
            self.backend.import_slot(slot, state.kv, n)
            self._cached[key] = list(state.tokens[:n])
        else:
            self._forget_if_changed(key, slot)
            cached = self.cached(key)
            common = common_prefix_length(cached, state.tokens)
            self.backend.set_length(slot, common)
            del cached[common:]

    def _forget_if_changed(self, key: int, slot: int) -> None:
        """Empty the slot when it no longer holds as many tokens as were fed to it here (another user of the
        draft backend, e.g. a calibration, changed it): the next call then prefills the whole context."""
        if self.backend.length(slot) != len(self.cached(key)):
            logger.debug("draft slot %d holds %d tokens, not the %d fed here: starting it afresh", slot,
                         self.backend.length(slot), len(self.cached(key)))
            self.reset(key, slot)

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """A chain of at most ``k`` tokens for each request (fewer near the draft's context end)."""
        room = [min(r.k, self.backend.max_context - len(r.context)) for r in requests]
        active = [i for i, k in enumerate(room) if k > 0]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        logits = self._catch_up([requests[i] for i in active])  # [len(active), V]
        for depth in range(max((room[i] for i in active), default=0)):
            feed = []
            for row, i in enumerate(active):
                request = requests[i]
                if depth >= room[i]:
                    continue
                token, p = request.sampler.choose(logits[row], len(request.context) + depth)
                tokens[i].append(token)
                if p is not None:
                    probs[i].append(p)
                if depth + 1 < room[i]:
                    feed.append(i)
            if not feed:
                break
            pieces = [(requests[i], [tokens[i][-1]], len(requests[i].context) + depth) for i in feed]
            logits = self._run(pieces)
            active = feed
        return [DraftProposal(tuple(t), torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _catch_up(self, requests: list[DraftRequest]) -> torch.Tensor:
        """Feed every request's slot what it lacks of its context; returns the logits after each context
        (``[len(requests), target_vocab]``)."""
        pending = []
        for request in requests:
            self._forget_if_changed(request.key, request.slot)
            cached = self.cached(request.key)
            common = min(common_prefix_length(cached, request.context), len(request.context) - 1)
            del cached[common:]
            pending.append((request, list(request.context[common:]), common))
        if not pending:
            return torch.empty(0, self.target_vocab_size)
        # passes of at most max_pass_rows rows; a request's logits come from its last row
        out: dict[int, torch.Tensor] = {}
        while pending:
            counts = chunk_counts([len(toks) for _, toks, _ in pending], self.max_pass_rows, self.backend.max_pieces)
            batch = [(r, toks[:c], start, c == len(toks)) for (r, toks, start), c in zip(pending, counts) if c > 0]
            logits = self._run([(r, t, start) for r, t, start, _ in batch], want=[done for *_, done in batch])
            row = 0
            for request, _, _, done in batch:
                if done:
                    out[request.key] = logits[row]
                    row += 1
            pending = [(r, toks[c:], start + c) for (r, toks, start), c in zip(pending, counts) if c < len(toks)]
        return torch.stack([out[r.key] for r in requests])

    def _run(self, pieces: list[tuple[DraftRequest, list[int], int]], want: list[bool] | None = None
             ) -> torch.Tensor:
        """One draft pass over chains ``(request, tokens, start)``; returns the last row's logits of each piece
        (``want[i]`` False: none for piece i), cut or padded to the target's width."""
        batch = []
        for i, (request, toks, start) in enumerate(pieces):
            readable = [t if t < self.vocab_size else 0 for t in toks]  # an id only the target's vocab has
            batch.append(Piece(request.slot, start, readable,
                               logits=LOGITS_LAST if want is None or want[i] else LOGITS_NONE))
        t0 = time.perf_counter()
        logits = self.backend.forward(batch).logits
        self.pass_costs.observe(sum(len(p.token_ids) for p in batch), max(time.perf_counter() - t0, 1e-9))
        for request, toks, start in pieces:
            cached = self.cached(request.key)
            if len(cached) == start:
                cached.extend(toks)
        return fit_vocab(logits, self.target_vocab_size)


class DraftModelProposer(Proposer):
    """Proposes tokens with a draft :class:`CausalLM`: the one-sequence face of :class:`DraftSlots` (the draft
    as one slot).

    Args:
        draft: the draft model backend.
        target_vocab_size: the target's logits width (see :class:`DraftSlots`).
    """

    name = "draft_model"

    def __init__(self, draft: CausalLM, target_vocab_size: int) -> None:
        self.draft = draft
        self.target_vocab_size = target_vocab_size
        self.slots = DraftSlots(OneSlot(draft), target_vocab_size)

    def start(self, prompt_ids: Sequence[int], *, scope: str = "") -> None:
        """Nothing to reset: the draft's cache is reconciled with the context at every :meth:`propose`, and the
        engine sets it through :meth:`import_state` before a request."""

    def export_state(self) -> _DraftState:
        """The draft's cached tokens and, when its backend can export, its KV cache (shared, not copied)."""
        state = self.slots.export(0, 0)
        return state if state is not None else _DraftState(tokens=(), kv=None)

    def import_state(self, state: _DraftState | None) -> None:
        """Load a kept draft state; None empties the draft's cache (see :meth:`DraftSlots.adopt`)."""
        self.slots.adopt(0, 0, state if state is None or state.tokens else None)

    def propose(
        self, context_ids: Sequence[int], k: int, params: SamplingParams, sampler: Sampler
    ) -> DraftProposal:
        return self.slots.draft([DraftRequest(0, 0, list(context_ids), sampler, k)])[0]


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or pad draft logits ``[..., draft_vocab]`` to ``[..., width]`` (the target's logits width; padding
    gets -inf, so ids the target cannot produce are never proposed)."""
    current = logits.shape[-1]
    if current == width:
        return logits
    if current > width:
        return logits[..., :width]
    pad = torch.full((*logits.shape[:-1], width - current), float("-inf"), dtype=logits.dtype)
    return torch.cat([logits, pad], dim=-1)
