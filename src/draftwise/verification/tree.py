"""What every verifier shares: input checks and the walk down a draft tree.

A draft is a tree given as data (:mod:`draftwise.tree`): ``token_ids[i]`` is node i's token and
``parents[i]`` its parent (-1 = the root, the last committed token), in topological order. A chain
``d_1..d_k`` is the tree whose nodes each have one child, ``parents = (-1, 0, ..., k-2)``; an empty draft is a
plain decoding step. The target's rows are ``[n + 1, vocab]``: row 0 scores the token after the root, row
i + 1 the token after node i.

Greedy and coupled verification are one walk (:func:`follow_target_choices`): the target makes one choice
per visited node (its argmax, or its Gumbel-argmax); follow the child carrying that token; where no child
does, the choice is the next token. Rejection sampling walks the same way with its own acceptance rule
(:mod:`draftwise.verification.rejection`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from draftwise.tree import check_parents, children_of
from draftwise.verification.types import VerificationResult

__all__ = ["check_draft", "follow_target_choices", "result_for_path"]


def check_draft(token_ids: Sequence[int], parents: Sequence[int], rows: torch.Tensor, name: str = "target rows") -> None:
    """Raise ``ValueError`` unless ``parents`` is a topological tree over the tokens and ``rows`` is
    ``[len(token_ids) + 1, vocab]``."""
    if len(token_ids) != len(parents):
        raise ValueError(f"{len(token_ids)} draft tokens but {len(parents)} parents")
    check_parents(parents)
    if rows.dim() != 2 or rows.shape[0] != len(token_ids) + 1:
        raise ValueError(f"{name} must be [n + 1, vocab] = [{len(token_ids) + 1}, vocab] (root + nodes), "
                         f"got {list(rows.shape)}")


def result_for_path(token_ids: Sequence[int], accepted: Sequence[int], next_token: int, at_leaf: bool) -> VerificationResult:
    """The result for an accepted node path and the token the target chose after it."""
    return VerificationResult(
        accepted_nodes=tuple(accepted),
        next_token_id=int(next_token),
        token_ids=tuple(int(token_ids[c]) for c in accepted) + (int(next_token),),
        bonus=at_leaf,
    )


def follow_target_choices(
    token_ids: Sequence[int], parents: Sequence[int], choose: Callable[[int], int]
) -> VerificationResult:
    """Walk from the root, following at each node the child whose token is the target's choice there.

    Args:
        token_ids: ``[n]`` node tokens.
        parents: ``[n]`` parent indices (-1 = root), topological order (checked by the caller).
        choose: ``row -> token``: the target's choice after row ``row`` (0 = root, ``i + 1`` = node i); called
            once per visited node, so only the rows on the path are ever evaluated.

    Returns:
        The accepted path and the target's choice where it stops (recovered, or bonus at a leaf).
    """
    children = children_of(parents)
    node, accepted = -1, []
    while True:
        choice = choose(node + 1)
        match = next((c for c in children[node] if token_ids[c] == choice), None)
        if match is None:
            return result_for_path(token_ids, accepted, choice, at_leaf=not children[node])
        accepted.append(match)
        node = match
