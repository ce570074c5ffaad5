"""Draft trees: several candidate continuations verified in one target pass.

A tree is given as data: ``parents[i]`` is the parent node of node i (``-1`` = the root, i.e. the last
committed token, which the target has not seen yet), with nodes in topological order (``parents[i] < i``).
A chain ``d_1..d_k`` is the tree ``parents = (-1, 0, 1, ..., k-2)``.

The target pass runs over ``[root, node_0, ..., node_{n-1}]`` (``n + 1`` rows). Row r attends to the whole
committed cache and to the rows on its own root-to-node path; its position id is the cache length plus its
depth (root depth 0, children of the root depth 1). Medusa (Cai et al. 2024, "tree attention") and SpecInfer
(Miao et al. 2024, "token tree verification") compile the tree the same way; this module builds the
structures and :class:`TreeTemplate` turns Medusa-style "choices" (paths of top-k ranks) into trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DraftNode", "TreeTemplate", "best_frontier", "chain_parents", "check_parents", "node_depths", "path_to",
           "select_tree", "tree_attention_mask", "tree_position_ids", "children_of"]


def check_parents(parents: Sequence[int]) -> None:
    """Raise ``ValueError`` unless every ``parents[i]`` is in ``[-1, i)`` (topological order)."""
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i} has parent {parent}; parents must be -1 (root) or an earlier node")


def chain_parents(n: int) -> tuple[int, ...]:
    """Parents of a chain of n nodes: ``(-1, 0, 1, ..., n-2)``."""
    return tuple(range(-1, n - 1))


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for children of the root, parent's depth + 1 otherwise."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from depth 1 down to ``node`` (empty for the root, ``node = -1``)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """``{node: [children in index order]}``, the root as ``-1``."""
    children: dict[int, list[int]] = {-1: []}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
        children.setdefault(i, [])
    return children


def tree_attention_mask(parents: Sequence[int], num_cached: int) -> torch.Tensor:
    """Visibility of the tree pass: ``[n + 1, num_cached + n + 1]`` bool, True where row r may attend.

    Row 0 is the root (the last committed token), row i + 1 is node i. Every row sees the ``num_cached``
    committed positions, the root, its ancestors and itself.
    """
    n = len(parents)
    mask = torch.zeros(n + 1, num_cached + n + 1, dtype=torch.bool)
    mask[:, : num_cached + 1] = True  # cache and root
    for i in range(n):
        mask[i + 1, num_cached + 1 + i] = True
        parent = parents[i]
        if parent >= 0:
            mask[i + 1, num_cached + 1 : num_cached + 1 + i] |= mask[parent + 1, num_cached + 1 : num_cached + 1 + i]
    return mask


def tree_position_ids(parents: Sequence[int], num_cached: int) -> torch.Tensor:
    """``[n + 1]`` int64 positions: the root at ``num_cached``, node i at ``num_cached + depth(i)``."""
    return torch.tensor([num_cached] + [num_cached + d for d in node_depths(parents)], dtype=torch.long)


@dataclass
class DraftNode:
    """A node of a draft tree being grown one depth at a time (EAGLE-2's dynamic tree, Li et al. 2024; the
    draft model's and the EAGLE head's trees).

    Attributes:
        token: the node's token id.
        parent: index of its parent in the node list (-1 = the root, the last committed token).
        depth: 1 for the root's children.
        score: cumulative draft log-probability of the root-to-node path (a child never scores above its parent).
        entry: the drafter's cache entry of this node once it has been fed (expanded), -1 before.
    """

    token: int
    parent: int
    depth: int
    score: float
    entry: int = -1


def best_frontier(nodes: Sequence[DraftNode], frontier: Sequence[int], width: int) -> list[int]:
    """The ``width`` best nodes of ``frontier`` (indexes into ``nodes``) by score, in frontier order within
    ties: the nodes EAGLE-2 expands at the next depth."""
    return sorted(sorted(frontier, key=lambda i: (-nodes[i].score, i))[:width])


def select_tree(nodes: Sequence[DraftNode], budget: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``budget`` best nodes (EAGLE-2's re-ranking by score; ancestor-closed), renumbered in topological
    order. ``nodes`` must be in creation order (parents before children).

    Returns:
        ``(token_ids [m], parents [m])`` with m <= budget (a chain-shaped result is a chain).
    """
    ranked = set(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:budget])
    for i in list(ranked):  # closure guard: a child never outranks its parent, so this adds nothing
        while nodes[i].parent >= 0 and nodes[i].parent not in ranked:
            i = nodes[i].parent
            ranked.add(i)
    keep = sorted(ranked)  # creation order is topological
    index = {old: new for new, old in enumerate(keep)}
    tokens = tuple(nodes[i].token for i in keep)
    parents = tuple(-1 if nodes[i].parent < 0 else index[nodes[i].parent] for i in keep)
    return tokens, parents


@dataclass(frozen=True)
class TreeTemplate:
    """A static tree shape as Medusa's "choices": each path is a tuple of top-k ranks, one per depth.

    ``(0,)`` is the most likely token at depth 1, ``(1,)`` the second, ``(0, 0)`` the most likely token at
    depth 2 below ``(0,)``, and so on. Every prefix of a path must itself be a path.

    Attributes:
        paths: the paths, sorted by (depth, ranks) so parents come first.
    """

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        paths = tuple(sorted({tuple(int(r) for r in p) for p in self.paths}, key=lambda p: (len(p), p)))
        if not paths:
            raise ValueError("a tree template needs at least one path")
        known = set()
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"tree path {path!r}: ranks must be non-negative and the path non-empty")
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"tree path {path!r}: its prefix {path[:-1]!r} is not in the tree")
            known.add(path)
        object.__setattr__(self, "paths", paths)

    @classmethod
    def chain(cls, depth: int) -> "TreeTemplate":
        """A single path of ``depth`` top-1 tokens."""
        if depth < 1:
            raise ValueError("depth must be >= 1")
        return cls(tuple((0,) * d for d in range(1, depth + 1)))

    @classmethod
    def full(cls, depth: int, width: int, budget: int | None = None) -> "TreeTemplate":
        """Top-``width`` at depth 1, then the top-1 chain below each, plus top-``width`` below the top-1 path,
        cut to ``budget`` nodes in order of (depth, ranks): a small Medusa-like default."""
        if depth < 1 or width < 1:
            raise ValueError("depth and width must be >= 1")
        paths = []
        for d in range(1, depth + 1):
            for rank in range(width):
                paths.append((0,) * (d - 1) + (rank,))
            for first in range(1, width):
                if d >= 2:
                    paths.append((first,) + (0,) * (d - 1))
        template = cls(tuple(paths))
        if budget is not None:
            template = cls(template.paths[:budget])
        return template

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def parents(self) -> tuple[int, ...]:
        """Parent index of each path's node (``-1`` for depth-1 nodes)."""
        index = {p: i for i, p in enumerate(self.paths)}
        return tuple(-1 if len(p) == 1 else index[p[:-1]] for p in self.paths)

    def max_rank(self, depth: int) -> int:
        """Largest rank used at ``depth`` (1-based), + 1: how many top-k candidates that depth needs."""
        return 1 + max((p[depth - 1] for p in self.paths if len(p) >= depth), default=-1)

    def truncate(self, depth: int) -> "TreeTemplate":
        """The paths no deeper than ``depth``."""
        return TreeTemplate(tuple(p for p in self.paths if len(p) <= depth))
