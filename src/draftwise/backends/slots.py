"""The slot backend: what the engine core needs from a target model.

A slot backend holds ``num_slots`` sequences, each in its own KV-cache slot indexed by position, so that a
rollback is setting a length (gpt-fast's preallocated cache, vLLM's block table). One pass runs *pieces*:
each piece is one sequence's new tokens (a prompt chunk, or its last committed token and its draft tokens as a
chain or a tree), written on top of the slot's current length.

Three implementations:

- :class:`LeanSlots`: the lean runtime's multi-slot cache (:mod:`draftwise.backends.lean`); every piece of a
  pass runs in ONE :meth:`~draftwise.backends.lean.model.LeanLlama.forward_rows` call, and a row's logits do
  not depend on the other rows of the pass (row-invariant kernels).
- :class:`LlamaCppSlots`: a llama.cpp context holding several sequences (a draft model's: llama.cpp's kernels
  are not row-invariant, which only the target needs); every piece of a pass in one ``llama_decode``.
- :class:`OneSlot`: any :class:`~draftwise.backends.base.CausalLM` (transformers, llama.cpp, the lean runtime
  driving one sequence) as a backend of one slot: one piece per pass, run through ``forward`` or
  ``forward_tree``.

So every backend runs through the same engine core (:class:`draftwise.engine.core.EngineCore`); the lean
runtime batches several sequences of a target or a draft into one pass, llama.cpp those of a draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from draftwise.backends.base import CausalLM, KVState
from draftwise.backends.lean.backend import LeanCausalLM
from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM
from draftwise.backends.lean.model import LeanLlama
from draftwise.tree import check_parents
from draftwise.backends.lean.rows import RowBatch, chain_rows, expansion_rows, tree_rows

__all__ = ["Expansion", "Piece", "PassOutput", "SlotBackend", "LeanSlots", "LlamaCppSlots", "OneSlot", "concat_rows",
           "as_slot_backend", "chunk_counts"]

#: which rows of a piece return logits: every row (a verification), the last one (a prompt chunk that
#: completes the prompt) or none (an earlier prompt chunk).
LOGITS_ALL, LOGITS_LAST, LOGITS_NONE = "all", "last", "none"


@dataclass(frozen=True)
class Expansion:
    """One depth of a draft tree grown one pass per depth: the piece's tokens are nodes written at cache
    entries ``start, start + 1, ...``; node r has rotary position ``positions[r]`` (the committed length plus
    its depth minus one) and sees the slot's first ``base`` keys (the committed context), the entries
    ``ancestors[r]`` (its ancestors' keys written by earlier passes, root side first) and itself."""

    base: int
    positions: tuple[int, ...]
    ancestors: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Piece:
    """One sequence's rows in a pass.

    Attributes:
        slot: the sequence's KV-cache slot.
        start: the slot's length before the pass (tokens); the first token is written at this position.
        token_ids: ``[n]`` tokens fed (n >= 1).
        parents: for a draft tree, ``[n - 1]`` parent of each node after the root (-1 = the root, see
            :mod:`draftwise.tree`); None for a chain.
        logits: ``"all"``, ``"last"`` or ``"none"`` (see :data:`LOGITS_ALL`).
        hidden: also return the final hidden states of every row of the piece.
        expansion: for one depth of a tree grown one pass per depth (a draft model's tree; backends with
            ``supports_expansion``), what the nodes see: None for a chain or a whole tree.
    """

    slot: int
    start: int
    token_ids: Sequence[int]
    parents: tuple[int, ...] | None = None
    logits: str = LOGITS_ALL
    hidden: bool = False
    expansion: Expansion | None = None

    @property
    def num_logits(self) -> int:
        """Rows of this piece that return logits."""
        return {LOGITS_ALL: len(self.token_ids), LOGITS_LAST: 1, LOGITS_NONE: 0}[self.logits]


@dataclass(frozen=True)
class PassOutput:
    """The result of one pass over pieces.

    Attributes:
        logits: ``[sum of num_logits over the pieces, vocab]`` float32, piece after piece, rows in order.
        hidden: ``[rows of the pieces with hidden, H]`` piece after piece, or None when no piece asked.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None


class SlotBackend(Protocol):
    """What :class:`draftwise.engine.core.EngineCore` drives.

    Attributes:
        name: model identity (messages); ``vocab_size``: logits width; ``max_context``: context length (tokens).
        num_slots: sequences the backend can hold at once.
        supports_tree: pieces may be trees; ``supports_expansion``: pieces may be grown-tree depths
        (:class:`Expansion`); ``supports_hidden_states``: pieces may ask for hidden states;
        supports_export: :meth:`export_slot` / :meth:`import_slot` work (prefix reuse across requests).
        max_pieces: pieces one pass can hold (1 for :class:`OneSlot`).
    """

    name: str
    vocab_size: int
    max_context: int
    num_slots: int
    supports_tree: bool
    supports_expansion: bool
    supports_hidden_states: bool
    supports_export: bool
    max_pieces: int

    def forward(self, pieces: Sequence[Piece]) -> PassOutput:
        """Run one pass over ``pieces`` (distinct slots) and write their keys and values into their slots; each
        slot's length becomes ``start + len(token_ids)``.

        Raises:
            ValueError: a piece past the context length, ids outside the vocabulary, or more pieces than
                ``max_pieces``.
        """

    def length(self, slot: int) -> int:
        """Tokens the slot holds."""

    def set_length(self, slot: int, length: int) -> None:
        """Keep the slot's first ``length`` entries (a rollback; 0 empties it)."""

    def compact(self, slot: int, base: int, keep: Sequence[int]) -> None:
        """Keep the slot's first ``base`` entries and the entries ``base + j`` for ``j`` in ``keep`` (increasing
        offsets into the last pass): a verified tree's accepted path (a prefix ``keep``: a rollback)."""

    def export_slot(self, slot: int, length: int) -> KVState:
        """The slot's first ``length`` entries, in a state that later writes do not change."""

    def import_slot(self, slot: int, state: KVState, length: int) -> None:
        """Replace the slot's contents by the first ``length`` positions of ``state``."""


def concat_rows(batches: Sequence[RowBatch]) -> RowBatch:
    """The rows of several pieces (chains and trees, each of its own slot) in one pass; a tree's mask is placed
    on the diagonal block of its rows (a chain's rows stay all False: they see themselves through the cache)."""
    if len(batches) == 1:
        return batches[0]
    fields = {name: torch.cat([getattr(b, name) for b in batches])
              for name in ("tokens", "slots", "positions", "cache_index", "context_len")}
    mask = extra = None
    if any(b.extra_keys is not None for b in batches):
        extra = tuple(key for b in batches for key in (b.extra_keys or ((),) * len(b)))
    if any(b.tree_mask is not None for b in batches):
        n = sum(len(b) for b in batches)
        mask = torch.zeros(n, n, dtype=torch.bool)
        row = 0
        for b in batches:
            if b.tree_mask is not None:
                mask[row:row + len(b), row:row + len(b)] = b.tree_mask
            row += len(b)
    return RowBatch(**fields, tree_mask=mask, extra_keys=extra)


class LeanSlots:
    """The lean runtime's multi-slot cache as a :class:`SlotBackend`: every piece of a pass (chains and trees,
    several sequences) in one ``forward_rows`` call.

    Args:
        model: the lean decoder; ``name``: its identity.
    """

    supports_tree = True
    supports_expansion = True
    supports_hidden_states = True
    supports_export = True

    def __init__(self, model: LeanLlama, name: str = "model") -> None:
        self.model = model
        self.name = name
        self.vocab_size = model.config.vocab_size
        self.max_context = model.config.max_context
        self.num_slots = model.cache.num_slots
        self.max_pieces = self.num_slots

    def forward(self, pieces: Sequence[Piece]) -> PassOutput:
        batches, logit_rows, hidden_rows, row = [], [], [], 0
        for piece in pieces:
            n = len(piece.token_ids)
            if piece.expansion is not None:
                e = piece.expansion
                batches.append(expansion_rows(list(piece.token_ids), list(e.positions), [list(a) for a in e.ancestors],
                                              e.base, piece.start, piece.slot))
            elif piece.parents is not None:
                check_parents(piece.parents)
                batches.append(tree_rows(list(piece.token_ids), list(piece.parents), piece.start, piece.slot))
            else:
                batches.append(chain_rows(list(piece.token_ids), piece.start, piece.slot))
            logit_rows.extend(range(row + n - piece.num_logits, row + n))
            if piece.hidden:
                hidden_rows.extend(range(row, row + n))
            row += n
        logits, hidden = self.model.forward_rows(
            concat_rows(batches), logit_rows=torch.tensor(logit_rows, dtype=torch.long),
            hidden_rows=torch.tensor(hidden_rows, dtype=torch.long) if hidden_rows else None)
        for piece in pieces:
            self.model.cache.lengths[piece.slot] = piece.start + len(piece.token_ids)
        return PassOutput(logits, hidden)

    def length(self, slot: int) -> int:
        return self.model.cache.lengths[slot]

    def set_length(self, slot: int, length: int) -> None:
        self.model.cache.lengths[slot] = length

    def compact(self, slot: int, base: int, keep: Sequence[int]) -> None:
        self.model.cache.keep_path(slot, base, keep)

    def export_slot(self, slot: int, length: int) -> KVState:
        return self.model.cache.export_state(slot, length)

    def import_slot(self, slot: int, state: KVState, length: int) -> None:
        self.model.cache.import_slot(slot, state.payload, length)


class OneSlot:
    """A :class:`~draftwise.backends.base.CausalLM` as a :class:`SlotBackend` of one slot (slot 0).

    A pass holds one piece, run through ``forward`` (a chain) or ``forward_tree``; lengths map to the
    backend's ``num_cached`` and ``rollback``. For a backend that cannot export its cache (llama.cpp),
    :meth:`mark` and :meth:`holds` let the engine tell whether the cache still holds the sequence it left
    there (another user of the same backend may have changed it), through ``CausalLM.cache_owner``.

    Args:
        model: the backend.
    """

    num_slots = 1
    max_pieces = 1
    supports_expansion = False

    def __init__(self, model: CausalLM) -> None:
        self.lm = model
        self.name = model.name
        self.vocab_size = model.vocab_size
        self.max_context = model.max_context
        self.supports_tree = bool(model.supports_tree)
        self.supports_hidden_states = bool(model.supports_hidden_states)
        self.supports_export = bool(model.supports_cache_export)

    def forward(self, pieces: Sequence[Piece]) -> PassOutput:
        if len(pieces) != 1:
            raise ValueError(f"{self.name}: a one-slot backend runs one piece per pass, got {len(pieces)}")
        piece = pieces[0]
        if piece.expansion is not None:
            raise ValueError(f"{self.name}: a one-slot backend cannot grow a tree one depth per pass")
        if piece.start != self.lm.num_cached:
            self.lm.rollback(piece.start)
        tokens = list(piece.token_ids)
        if piece.parents is not None:
            out = self.lm.forward_tree(tokens, piece.parents, return_hidden=piece.hidden)
            logits = out.logits
        else:
            hidden = {"return_hidden": True, "hidden_rows": len(tokens)} if piece.hidden else {}
            out = self.lm.forward(tokens, num_logits=max(1, piece.num_logits), **hidden)
            logits = out.logits if piece.num_logits else out.logits[:0]
        return PassOutput(logits, out.hidden if piece.hidden else None)

    def length(self, slot: int) -> int:
        return self.lm.num_cached

    def set_length(self, slot: int, length: int) -> None:
        if length == 0:
            self.lm.reset()
        elif length != self.lm.num_cached:
            self.lm.rollback(length)

    def compact(self, slot: int, base: int, keep: Sequence[int]) -> None:
        self.lm.compact(base, keep)

    def export_slot(self, slot: int, length: int) -> KVState:
        self.set_length(slot, length)
        return self.lm.export_cache()

    def import_slot(self, slot: int, state: KVState, length: int) -> None:
        self.lm.import_cache(state, length)

    def mark(self, slot: int) -> object:
        """Leave a fresh marker on the backend's cache (its current contents are this engine's) and return it."""
        marker = object()
        self.lm.cache_owner = marker
        return marker

    def unmark(self, slot: int) -> None:
        """The cache is about to change: it no longer holds what any marker recorded."""
        self.lm.cache_owner = None

    def holds(self, slot: int, marker: object, length: int) -> bool:
        """True when the cache still holds what was there at :meth:`mark` (``length`` tokens)."""
        return self.lm.cache_owner is marker and self.lm.num_cached == length


class LlamaCppSlots:
    """A llama.cpp context of several sequences (:class:`~draftwise.backends.llama_cpp_backend.LlamaCppCausalLM`
    with ``num_slots`` > 1) as a :class:`SlotBackend`: slot i is llama.cpp's sequence i, and one pass puts every
    piece's rows into one ``llama_decode`` (split at the context's batch capacity), so a draft model drafts one
    depth for every drafting sequence at once. Chains only; its kernels are llama.cpp's native ones (not
    row-invariant), so it serves drafts, whose numerics never decide the output.

    Export copies a slot's KV cells out of llama.cpp (``llama_state_seq_get_data``: about 12 KiB a token for
    Qwen2.5-Coder-0.5B) and import writes them into any slot (``llama_state_seq_set_data``): the prefix cache
    keeps a finished sequence's draft state beside its target state, so the next turn of a conversation catches
    up only on what is new.

    Args:
        model: the llama.cpp backend (shared with its ``CausalLM`` methods, which drive slot 0).

    Raises:
        ValueError: a batch-invariant backend (a target's).
    """

    supports_tree = False
    supports_expansion = False
    supports_hidden_states = False
    supports_export = True

    def __init__(self, model: LlamaCppCausalLM) -> None:
        if model.batch_invariant:
            raise ValueError(f"{model.name}: several sequences in one llama.cpp context are for drafts (loaded "
                             "without batch invariance)")
        self.lm = model
        self.name = model.name
        self.vocab_size = model.vocab_size
        self.max_context = model.max_context
        self.num_slots = model.num_slots
        self.max_pieces = model.num_slots

    def forward(self, pieces: Sequence[Piece]) -> PassOutput:
        self._check_pieces(pieces)
        for piece in pieces:
            self.lm.truncate_sequence(piece.slot, piece.start)
        rows = [(int(token), piece.slot, piece.start + i, i >= len(piece.token_ids) - piece.num_logits)
                for piece in pieces for i, token in enumerate(piece.token_ids)]
        return PassOutput(torch.from_numpy(self.lm.decode_sequences(rows)), None)

    def _check_pieces(self, pieces: Sequence[Piece]) -> None:
        slots = [piece.slot for piece in pieces]
        if len(set(slots)) != len(slots) or len(slots) > self.max_pieces:
            raise ValueError(f"{self.name}: a pass takes pieces of distinct slots, at most {self.max_pieces}")
        for piece in pieces:
            if piece.parents is not None or piece.expansion is not None or piece.hidden:
                raise ValueError(f"{self.name}: llama.cpp slots run chains without hidden states")
            if not 0 <= piece.slot < self.num_slots or not 0 <= piece.start <= self.length(piece.slot):
                raise ValueError(f"{self.name}: piece at slot {piece.slot}, position {piece.start} outside the "
                                 f"{self.num_slots} slots' contents")
            if not piece.token_ids or piece.start + len(piece.token_ids) > self.max_context:
                raise ValueError(f"{self.name}: {len(piece.token_ids)} tokens at position {piece.start} do not fit "
                                 f"a context of {self.max_context} tokens")
            if min(piece.token_ids) < 0 or max(piece.token_ids) >= self.vocab_size:
                raise ValueError(f"{self.name}: token id outside [0, {self.vocab_size})")

    def length(self, slot: int) -> int:
        return self.lm.sequence_length(slot)

    def set_length(self, slot: int, length: int) -> None:
        self.lm.truncate_sequence(slot, length)

    def compact(self, slot: int, base: int, keep: Sequence[int]) -> None:
        if list(keep) != list(range(len(keep))):
            raise ValueError(f"{self.name}: llama.cpp slots keep a prefix of a pass (chains), got {list(keep)}")
        self.set_length(slot, base + len(keep))

    def export_slot(self, slot: int, length: int) -> KVState:
        self.set_length(slot, length)
        return self.lm.export_sequence(slot)

    def import_slot(self, slot: int, state: KVState, length: int) -> None:
        self.lm.import_sequence(slot, state, length)


def as_slot_backend(target: SlotBackend | CausalLM | LeanLlama) -> SlotBackend:
    """``target`` as a slot backend: a lean target's multi-slot cache as :class:`LeanSlots`, a llama.cpp context of
    several sequences as :class:`LlamaCppSlots`, any other :class:`~draftwise.backends.base.CausalLM` as
    :class:`OneSlot`; a slot backend as it is."""
    if isinstance(target, LeanCausalLM):
        return LeanSlots(target.model, target.name)
    if isinstance(target, LeanLlama):
        return LeanSlots(target)
    if isinstance(target, LlamaCppCausalLM) and target.num_slots > 1:
        return LlamaCppSlots(target)
    if isinstance(target, CausalLM):
        return OneSlot(target)
    return target


def chunk_counts(remaining: Sequence[int], budget: int, max_pieces: int) -> list[int]:
    """The one prefill chunker: how many of each item's ``remaining`` tokens the next pass takes, items in
    order (oldest first), within ``budget`` rows and ``max_pieces`` items; 0 for an item left for a later pass.
    The engine core chunks prompts with it (its per-step token budget) and the draft model its catch-up."""
    counts = []
    for n in remaining:
        take = min(n, budget) if max_pieces > 0 else 0
        if take > 0:
            budget -= take
            max_pieces -= 1
        counts.append(max(0, take))
    return counts
