"""Greedy verification (temperature 0): accept the longest prefix of the draft that equals the target's
argmax, then add the target's own argmax at the first mismatch (correction) or after the draft (bonus).
Output is identical to greedy decoding of the target alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.verification.types import VerificationResult

__all__ = ["verify_greedy"]


def verify_greedy(draft_token_ids: Sequence[int], target_logits: torch.Tensor) -> VerificationResult:
    """Verify a draft against the target's argmax.

    Args:
        draft_token_ids: ``[k]`` draft tokens (k >= 0).
        target_logits: ``[k + 1, vocab]`` target logits; row i scores the token at draft position i, the
            last row scores the bonus position.

    Returns:
        The accepted prefix plus one correction or bonus token.

    Raises:
        ValueError: if the shapes disagree.
    """
    k = len(draft_token_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k + 1, vocab] = [{k + 1}, vocab], got {tuple(target_logits.shape)}")
    target_tokens = torch.argmax(target_logits, dim=-1).tolist()  # [k + 1]
    num_accepted = 0
    while num_accepted < k and draft_token_ids[num_accepted] == target_tokens[num_accepted]:
        num_accepted += 1
    next_token = target_tokens[num_accepted]
    return VerificationResult(
        num_drafted=k,
        num_accepted=num_accepted,
        next_token_id=next_token,
        token_ids=tuple(draft_token_ids[:num_accepted]) + (next_token,),
    )
