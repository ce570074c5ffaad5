"""Rows of a forward pass: one new token each, from one or several sequences.

The lean runtime's single forward interface (:meth:`draftwise.backends.lean.model.LeanLlama.forward_rows`). A
prefill, a verification chain, a draft tree and (with several slots) a batch of requests are all just rows:

- ``tokens[r]``: the token fed at row r;
- ``slots[r]``: the sequence (KV-cache slot) the row belongs to;
- ``positions[r]``: its rotary position (its depth in the sequence);
- ``cache_index[r]``: where its key and value are written in the slot's cache;
- visibility: row r attends to the keys ``[0, context_len[r])`` of its slot, plus (trees only) the keys of
  the rows ``j`` of the same slot with ``tree_mask[r, j]`` (ancestors and itself).

A chain (prefill or verification) of n tokens on top of ``L`` cached ones has ``cache_index = positions =
L..L+n-1`` and ``context_len = cache_index + 1``. A tree of n nodes on top of ``L`` has ``cache_index = L + r``,
``positions = L + depth``, ``context_len = L`` and ``tree_mask`` = ancestor-or-self (see :mod:`draftwise.tree`).
A tree grown one depth per pass (a draft model's tree, :func:`expansion_rows`) also sees, per row, the keys of
its ancestors written by earlier passes (``extra_keys``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowBatch", "chain_rows", "expansion_rows", "tree_rows"]


@dataclass(frozen=True)
class RowBatch:
    """The rows of one forward pass (all tensors ``[n]`` int64 on the CPU unless noted).

    Attributes:
        tokens: token ids.
        slots: KV-cache slot (sequence) of each row.
        positions: rotary positions.
        cache_index: cache entry each row's key/value is written to (distinct within a slot).
        context_len: the row sees its slot's keys ``[0, context_len)`` (tokens).
        tree_mask: ``[n, n]`` bool or None: row r also sees row j's key when ``tree_mask[r, j]`` (rows of the
            same slot only).
        extra_keys: None, or per row the cache entries (beyond ``context_len``, in logical order) it also sees,
            written by earlier passes: a grown tree's ancestors. Rows with extra keys are tree rows.
    """

    tokens: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    cache_index: torch.Tensor
    context_len: torch.Tensor
    tree_mask: torch.Tensor | None = None
    extra_keys: tuple[tuple[int, ...], ...] | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def chain_rows(tokens: list[int], start: int, slot: int = 0) -> RowBatch:
    """Rows for ``tokens`` appended to a slot holding ``start`` cached tokens (prefill or a verify chain)."""
    n = len(tokens)
    index = torch.arange(start, start + n, dtype=torch.long)
    return RowBatch(
        tokens=torch.tensor(tokens, dtype=torch.long), slots=torch.full((n,), slot, dtype=torch.long),
        positions=index, cache_index=index, context_len=index + 1,
    )


def tree_rows(tokens: list[int], parents: list[int], start: int, slot: int = 0) -> RowBatch:
    """Rows for a draft tree ``tokens = [root, node_0, ...]`` (``parents[i]`` of node i, -1 = root; see
    :mod:`draftwise.tree`) on top of ``start`` cached tokens; entries are written at ``start + r``."""
    from draftwise.tree import tree_attention_mask, tree_position_ids

    n = len(tokens)
    visible = tree_attention_mask(parents, start)[:, start:]  # [n, n] ancestor-or-self
    return RowBatch(
        tokens=torch.tensor(tokens, dtype=torch.long), slots=torch.full((n,), slot, dtype=torch.long),
        positions=tree_position_ids(parents, start).to(torch.long),
        cache_index=torch.arange(start, start + n, dtype=torch.long),
        context_len=torch.full((n,), start, dtype=torch.long), tree_mask=visible.bool(),
    )


def expansion_rows(tokens: list[int], positions: list[int], ancestors: list[list[int]], base: int, start: int,
                   slot: int = 0) -> RowBatch:
    """Rows for one depth of a tree grown one pass per depth: node r (token ``tokens[r]`` at rotary position
    ``positions[r]``) is written at cache entry ``start + r`` and sees the slot's first ``base`` keys (the
    committed context), the entries ``ancestors[r]`` (its ancestors' keys from earlier passes, root side first)
    and itself."""
    n = len(tokens)
    return RowBatch(
        tokens=torch.tensor(tokens, dtype=torch.long), slots=torch.full((n,), slot, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        cache_index=torch.arange(start, start + n, dtype=torch.long),
        context_len=torch.full((n,), base, dtype=torch.long), tree_mask=torch.eye(n, dtype=torch.bool),
        extra_keys=tuple(tuple(int(e) for e in a) for a in ancestors),
    )

