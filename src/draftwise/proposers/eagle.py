"""EAGLE proposer: feature-level drafting with a one-layer head, as a dynamic draft tree (EAGLE-2).

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(https://arxiv.org/abs/2401.15077) and "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees" (https://arxiv.org/abs/2406.16858).

State: the head's own KV cache holds one entry per committed target position j, computed from the target's
true feature f_j and the committed token x_{j+1} (:meth:`EagleProposer.observe`); the head's output at the
last entry is the predicted feature of the last committed token's position, whose LM-head logits give the
depth-1 candidates. Drafting deeper feeds (predicted feature, candidate token) pairs, one head pass per depth
over the ``tree_width`` best frontier nodes (by cumulative draft log-probability, EAGLE-2's expansion), each
attending to the committed entries and its own ancestors. The best ``tree_budget`` nodes form the tree (a
child never scores above its parent, so the selection keeps every node's ancestors). The draft entries are
dropped from the head's cache afterwards; the next ``observe`` re-feeds the accepted positions with the
target's true features. Drafts are deterministic (top-k), so verification is lossless at any temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.config import SamplingParams
from draftwise.heads.eagle import EagleHead, HeadCache
from draftwise.proposers.base import DraftProposal, SequenceProposer
from draftwise.sampling import Sampler
from draftwise.tree import DraftNode, best_frontier, select_tree

__all__ = ["EagleProposer"]


@dataclass
class _Node(DraftNode):
    """A tree node with the head's predicted feature at its position once expanded (``[H]``); ``entry`` is its
    head-cache index."""

    feature: torch.Tensor | None = None


class EagleProposer(SequenceProposer):
    """Drafts from an :class:`EagleHead`.

    Args:
        head: the trained head (on the target's device and dtype).
        embed: the target's input embedding (``[n] -> [n, H]``), shared.
        lm_head: the target's LM head (``[..., H] -> [..., vocab]``), shared.
        tree_width: candidates per expanded node and nodes expanded per depth; 1 drafts a chain.
        tree_budget: at most this many nodes per draft (None: ``K * tree_width``).

    Raises:
        ValueError: ``tree_width`` or ``tree_budget`` < 1.
    """

    name = "eagle"
    needs_target_hidden = True

    def __init__(self, head: EagleHead, embed: torch.nn.Module, lm_head: torch.nn.Module, tree_width: int = 1,
                 tree_budget: int | None = None) -> None:
        if tree_width < 1 or (tree_budget is not None and tree_budget < 1):
            raise ValueError("tree_width and tree_budget must be >= 1")
        self.head = head.eval()
        self.embed = embed
        self.lm_head = lm_head
        self.tree_width = tree_width
        self.tree_budget = tree_budget
        self._cache = HeadCache()
        self._root_feature: torch.Tensor | None = None  # [H]

    def start(self, prompt_ids: Sequence[int], *, scope: str = "") -> None:
        self._cache = HeadCache()
        self._root_feature = None

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        param = next(self.head.parameters())
        hidden = hidden.to(param.device, param.dtype)  # [m, H]
        start = len(self._cache)
        positions = torch.arange(start, start + hidden.shape[0], device=param.device)
        embeds = self._embed(next_token_ids)
        self._root_feature = self.head(hidden, embeds, positions, self._cache)[-1]

    @torch.inference_mode()
    def propose(self, context_ids: Sequence[int], k: int, params: SamplingParams, sampler: Sampler) -> DraftProposal:
        """A draft tree of depth at most ``k``; an empty draft before the first observe."""
        if self._root_feature is None or k < 1:
            return DraftProposal(token_ids=())
        committed = len(self._cache)
        try:
            nodes = self._children(self._root_feature[None], [None])
            frontier = list(range(len(nodes)))
            for _ in range(2, k + 1):
                expand = best_frontier(nodes, frontier, self.tree_width)
                self._expand(nodes, expand, committed)
                children = self._children(torch.stack([nodes[i].feature for i in expand]), [(i, nodes[i]) for i in expand])
                frontier = list(range(len(nodes), len(nodes) + len(children)))
                nodes.extend(children)
        finally:
            self._cache.crop(committed)
        return self._select(nodes, self.tree_budget or k * self.tree_width)

    def _embed(self, token_ids: Sequence[int]) -> torch.Tensor:
        param = next(self.head.parameters())
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=param.device)
        return self.embed(ids).to(param.dtype)  # [m, H]

    def _children(self, features: torch.Tensor, parents: list[tuple[int, _Node] | None]) -> list[_Node]:
        """Top-``tree_width`` candidates after each of m nodes, from their predicted ``features`` ([m, H]) in one
        LM-head pass; ``parents[j]`` is ``(index, node)`` of row j's node, or None for the root."""
        logprobs = torch.log_softmax(self.lm_head(features).float(), dim=-1)  # [m, vocab]
        top = torch.topk(logprobs, self.tree_width, dim=-1)
        children = []
        for parent, values, tokens in zip(parents, top.values.tolist(), top.indices.tolist()):
            index, depth, score = (-1, 1, 0.0) if parent is None else (parent[0], parent[1].depth + 1, parent[1].score)
            children.extend(_Node(t, index, depth, score + lp) for lp, t in zip(values, tokens))
        return children

    def _expand(self, nodes: list[_Node], expand: list[int], committed: int) -> None:
        """One head pass over the (parent feature, token) pairs of ``expand``; fills their slot and feature."""
        root = self._root_feature
        features = torch.stack([root if nodes[i].parent < 0 else nodes[nodes[i].parent].feature for i in expand])
        embeds = self._embed([nodes[i].token for i in expand])
        positions = torch.tensor([committed - 1 + nodes[i].depth for i in expand], device=features.device)
        past, n = len(self._cache), len(expand)
        mask = torch.zeros(n, past + n, dtype=torch.bool, device=features.device)
        mask[:, :committed] = True
        for row, i in enumerate(expand):
            mask[row, past + row] = True
            ancestor = nodes[i].parent
            while ancestor >= 0:
                mask[row, nodes[ancestor].entry] = True
                ancestor = nodes[ancestor].parent
        out = self.head(features, embeds, positions, self._cache, mask)  # [n, H]
        for row, i in enumerate(expand):
            nodes[i].entry, nodes[i].feature = past + row, out[row]

    @staticmethod
    def _select(nodes: list[_Node], budget: int) -> DraftProposal:
        """The ``budget`` best nodes (ancestor-closed), renumbered in topological order."""
        tokens, parents = select_tree(nodes, budget)
        return DraftProposal(token_ids=tokens, parents=parents)  # a chain-shaped tree is a chain
