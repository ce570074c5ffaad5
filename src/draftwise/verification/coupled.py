"""Coupled verification (Gumbel-max; Daliri et al. 2024, "Coupling without communication and
drafter-invariant speculative decoding").

The target's token at sequence position t is ``argmax(scores_t + G_t)`` with ``G_t`` the request's Gumbel
noise for position t (:mod:`draftwise.sampling`). A draft node at depth d stands at position
``first + d - 1`` and is accepted exactly when its token equals the target's Gumbel-argmax after its parent
(the noise of position ``first + depth(parent)``); the committed token where the path stops is the target's
Gumbel-argmax there. Every committed token is therefore the token plain coupled decoding would choose:
exactly the target's distribution, and for a given seed the same text whatever the proposer, K or tree.
Deterministic drafts (n-gram, heads) and drafts sampled with the same noise are verified alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.config import SamplingParams
from draftwise.sampling import gumbel_argmax, processed_scores
from draftwise.tree import node_depths
from draftwise.verification.tree import check_draft, follow_target_choices
from draftwise.verification.types import VerificationResult

__all__ = ["verify_coupled"]


def verify_coupled(
    token_ids: Sequence[int],
    parents: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    noise: torch.Tensor,
) -> VerificationResult:
    """Verify a draft by comparing each node with the target's Gumbel-argmax.

    Args:
        token_ids: ``[n]`` draft node tokens (n >= 0).
        parents: ``[n]`` parent indices (-1 = root), topological order.
        target_logits: ``[n + 1, vocab]`` raw target logits; row 0 follows the root, row i + 1 follows node i.
            Temperature / top-k / top-p are applied to the rows the walk visits.
        params: sampling parameters (temperature > 0).
        noise: ``[D + 1, vocab]`` Gumbel noise by depth: row d is ``G`` of the position after a depth-d node
            (the root has depth 0), D the tree's depth.

    Returns:
        The accepted path plus the target's Gumbel-argmax where it stops (recovered or bonus token).

    Raises:
        ValueError: inconsistent shapes or parents, or greedy params.
    """
    check_draft(token_ids, parents, target_logits, "target_logits")
    depths = [0] + node_depths(parents)  # by row
    if noise.dim() != 2 or noise.shape[0] < max(depths) + 1 or noise.shape[1] != target_logits.shape[1]:
        raise ValueError(f"noise must be [depth + 1, vocab] = [{max(depths) + 1}, {target_logits.shape[1]}], "
                         f"got {list(noise.shape)}")

    def choose(row: int) -> int:
        scores = processed_scores(target_logits[row : row + 1], params)  # [1, vocab]
        return int(gumbel_argmax(scores, noise[depths[row] : depths[row] + 1])[0])

    return follow_target_choices(token_ids, parents, choose)
