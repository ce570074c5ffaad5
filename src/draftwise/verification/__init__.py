"""Verification: decide which draft tokens the target accepts, separately from proposing them.

One verifier per rule, each written once over a draft tree (a chain is a tree whose nodes have one child):
greedy (:mod:`.greedy`), coupled Gumbel-max (:mod:`.coupled`) and rejection sampling (:mod:`.rejection`).
:func:`verify` picks the request's rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.sampling import Sampler
from draftwise.tree import node_depths
from draftwise.verification.coupled import verify_coupled
from draftwise.verification.greedy import verify_greedy
from draftwise.verification.rejection import verify_rejection
from draftwise.verification.types import VerificationResult

__all__ = ["VerificationResult", "verify", "verify_greedy", "verify_coupled", "verify_rejection"]


def verify(
    token_ids: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampler: Sampler,
    position: int,
) -> VerificationResult:
    """Verify a draft with the request's rule: greedy, coupled or rejection.

    Args:
        token_ids: ``[n]`` draft node tokens (n >= 0).
        parents: ``[n]`` parent indices (-1 = root), topological order; a chain is ``(-1, 0, ..., n-2)``.
        draft_probs: ``[n, vocab]`` distributions the nodes were drawn from, or None (deterministic draft);
            used by rejection sampling only.
        target_logits: ``[n + 1, vocab]`` raw target logits; row 0 follows the root, row i + 1 follows node i.
        sampler: the request's sampler (rule, generator, Gumbel noise).
        position: sequence position of the token row 0 chooses (``len(context)``); a depth-d node's row
            chooses the token at ``position + d``.

    Raises:
        ValueError: inconsistent shapes or parents.
    """
    params = sampler.params
    if params.greedy:
        return verify_greedy(token_ids, parents, target_logits)
    if sampler.coupled:
        depth = max(node_depths(parents), default=0)
        noise = sampler.noise(range(position, position + depth + 1), target_logits.shape[1])  # [depth + 1, vocab]
        return verify_coupled(token_ids, parents, target_logits, params, noise)
    return verify_rejection(token_ids, parents, draft_probs, target_logits, params, sampler.generator)
