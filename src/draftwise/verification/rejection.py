"""Lossless speculative rejection sampling for temperature > 0, over chains and trees.

At a node with target distribution ``p`` (its row after temperature / top-k / top-p) and children
``c_1..c_m`` (index order), with ``q_j`` the distribution child c_j was drawn from (``draft_probs``; one-hot
on its token for a deterministic draft), start with ``residual = p`` and try the children in turn: c_j (token
x) is accepted with probability ``min(1, residual[x] / q_j[x])``; on rejection ``residual <-
normalize(max(0, residual - q_j))`` and the next child is tried. If every child is rejected (or the node is a
leaf), the next token is drawn from ``residual`` (recovered; at a leaf, or with no child, it is ``p``: the
bonus token). This is SpecInfer's multi-step speculative sampling (Miao et al. 2024, Algorithm 2), which is
lossless when siblings are independent draws from their parent's draft distribution or deterministic
distinct tokens. On a chain (one child per node) it is exactly Leviathan et al. 2023 ("Fast Inference from
Transformers via Speculative Decoding", Algorithm 1) and Chen et al. 2023: accept with ``min(1, p/q)``,
resample from ``normalize(max(0, p - q))``. For one-hot siblings the residual update removes the rejected
token (the tree rule of SpecInfer / EAGLE). Every emitted token is distributed exactly as the target's own
sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.config import SamplingParams
from draftwise.sampling import logits_to_probs, sample_from_probs
from draftwise.tree import children_of
from draftwise.verification.tree import check_draft, result_for_path
from draftwise.verification.types import VerificationResult

__all__ = ["verify_rejection", "residual_distribution"]


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(0, target_probs - draft_probs)``, unnormalized (``[vocab]``).

    Falls back to ``target_probs`` when the residual has no mass (possible only through rounding, when the
    two distributions are equal and a rejection therefore has probability ~0).
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    if float(residual.sum()) <= 0.0:
        return target_probs
    return residual


def verify_rejection(
    token_ids: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> VerificationResult:
    """Verify a draft chain or tree by speculative rejection sampling (see the module docstring).

    Args:
        token_ids: ``[n]`` draft node tokens (n >= 0).
        parents: ``[n]`` parent indices (-1 = root), topological order; a chain is ``(-1, 0, ..., n-2)``.
        draft_probs: ``[n, vocab]``, row i the distribution node i was drawn from (after the same processing
            as the target's), or None for a deterministic (one-hot) draft.
        target_logits: ``[n + 1, vocab]`` raw target logits; row 0 follows the root, row i + 1 follows node i.
            Temperature / top-k / top-p are applied to the rows the walk visits.
        params: sampling parameters (temperature > 0).
        generator: the request's CPU generator (one uniform per tried child, one draw for the next token).

    Returns:
        The accepted path plus one recovered or bonus token.

    Raises:
        ValueError: inconsistent shapes or parents, or greedy params.
    """
    check_draft(token_ids, parents, target_logits, "target_logits")
    if draft_probs is not None and tuple(draft_probs.shape) != (len(token_ids), target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [n, vocab] = [{len(token_ids)}, {target_logits.shape[1]}], "
                         f"got {tuple(draft_probs.shape)}")
    if draft_probs is not None:
        draft_probs = draft_probs.float().cpu()
    children = children_of(parents)
    node, accepted = -1, []
    while True:
        residual = logits_to_probs(target_logits[node + 1 : node + 2], params)[0].cpu()  # [vocab], sums to 1
        chosen = None
        for child in children[node]:
            token = token_ids[child]
            q = float(draft_probs[child, token]) if draft_probs is not None else 1.0
            if float(torch.rand((), generator=generator)) * q < float(residual[token]):  # u < r/q, no division
                chosen = child
                break
            residual = _without(residual, draft_probs[child] if draft_probs is not None else None, token)
        if chosen is None:
            next_token = sample_from_probs(residual, generator)
            return result_for_path(token_ids, accepted, next_token, at_leaf=not children[node])
        accepted.append(chosen)
        node = chosen


def _without(residual: torch.Tensor, draft_row: torch.Tensor | None, token: int) -> torch.Tensor:
    """``normalize(max(0, residual - q))`` after a rejected child (q one-hot on ``token`` when ``draft_row`` is
    None); keeps ``residual`` when nothing would be left (only through rounding)."""
    if draft_row is None:
        updated = residual.clone()
        updated[token] = 0.0  # max(0, r - onehot(token))
    else:
        updated = residual_distribution(residual, draft_row)
    mass = float(updated.sum())
    return updated / mass if mass > 0.0 else residual
