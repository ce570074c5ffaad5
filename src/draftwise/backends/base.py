"""The backend interface: one causal LM with one KV cache (one sequence).

The engine never sees framework specifics. A backend keeps the tokens it has processed in its KV cache;
``forward`` appends new tokens and returns logits for them, ``rollback`` truncates the cache. Rolling back
to length n and feeding the same tokens again must give the same logits as a fresh prefill (tested).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CausalLM", "ForwardOutput", "ContextOverflowError", "KVState"]


class ContextOverflowError(ValueError):
    """Raised when a forward pass would exceed the model's context length (tokens)."""


@dataclass(frozen=True)
class ForwardOutput:
    """Result of one forward pass over n new tokens.

    Attributes:
        logits: ``[n_logits, vocab]`` float32 on CPU, for the last ``n_logits`` new positions; row i is the
            distribution of the token *after* the corresponding input token.
        hidden: ``[n_hidden, hidden_size]`` last hidden states (after the final norm) of the last n_hidden new
            positions (by default n_hidden = n_logits) when requested, else None.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class KVState:
    """An exported KV cache (see :meth:`CausalLM.export_cache`).

    Attributes:
        payload: backend-specific contents (for the PyTorch backend: per layer ``(keys, values)``, each
            ``[1, kv_heads, length, head_dim]``).
        length: positions held (tokens).
        nbytes: memory the payload keeps alive (bytes).
    """

    payload: Any
    length: int
    nbytes: int


class CausalLM(ABC):
    """A causal language model with a single-sequence KV cache.

    Attributes:
        vocab_size: width of the logits (may exceed the tokenizer's vocabulary when the embedding is padded).
        max_context: context length in tokens.
        name: human-readable model identity (path or hub id).
    """

    vocab_size: int
    max_context: int
    name: str

    @property
    @abstractmethod
    def num_cached(self) -> int:
        """Number of tokens currently in the KV cache."""

    @abstractmethod
    def forward(
        self, token_ids: Sequence[int], *, num_logits: int | None = None, return_hidden: bool = False,
        hidden_rows: int | None = None,
    ) -> ForwardOutput:
        """Run the model over ``token_ids`` (``[n]``, n >= 1) on top of the cache and append them to it.

        Args:
            token_ids: new tokens, in order.
            num_logits: return logits for only the last ``num_logits`` positions (None: all n).
            return_hidden: also return the last hidden states (after the final norm).
            hidden_rows: hidden states for the last ``hidden_rows`` positions (default: the logits' rows).

        Raises:
            ContextOverflowError: if ``num_cached + n`` exceeds ``max_context``.
            ValueError: if ``token_ids`` is empty or holds an id outside the vocabulary.
        """

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Truncate the KV cache to its first ``length`` tokens (0 <= length <= num_cached).

        Raises:
            ValueError: if ``length`` is out of range.
        """

    def reset(self) -> None:
        """Empty the KV cache."""
        self.rollback(0)

    #: True when :meth:`forward_tree` and :meth:`compact` are implemented (tree verification).
    supports_tree: bool = False
    #: True when ``forward(..., return_hidden=True)`` returns hidden states (Medusa / EAGLE proposers).
    supports_hidden_states: bool = False

    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        """Run a draft tree in one pass: ``token_ids = [root, node_0, ..., node_{n-1}]`` (``[n + 1]``), with
        ``parents`` (``[n]``, -1 = the root; see :mod:`draftwise.tree`) giving each node's parent.

        Row r attends to the cache and to its own root-to-node path, at position ``num_cached + depth``. All
        n + 1 entries are appended to the cache in row order; call :meth:`compact` to keep the accepted path.

        Returns:
            logits ``[n + 1, vocab]`` (and hidden ``[n + 1, H]`` when ``return_hidden``).

        Raises:
            NotImplementedError: the backend cannot run trees (``supports_tree`` is False).
            ContextOverflowError, ValueError: as :meth:`forward`, or inconsistent ``parents``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support tree verification")

    def compact(self, base: int, keep: Sequence[int]) -> None:
        """Keep the first ``base`` cache entries and the entries ``base + j`` for ``j`` in ``keep`` (strictly
        increasing offsets into the last pass), dropping the others: the accepted path's KV entries.

        The engine's one cache operation after a verification, for chains and trees. A chain's accepted path
        is a prefix (``keep = 0..m-1``), which is a :meth:`rollback`; this default implements that case, and
        tree backends override it (keeping the prefix case as a rollback fast path).

        Raises:
            NotImplementedError: ``keep`` is not a prefix and the backend cannot run trees.
            ValueError: offsets out of range or not increasing.
        """
        keep = [int(j) for j in keep]
        if keep == list(range(len(keep))):
            self.rollback(base + len(keep))
            return
        raise NotImplementedError(f"{type(self).__name__} does not support tree verification")

    #: Set by the engine (or draft model) that last left a sequence in this cache for reuse; a backend that
    #: cannot export its cache clears it whenever its cache changes (llama.cpp: every forward and rollback), so
    #: an engine sharing the backend (or a calibration) never leaves contents mistaken for the kept ones.
    cache_owner: object | None = None

    #: True when :meth:`export_cache` and :meth:`import_cache` are implemented (prefix reuse across requests
    #: beyond the one sequence the cache holds).
    supports_cache_export: bool = False

    def export_cache(self) -> KVState:
        """A handle on the KV cache's current contents (``num_cached`` positions) that :meth:`import_cache` can
        restore later, whatever runs in between. The backend keeps using its cache; exported contents are never
        modified in place, so exporting copies nothing.

        Raises:
            NotImplementedError: the backend cannot export (``supports_cache_export`` is False).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot export its KV cache")

    def import_cache(self, state: KVState, length: int) -> None:
        """Replace the KV cache by the first ``length`` positions of ``state`` (0 <= length <= state.length).
        Feeding the next tokens then gives the logits a fresh prefill of the same tokens would (bit for bit on
        batch-invariant paths).

        Raises:
            NotImplementedError: the backend cannot import (``supports_cache_export`` is False).
            ValueError: ``length`` out of range or a state from another kind of backend.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot import a KV cache")

    def _check_forward_args(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) == 0:
            raise ValueError("forward needs at least one token")
        if self.num_cached + len(token_ids) > self.max_context:
            raise ContextOverflowError(
                f"{self.name}: {self.num_cached} cached + {len(token_ids)} new tokens exceed the context "
                f"length of {self.max_context} tokens"
            )
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"{self.name}: token id out of range [0, {self.vocab_size}): {low if low < 0 else high}")

    def _check_rollback_args(self, length: int) -> None:
        if not (0 <= length <= self.num_cached):
            raise ValueError(f"rollback length {length} outside [0, {self.num_cached}]")
