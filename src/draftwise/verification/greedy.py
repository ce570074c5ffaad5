"""Greedy verification (temperature 0): follow the draft nodes that equal the target's argmax, then add the
target's own argmax where the path stops (correction) or after a leaf (bonus). Output is identical to
greedy decoding of the target alone, for chains and trees alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.verification.tree import check_draft, follow_target_choices
from draftwise.verification.types import VerificationResult

__all__ = ["verify_greedy"]


def verify_greedy(token_ids: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> VerificationResult:
    """Verify a draft against the target's argmax.

    Args:
        token_ids: ``[n]`` draft node tokens (n >= 0).
        parents: ``[n]`` parent indices (-1 = root), topological order; a chain is ``(-1, 0, ..., n-2)``.
        target_logits: ``[n + 1, vocab]`` target logits; row 0 follows the root, row i + 1 follows node i.

    Returns:
        The accepted path plus one correction or bonus token.

    Raises:
        ValueError: if the shapes or parents are inconsistent.
    """
    check_draft(token_ids, parents, target_logits, "target_logits")
    return follow_target_choices(token_ids, parents, lambda row: int(torch.argmax(target_logits[row])))
