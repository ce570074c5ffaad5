"""Verification of a draft tree: the longest root-to-node path the target agrees with, plus one target token.

Greedy: starting at the root, follow the child whose token equals the target's argmax at the current node;
stop when no child matches; the argmax there is the recovered/bonus token. The committed tokens are exactly
what plain greedy decoding produces (the target's argmax at every step).

Sampling (temperature > 0): the lossless multi-candidate rule (SpecInfer, Miao et al. 2024, "multi-step
speculative sampling"; Chen et al. 2023; also EAGLE's verification) for deterministic drafts. At a node with
residual target distribution ``target_probs`` and children ``c_1..c_m`` (tokens in index order): child c_j is
accepted with probability ``residual[c_j]`` (its one-hot draft gives ``min(1, p/q) = p``); on rejection its
token is removed, ``residual[c_j] = 0`` and renormalized, and the next sibling is tried. If every child is
rejected, the recovered token is sampled from the remaining residual. By induction each committed token is
distributed exactly as the target's own sample. Medusa's lossy "typical acceptance" is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.sampling import sample_from_probs
from draftwise.tree import children_of

__all__ = ["TreeVerificationResult", "verify_tree_greedy", "verify_tree_sampling"]


@dataclass(frozen=True)
class TreeVerificationResult:
    """Outcome of verifying one draft tree.

    Attributes:
        accepted_nodes: node indices of the accepted path, depth 1 first (empty: nothing accepted).
        next_token_id: recovered token (the path stopped before a leaf's depth) or bonus token.
        token_ids: tokens to commit: the accepted nodes' tokens then ``next_token_id``.
    """

    accepted_nodes: tuple[int, ...]
    next_token_id: int
    token_ids: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def _check(token_ids: Sequence[int], parents: Sequence[int], rows: torch.Tensor) -> None:
    if len(token_ids) != len(parents):
        raise ValueError(f"{len(token_ids)} tree tokens but {len(parents)} parents")
    if rows.dim() != 2 or rows.shape[0] != len(token_ids) + 1:
        raise ValueError(f"expected [{len(token_ids) + 1}, vocab] target rows (root + nodes), got {list(rows.shape)}")


def verify_tree_greedy(token_ids: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> TreeVerificationResult:
    """Greedy tree verification.

    Args:
        token_ids: ``[n]`` node tokens.
        parents: ``[n]`` parent indices (-1 = root), topological order.
        target_logits: ``[n + 1, vocab]``; row 0 follows the root, row i + 1 follows node i.

    Raises:
        ValueError: inconsistent shapes.
    """
    _check(token_ids, parents, target_logits)
    argmax = torch.argmax(target_logits, dim=-1).tolist()  # [n + 1]
    children = children_of(parents)
    node, accepted = -1, []
    while True:
        best = argmax[node + 1]
        match = next((c for c in children[node] if token_ids[c] == best), None)
        if match is None:
            return TreeVerificationResult(tuple(accepted), best, tuple(token_ids[c] for c in accepted) + (best,))
        accepted.append(match)
        node = match


def verify_tree_sampling(
    token_ids: Sequence[int], parents: Sequence[int], target_probs: torch.Tensor, generator: torch.Generator
) -> TreeVerificationResult:
    """Lossless multi-candidate rejection sampling over a deterministic draft tree (see the module docstring).

    Args:
        token_ids: ``[n]`` node tokens.
        parents: ``[n]`` parent indices (-1 = root), topological order.
        target_probs: ``[n + 1, vocab]`` float32 target distributions (temperature / top-p applied); row 0
            follows the root, row i + 1 follows node i.
        generator: the request's random generator.

    Raises:
        ValueError: inconsistent shapes.
    """
    _check(token_ids, parents, target_probs)
    children = children_of(parents)
    node, accepted = -1, []
    while True:
        residual = target_probs[node + 1].clone()
        chosen = None
        for child in children[node]:
            token = token_ids[child]
            mass = float(residual.sum())
            if mass <= 0.0:
                break
            accept_prob = float(residual[token]) / mass
            if accept_prob > 0.0 and float(torch.rand((), generator=generator)) < accept_prob:
                chosen = child
                break
            residual[token] = 0.0
        if chosen is None:
            if float(residual.sum()) <= 0.0:  # only through rounding: every child took the whole mass
                residual = target_probs[node + 1].clone()
            recovered = sample_from_probs(residual / residual.sum(), generator)
            return TreeVerificationResult(tuple(accepted), recovered, tuple(token_ids[c] for c in accepted) + (recovered,))
        accepted.append(chosen)
        node = chosen
