"""Draft-model proposer: a second, smaller causal LM with the target's tokenizer proposes K tokens
autoregressively (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

Its KV cache is rolled back to the longest common prefix with the committed context at every call, so
rejected draft tokens are discarded without the engine's help.

Draft tokens are drawn through the request's :class:`~draftwise.sampling.Sampler`: greedy (argmax), rejection
(a draw from the processed draft distribution, returned as ``draft_probs``) or coupled (the Gumbel-argmax with
the target's noise for the same sequence position, so a well-matched draft picks the target's token with high
probability; the draft is then deterministic given the noise and ``draft_probs`` is None).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.backends.base import CausalLM, KVState
from draftwise.config import SamplingParams
from draftwise.proposers.base import DraftProposal, Proposer, common_prefix_length
from draftwise.sampling import Sampler

__all__ = ["DraftModelProposer", "fit_vocab"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DraftState:
    """A draft model's kept state: the tokens its KV cache holds and the exported cache (None when the draft's
    backend cannot export)."""

    tokens: tuple[int, ...]
    kv: KVState | None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0


class DraftModelProposer(Proposer):
    """Proposes tokens with a draft :class:`CausalLM`.

    Args:
        draft: the draft model backend.
        target_vocab_size: the target's logits width. Draft logits are cut or zero-padded to it, so a draft
            whose embedding is padded differently from the target's still yields ``[k, target_vocab]``
            distributions; ids the target cannot produce are never proposed.
    """

    name = "draft_model"

    def __init__(self, draft: CausalLM, target_vocab_size: int) -> None:
        self.draft = draft
        self.target_vocab_size = target_vocab_size
        self._cached: list[int] = []  # tokens in the draft's KV cache, in order

    def start(self, prompt_ids: Sequence[int], *, scope: str = "") -> None:
        """Nothing to reset: the draft's cache is reconciled with the context at every :meth:`propose`, and the
        engine sets it through :meth:`import_state` before a request."""

    def export_state(self) -> _DraftState:
        """The draft's cached tokens and, when its backend can export, its KV cache (shared, not copied)."""
        kv = self.draft.export_cache() if self.draft.supports_cache_export else None
        return _DraftState(tokens=tuple(self._cached), kv=kv)

    def import_state(self, state: _DraftState | None) -> None:
        """Load a kept draft state; None empties the draft's cache.

        A state without KV comes from a draft backend that cannot export its cache (llama.cpp): the draft then
        keeps only the part of its live cache that equals the state's tokens, and the next :meth:`propose`
        prefills the rest of the context (the target's reuse is unaffected). When the live cache no longer
        holds what this proposer fed it (another user of the draft backend changed it), it is emptied and the
        next :meth:`propose` prefills the whole context.
        """
        if state is None:
            self.draft.reset()
            self._cached = []
        elif state.kv is not None:
            self.draft.import_cache(state.kv, len(state.tokens))
            self._cached = list(state.tokens)
        else:
            self._forget_if_changed()
            common = common_prefix_length(self._cached, state.tokens)
            self.draft.rollback(common)
            del self._cached[common:]

    def _forget_if_changed(self) -> None:
        """Empty the draft's cache when it no longer holds as many tokens as this proposer fed it (another user
        of the draft backend, e.g. a calibration, changed it): the next call then prefills the whole context."""
        if self.draft.num_cached != len(self._cached):
            logger.debug("draft cache holds %d tokens, not the %d fed here: starting it afresh",
                         self.draft.num_cached, len(self._cached))
            self.draft.reset()
            self._cached = []

    def propose(
        self, context_ids: Sequence[int], k: int, params: SamplingParams, sampler: Sampler
    ) -> DraftProposal:
        room = self.draft.max_context - len(context_ids)
        k = min(k, room)
        if k <= 0:
            return DraftProposal(token_ids=())
        logits = self._sync_cache(context_ids)  # [vocab_target]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(k):
            token, probs = sampler.choose(logits, len(context_ids) + step)  # the token at that sequence position
            tokens.append(token)
            if probs is not None:
                rows.append(probs)
            if step + 1 < k:
                logits = self._feed([token])
        draft_probs = torch.stack(rows) if rows else None  # [k, vocab]
        return DraftProposal(token_ids=tuple(tokens), draft_probs=draft_probs)

    def _sync_cache(self, context_ids: Sequence[int]) -> torch.Tensor:
        """Roll the draft cache back to the longest common prefix with ``context_ids`` and feed the rest;
        returns the draft's logits ``[vocab]`` for the token after the context."""
        self._forget_if_changed()
        common = common_prefix_length(self._cached, context_ids)
        common = min(common, len(context_ids) - 1)  # at least one token must be fed to get logits
        self.draft.rollback(common)
        del self._cached[common:]
        return self._feed(context_ids[common:])

    def _feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        # An id only the target's (padded) vocabulary has cannot be embedded by the draft: feed id 0 in its
        # place. Draft quality drops at that point; verification keeps the output exact.
        readable = [t if t < self.draft.vocab_size else 0 for t in token_ids]
        out = self.draft.forward(readable, num_logits=1)
        self._cached.extend(token_ids)
        return self._fit_vocab(out.logits[-1])

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.target_vocab_size)


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or pad draft logits ``[..., draft_vocab]`` to ``[..., width]`` (the target's logits width; padding
    gets -inf, so ids the target cannot produce are never proposed)."""
    current = logits.shape[-1]
    if current == width:
        return logits
    if current > width:
        return logits[..., :width]
    pad = torch.full((*logits.shape[:-1], width - current), float("-inf"), dtype=logits.dtype)
    return torch.cat([logits, pad], dim=-1)
