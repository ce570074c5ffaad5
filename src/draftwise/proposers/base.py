"""The proposer interface.

A proposer sees the committed token sequence (prompt + generated) and offers up to k draft tokens, with
their draft distributions ``draft_probs`` when it samples them from a distribution (a draft model at
temperature > 0) or ``None`` when the draft is deterministic (greedy draft model, n-gram lookup). A
deterministic draft is verified as a one-hot ``draft_probs``, which keeps speculative sampling lossless.

Proposers keep whatever state they need (a draft model's KV cache, an n-gram index) and reconcile it with
the committed sequence they are given at each call, so the engine never tells them what was rejected: the
next ``propose`` call simply sees a context that ends differently (rollback by longest common prefix).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.config import SamplingParams

__all__ = ["DraftProposal", "Proposer", "common_prefix_length"]


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens offered for one verification pass.

    Attributes:
        token_ids: ``[k]`` draft token ids, k >= 0.
        draft_probs: ``[k, vocab]`` float32 distributions the tokens were sampled from (vocab = the target's
            logits width), or None for a deterministic draft.
    """

    token_ids: tuple[int, ...]
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"draft_probs has {self.draft_probs.shape[0]} rows for {len(self.token_ids)} draft tokens"
            )

    def __len__(self) -> int:
        return len(self.token_ids)


class Proposer(ABC):
    """Interface every proposer implements."""

    name: str = "proposer"

    def start(self, prompt_ids: Sequence[int]) -> None:
        """Begin a new request whose prompt is ``prompt_ids`` (reset per-request state). Default: nothing."""

    @abstractmethod
    def propose(
        self,
        context_ids: Sequence[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftProposal:
        """Offer at most ``k`` (>= 1) draft tokens to follow ``context_ids`` (prompt + committed output).

        May return fewer tokens, including none (the engine then takes a plain decoding step). Must use
        ``generator`` for any randomness so that seeded requests are reproducible.
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
