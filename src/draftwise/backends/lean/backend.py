"""The lean runtime as a :class:`draftwise.backends.base.CausalLM` (one sequence, slot 0).

Rollback sets a length, tree compaction moves the accepted path's entries, and export/import copy a slot's
entries (the cache is written in place, so an exported state must own its memory).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from draftwise.backends.base import CausalLM, ForwardOutput, KVState
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.lean.rows import chain_rows, tree_rows
from draftwise.tree import check_parents

__all__ = ["LeanCausalLM"]

logger = logging.getLogger(__name__)


def _tail_rows(first: int, last: int, start: int) -> torch.Tensor:
    """Indexes (relative to ``first``) of the rows ``>= start`` within ``[first, last)``."""
    return torch.arange(min(max(first, start), last), last) - first


class LeanCausalLM(CausalLM):
    """A :class:`LeanLlama` driving one sequence.

    Args:
        model: the lean decoder (its cache needs at least one slot).
        name: identity used in messages and calibration keys.
        prefill_chunk: rows per pass when a forward feeds more tokens than this (tokens).
    """

    supports_tree = True
    supports_hidden_states = True
    supports_cache_export = True

    def __init__(self, model: LeanLlama, name: str = "model", prefill_chunk: int = 512) -> None:
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.name = name
        self.vocab_size = model.config.vocab_size
        self.max_context = model.config.max_context
        self.hidden_size = model.config.hidden_size
        self.device = torch.device("cpu")
        self._slot = 0

    @property
    def num_cached(self) -> int:
        return self.model.cache.lengths[self._slot]

    def _set_length(self, length: int) -> None:
        self.model.cache.lengths[self._slot] = length

    def forward(self, token_ids: Sequence[int], *, num_logits: int | None = None, return_hidden: bool = False,
                hidden_rows: int | None = None) -> ForwardOutput:
        token_ids = [int(t) for t in token_ids]
        self._check_forward_args(token_ids)
        n = len(token_ids)
        keep = n if num_logits is None else max(1, min(num_logits, n))
        rows_hidden = keep if hidden_rows is None else max(1, min(hidden_rows, n))
        start = self.num_cached
        logits, hidden = [], []
        for first in range(0, n, self.prefill_chunk):  # chunks bound the attention's memory on long prompts
            last = min(n, first + self.prefill_chunk)
            rows = chain_rows(token_ids[first:last], start + first, self._slot)
            want_logits = _tail_rows(first, last, n - keep)
            want_hidden = _tail_rows(first, last, n - rows_hidden) if return_hidden else None
            chunk_logits, chunk_hidden = self.model.forward_rows(
                rows, logit_rows=want_logits, hidden_rows=want_hidden if want_hidden is not None and len(want_hidden) else None)
            self._set_length(start + last)
            if len(want_logits):
                logits.append(chunk_logits)
            if chunk_hidden is not None:
                hidden.append(chunk_hidden)
        return ForwardOutput(logits=torch.cat(logits) if len(logits) > 1 else logits[0],
                             hidden=(torch.cat(hidden) if len(hidden) > 1 else hidden[0]) if return_hidden else None)

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        token_ids = [int(t) for t in token_ids]
        self._check_forward_args(token_ids)
        if len(parents) != len(token_ids) - 1:
            raise ValueError(f"{len(token_ids)} tree tokens (root included) need {len(token_ids) - 1} parents, got {len(parents)}")
        check_parents(parents)
        n = len(token_ids)
        rows = tree_rows(token_ids, list(parents), self.num_cached, self._slot)
        logits, hidden = self.model.forward_rows(rows, hidden_rows=torch.arange(n) if return_hidden else None)
        self._set_length(self.num_cached + n)
        return ForwardOutput(logits=logits, hidden=hidden)

    def compact(self, base: int, keep: Sequence[int]) -> None:
        keep = [int(j) for j in keep]
        if not 0 <= base <= self.num_cached or any(b <= a for a, b in zip(keep, keep[1:])) or \
                (keep and (keep[0] < 0 or base + keep[-1] >= self.num_cached)):
            raise ValueError(f"compact({base}, {keep}) outside a cache of {self.num_cached} entries")
        self.model.cache.keep_path(self._slot, base, keep)

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)
        self._set_length(length)

    def export_cache(self) -> KVState:
        """Copies of the slot's first ``num_cached`` entries: per layer ``(keys, values)`` ``[kv_heads, length,
        head_dim]``."""
        length = self.num_cached
        if length == 0:
            return KVState(payload=(), length=0, nbytes=0)
        return self.model.cache.export_state(self._slot, length)

    def import_cache(self, state: KVState, length: int) -> None:
        if not 0 <= length <= state.length:
            raise ValueError(f"import length {length} outside [0, {state.length}]")
        if length == 0:
            self.reset()
            return
        if len(state.payload) != self.model.config.num_layers:
            raise ValueError(f"{self.name}: a KV state of {len(state.payload)} layers for a "
                             f"{self.model.config.num_layers}-layer model")
        self.model.cache.import_slot(self._slot, state.payload, length)
