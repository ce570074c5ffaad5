"""Prefix reuse: a finished sequence's KV state serves a later request that shares a prompt prefix.

A backend that exports its cache (:attr:`~draftwise.backends.slots.SlotBackend.supports_export`) keeps finished
sequences' states in a :class:`~draftwise.prefix_cache.PrefixCache` (target and proposer state, per scope); a new
sequence imports the longest kept prefix of its prompt into its slot. A backend that cannot export (llama.cpp)
reuses only what a slot still holds: the sequence that last ran in it, marked by the backend so that a change
behind the engine's back is noticed.

The same import serves the choices of one request (``n`` > 1): a sequence whose
:attr:`~draftwise.engine.sequence.BatchSequence.prompt_source` (its sibling) holds the prompt in its slot forks
it (the sibling's slot exported, imported into its own), so the prompt is prefilled once and each other choice
feeds only its last prompt token (for its first token's logits), as a request sharing a kept prefix does.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftwise.backends.slots import SlotBackend
from draftwise.proposers.base import Proposer
from draftwise.engine.sequence import BatchSequence
from draftwise.prefix_cache import PrefixCache, PrefixEntry
from draftwise.proposers.base import common_prefix_length

__all__ = ["PrefixReuse"]


@dataclass(frozen=True)
class _LiveSequence:
    """What a slot of a backend that cannot export its cache still holds after a request, and whose it is."""

    scope: str
    tokens: tuple[int, ...]
    marker: object


class PrefixReuse:
    """Reuse of kept KV prefixes for the sequences of one engine's slots.

    Args:
        backend: the engine's slot backend.
        cache: where exported states are kept; None or disabled: every request prefills its whole prompt.
    """

    def __init__(self, backend: SlotBackend, cache: PrefixCache | None) -> None:
        self.backend = backend
        self.cache = cache
        self._live: dict[int, _LiveSequence] = {}  # slot -> what it still holds (backends without export)

    @property
    def enabled(self) -> bool:
        return self.cache is not None and self.cache.enabled

    def release(self, slot: int) -> None:
        """A sequence left ``slot``: empty it, unless it keeps that sequence's tokens for reuse (:meth:`keep`)."""
        if slot not in self._live:
            self.backend.set_length(slot, 0)

    def forget(self, num_slots: int = 0) -> None:
        """The slots were overwritten (e.g. by calibration passes): nothing they held is reusable; the first
        ``num_slots`` slots are emptied."""
        self._live.clear()
        for slot in range(num_slots):
            self.backend.set_length(slot, 0)

    def reuse(self, sequence: BatchSequence, proposer: Proposer | None) -> int:
        """Put the KV state of the longest kept prefix of the sequence's prompt (same scope) into its slot and its
        ``proposer`` (None: the sequence does not speculate); returns its length (at most ``len(prompt) - 1``: the
        last prompt token is always fed, for the first token's logits). Without one, the slot (and the proposer)
        start empty."""
        slot = sequence.slot
        live = self._live.pop(slot, None)
        reused = self._fork(sequence)
        if reused:
            if proposer is not None:  # the sibling's proposer state goes on with it: this one's starts empty
                proposer.import_state(sequence, None, 0)
            return reused
        if self.enabled:
            limit = len(sequence.prompt) - 1
            if self.backend.supports_export:
                match = self.cache.lookup(sequence.scope, sequence.prompt)
                if match.entry is not None and min(match.length, limit) > 0:
                    reused = min(match.length, limit)
                    self.backend.import_slot(slot, match.entry.target_state, reused)
                    if proposer is not None:
                        proposer.import_state(sequence, match.entry.proposer_state, reused)
            elif live is not None and live.scope == sequence.scope and \
                    self.backend.holds(slot, live.marker, len(live.tokens)):
                # only the sequence the slot still holds can be reused; the proposer reconciles by common prefix
                reused = min(common_prefix_length(live.tokens, sequence.prompt), limit)
                if reused > 0:
                    self.backend.set_length(slot, reused)
            self.cache.record(len(sequence.prompt), reused)
        if not self.backend.supports_export:
            self.backend.unmark(slot)  # the slot is about to change
        if reused == 0:
            self.backend.set_length(slot, 0)
            if proposer is not None:
                proposer.import_state(sequence, None, 0)
        return reused

    def _fork(self, sequence: BatchSequence) -> int:
        """Import the prompt KV its running sibling (:attr:`~BatchSequence.prompt_source`) holds into the
        sequence's slot (at most ``len(prompt) - 1`` tokens); returns the tokens imported (0: no sibling holds
        them, or the backend cannot export)."""
        source = sequence.prompt_source
        if source is None or source.finish_reason or source.slot < 0 or source.slot == sequence.slot or \
                source.prompt_left or not self.backend.supports_export:
            return 0
        length = min(common_prefix_length(source.prompt, sequence.prompt), len(sequence.prompt) - 1,
                     self.backend.length(source.slot))
        if length <= 0:
            return 0
        self.backend.import_slot(sequence.slot, self.backend.export_slot(source.slot, length), length)
        return length

    def keep(self, sequence: BatchSequence, proposer: Proposer | None) -> None:
        """Keep the sequence's committed KV state (target and ``proposer``'s) for later requests: in the prefix
        cache, or (a backend that cannot export) as what its slot still holds."""
        tokens = sequence.context
        length = min(self.backend.length(sequence.slot), len(tokens))
        if length <= 0:
            return
        if not self.backend.supports_export:
            self.backend.set_length(sequence.slot, length)
            self._live[sequence.slot] = _LiveSequence(sequence.scope, tuple(tokens[:length]),
                                                      self.backend.mark(sequence.slot))
            return
        target_state = self.backend.export_slot(sequence.slot, length)
        proposer_state = proposer.export_state(sequence) if proposer is not None else None
        self.cache.insert(PrefixEntry(sequence.scope, tuple(tokens[:length]), target_state, proposer_state,
                                      target_state.nbytes))
