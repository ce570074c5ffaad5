"""Medusa proposer: draft trees from Medusa heads on the target's own last hidden state.

Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"
(https://arxiv.org/abs/2401.10774). After a verification the target's hidden state h_t at the position that
produced the last committed token x_{t+1} is known; head i (0-based) predicts x_{t+2+i}, i.e. draft depth
i + 1. The tree is static data (:class:`draftwise.tree.TreeTemplate`, Medusa's "choices"): the node with path
``(r_1, ..., r_d)`` carries the rank-``r_d`` token of head d - 1. Drafts are deterministic (top-k), so the
engine's verification is lossless at any temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.config import SamplingParams
from draftwise.heads.medusa import MedusaHeads
from draftwise.proposers.base import DraftProposal, SequenceProposer
from draftwise.sampling import Sampler
from draftwise.tree import TreeTemplate

__all__ = ["MedusaProposer"]


class MedusaProposer(SequenceProposer):
    """Drafts from :class:`MedusaHeads`.

    Args:
        heads: trained heads (on the target's device and dtype).
        lm_head: the target's LM head (``[..., H] -> [..., vocab]``), shared and frozen.
        template: the static draft tree; None: a chain (top-1 of every head).
    """

    name = "medusa"
    needs_target_hidden = True

    def __init__(self, heads: MedusaHeads, lm_head: torch.nn.Module, template: TreeTemplate | None = None) -> None:
        self.heads = heads.eval()
        self.lm_head = lm_head
        self.template = template
        self._last_hidden: torch.Tensor | None = None  # [H]

    def start(self, prompt_ids: Sequence[int], *, scope: str = "") -> None:
        self._last_hidden = None

    def observe(self, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> None:
        self._last_hidden = hidden[-1]

    @torch.inference_mode()
    def propose(self, context_ids: Sequence[int], k: int, params: SamplingParams, sampler: Sampler) -> DraftProposal:
        """Up to ``k`` levels of the tree (at most ``num_heads``); an empty draft before the first observe.

        Returns:
            the template's tree (a chain when the template is one: :class:`DraftProposal` stores it as such).
        """
        depth = min(k, self.heads.num_heads)
        if self._last_hidden is None or depth < 1:
            return DraftProposal(token_ids=())
        template = (self.template or TreeTemplate.chain(depth)).truncate(depth)
        depth = template.depth
        param = next(self.heads.parameters())
        hidden = self._last_hidden.to(param.device, param.dtype)[None]  # [1, H]
        features = self.heads(hidden)[:depth, 0]  # [depth, H]
        logits = self.lm_head(features).float()  # [depth, vocab]
        widest = max(template.max_rank(d) for d in range(1, depth + 1))
        top = torch.topk(logits, widest, dim=-1).indices.tolist()  # [depth, widest]
        tokens = tuple(top[len(path) - 1][path[-1]] for path in template.paths)
        return DraftProposal(token_ids=tokens, parents=template.parents)  # a chain-shaped tree is a chain
