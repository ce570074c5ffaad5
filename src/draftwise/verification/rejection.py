"""Lossless speculative sampling (rejection sampling) for temperature > 0.

Follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding", Algorithm 1)
and Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"): draft token
x at position i is accepted with probability ``min(1, target_probs[i, x] / draft_probs[i, x])``; at the first
rejection the recovered token is sampled from ``normalize(max(0, target_probs[i] - draft_probs[i]))``; if all
k are accepted a bonus token is sampled from ``target_probs[k]``. Every emitted token is then distributed
exactly as the target's own sample. A deterministic draft (``draft_probs`` None) is treated as one-hot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.sampling import sample_from_probs
from draftwise.verification.types import VerificationResult

__all__ = ["verify_sampling", "residual_distribution"]


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(0, target_probs - draft_probs)``, unnormalized (``[vocab]``).

    Falls back to ``target_probs`` when the residual has no mass (possible only through rounding, when the
    two distributions are equal and a rejection therefore has probability ~0).
    """
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    if float(residual.sum()) <= 0.0:
        return target_probs
    return residual


def verify_sampling(
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> VerificationResult:
    """Verify a draft by speculative rejection sampling.

    Args:
        draft_token_ids: ``[k]`` draft tokens (k >= 0).
        draft_probs: ``[k, vocab]`` distributions the draft tokens were sampled from, or None for a
            deterministic (one-hot) draft.
        target_probs: ``[k + 1, vocab]`` target distributions after the same temperature/top-k/top-p
            processing as the draft's.
        generator: the request's CPU random generator (uniform draws and recovered/bonus samples).

    Returns:
        The accepted prefix plus one recovered or bonus token.

    Raises:
        ValueError: if the shapes disagree.
    """
    k = len(draft_token_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k + 1, vocab] = [{k + 1}, vocab], got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [k, vocab] = [{k}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    target_probs = target_probs.float().cpu()
    if draft_probs is not None:
        draft_probs = draft_probs.float().cpu()
    uniforms = torch.rand(k, generator=generator).tolist() if k else []
    for i, token in enumerate(draft_token_ids):
        p = float(target_probs[i, token])
        q = float(draft_probs[i, token]) if draft_probs is not None else 1.0
        if uniforms[i] * q < p:  # u < p / q without dividing by a possibly tiny q
            continue
        if draft_probs is not None:
            residual = residual_distribution(target_probs[i], draft_probs[i])
        else:
            residual = target_probs[i].clone()
            residual[token] = 0.0  # max(0, p - onehot(token))
            if float(residual.sum()) <= 0.0:
                residual = target_probs[i]
        recovered = sample_from_probs(residual, generator)
        return VerificationResult(
            num_drafted=k,
            num_accepted=i, next_token_id=recovered, token_ids=tuple(draft_token_ids[:i]) + (recovered,)
        )
    bonus = sample_from_probs(target_probs[k], generator)
    return VerificationResult(
        num_drafted=k, num_accepted=k, next_token_id=bonus, token_ids=tuple(draft_token_ids) + (bonus,)
    )
