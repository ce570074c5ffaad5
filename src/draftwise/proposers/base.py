"""The proposer interface.

A proposer sees the committed token sequence (prompt + generated) and offers up to k draft tokens, with
their draft distributions ``draft_probs`` when it samples them from a distribution (a draft model at
temperature > 0 under rejection sampling) or ``None`` when the draft is deterministic (greedy draft model,
n-gram lookup, heads, or a draft chosen with the request's Gumbel noise under coupled sampling). A
deterministic draft is verified as a one-hot ``draft_probs``, which keeps speculative sampling lossless.

Proposers keep whatever state they need (a draft model's KV cache, an n-gram index) and reconcile it with
the committed sequence they are given at each call, so the engine never tells them what was rejected: the
next ``propose`` call simply sees a context that ends differently (rollback by longest common prefix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from draftwise.config import SamplingParams
from draftwise.sampling import Sampler
from draftwise.tree import chain_parents, check_parents, node_depths

__all__ = ["DraftProposal", "Proposer", "common_prefix_length"]


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens offered for one verification pass.

    Attributes:
        token_ids: ``[k]`` draft token ids, k >= 0 (a tree's nodes, in topological order).
        draft_probs: ``[k, vocab]`` float32 distributions the tokens were sampled from (vocab = the target's
            logits width), or None for a deterministic draft. Trees must be deterministic.
        parents: None for a chain; for a draft tree, ``[k]`` parent node indices (-1 = the last committed
            token), see :mod:`draftwise.tree`. A chain-shaped ``parents`` (each node the child of the one
            before) is stored as None: a chain is the tree whose nodes each have one child.
        hybrid_side: the side of the hybrid proposer that made it (``"suffix"``, also for its empty draft, or
            ``"draft_model"``); the engine counts the request's passes by it
            (:meth:`~draftwise.stats.SpeculativeStats.record_hybrid_step`). "" from every other proposer.
    """

    token_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None = None
    parents: tuple[int, ...] | None = None
    hybrid_side: str = ""

    def __post_init__(self) -> None:
        if self.parents is not None and tuple(self.parents) == chain_parents(len(self.token_ids)):
            object.__setattr__(self, "parents", None)
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.token_ids)} draft tokens"
            )
        if self.parents is not None:
            if len(self.parents) != len(self.token_ids):
                raise ValueError(f"{len(self.parents)} parents for {len(self.token_ids)} tree nodes")
            check_parents(self.parents)
            if self.draft_probs is not None:
                raise ValueError("draft trees must be deterministic (draft_probs None)")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def node_parents(self) -> tuple[int, ...]:
        """Parent of every node, for a chain too (``(-1, 0, ..., k-2)``): what the verifiers take."""
        return self.parents if self.parents is not None else chain_parents(len(self.token_ids))

    @property
    def depth(self) -> int:
        """Longest root-to-node path: the most draft tokens one verification can accept."""
        return max(node_depths(self.parents), default=0) if self.parents is not None else len(self.token_ids)

    def truncated(self, num_nodes: int) -> "DraftProposal":
        """The first ``num_nodes`` tokens / tree nodes (a prefix of a topological order is a tree)."""
        if num_nodes >= len(self.token_ids):
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:num_nodes]
        parents = None if self.parents is None else self.parents[:num_nodes]
        return DraftProposal(self.token_ids[:num_nodes], probs, parents, self.hybrid_side)


class Proposer(ABC):
    """Interface every proposer implements."""

    name: str = "proposer"
    #: True for proposers that read the target's own features (Medusa, EAGLE): the engine then asks the
    #: target for hidden states and calls :meth:`observe` after the prefill and after every verification.
    needs_target_hidden: bool = False
    #: True for proposers that weigh their draft against the step's measured costs (the hybrid): the engine
    #: then measures its pass costs at start and calls :meth:`propose` with ``pricing=``, its
    #: :class:`draftwise.engine.proposers.StepPricing` for the step (None before any measurement).
    wants_pricing: bool = False

    def start(self, prompt_ids: Sequence[int], *, scope: str = "") -> None:
        """Begin a new request whose prompt is ``prompt_ids`` (reset per-request state). Default: nothing.

        ``scope`` names who sent the request (the server passes the API key's or ``user``'s scope): a proposer
        that learns from earlier requests (suffix decoding) uses only the earlier requests of the same scope.
        """

    def finish(self) -> None:
        """The request that :meth:`start` began has ended: the engine calls it when the sequence leaves the
        batch. Default: nothing."""

    def export_state(self) -> Any:
        """State worth keeping for a later request that shares a prefix with this one (a draft model's KV
        cache), for the engine's prefix cache (:mod:`draftwise.prefix_cache`); an ``nbytes`` attribute, when
        present, counts against its memory budget. Default: None (stateless)."""
        return None

    def import_state(self, state: Any) -> None:
        """Adopt a state from :meth:`export_state` (same scope, same engine), or start empty when ``state`` is
        None. Called by the engine before a request's first :meth:`propose`. Default: nothing."""

    def observe(self, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        """Target features of the positions just added to the target's KV cache (``needs_target_hidden``).

        Args:
            hidden: ``[m, H]`` the target's last hidden states (after the final norm) at those positions,
                in order: all prompt positions after the prefill; the last committed token and the accepted
                draft tokens after a verification.
            next_token_ids: ``[m]`` the committed token that follows each position.
        """

    @abstractmethod
    def propose(
        self,
        context_ids: Sequence[int],
        k: int,
        params: SamplingParams,
        sampler: Sampler,
    ) -> DraftProposal:
        """Offer at most ``k`` (>= 1) draft tokens to follow ``context_ids`` (prompt + committed output).

        May return fewer tokens, including none (the engine then takes a plain decoding step). A proposer
        that samples must draw through ``sampler`` (``sampler.choose(logits, position)``, the draft token at
        sequence position ``len(context_ids) + depth - 1``), so that seeded requests are reproducible and,
        under coupled sampling, its draft shares the target's Gumbel noise.
        """


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists.

    One slice comparison when ``a`` is a prefix of ``b`` (the common case); otherwise a binary search over
    prefix equality (O(n log n) element comparisons, all in C).
    """
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low
