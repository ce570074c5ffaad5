"""A request's logits processors (a grammar, penalties, ``logit_bias``, ``min_tokens``) inside a speculative step.

The processors act on the target: each verification row is processed with the state after the committed tokens
and the draft tokens before it (:func:`row_paths`: a chain's prefixes, a tree node's ancestor path), so the
target verifies, and samples its correction or bonus token from, exactly the distribution plain decoding under
the same processors would use; the verification rule (greedy, coupled, rejection) is unchanged. Committed tokens
alone advance the processors (the engine calls ``accept`` after each commit), so a rejected draft leaves no
trace, as the KV cache's rollback leaves none.

Drafts are cut where a processor (a grammar, ``min_tokens``) refuses a token (:func:`constrain`), keeping the
first refused token itself: the masked target always rejects it, and for a sampled draft its row is where
rejection sampling draws the correction from ``max(0, p - q)``, which dropping it before the draw would bias. Where the grammar admits exactly
one continuation text (a fixed key, ``{"name": "``), :func:`forced_draft` offers its tokens as a free draft instead
of the proposer's (jump-forward, as SGLang's compressed-FSM decoding; here only a draft: the target verifies it like
any deterministic draft, since the same text may be spelled with other tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from draftwise.processors.base import LogitsProcessor
from draftwise.proposers.base import DraftProposal
from draftwise.stats import SpeculativeStats

__all__ = ["row_paths", "process_rows", "constrain", "forced_draft", "jump_forward_counts"]

Path = tuple[int, ...]


def row_paths(proposal: DraftProposal) -> list[Path]:
    """The draft tokens before each verification row: ``[()]`` for the row after the last committed token, then
    for node i (row i + 1) the tokens on its path, itself included (a chain: ``drafts[:i + 1]``)."""
    paths: list[Path] = [()]
    for token, parent in zip(proposal.token_ids, proposal.node_parents):
        paths.append(paths[parent + 1] + (int(token),))
    return paths


def process_rows(processors: LogitsProcessor | None, logits: torch.Tensor, proposal: DraftProposal) -> float:
    """Apply ``processors`` (None: none) in place to a sequence's verification rows ``logits [1 + len(proposal),
    V]``; returns the seconds it took."""
    if processors is None:
        return 0.0
    t0 = time.perf_counter()
    with torch.inference_mode():  # the pass's logits are inference tensors
        processors.apply(logits, row_paths(proposal))
    return time.perf_counter() - t0


def constrain(processors: LogitsProcessor, proposal: DraftProposal) -> DraftProposal:
    """``proposal`` without the tokens past the first one the processors refuse (that one is kept, see the
    module docstring); for a tree, without the descendants of refused nodes."""
    if not len(proposal):
        return proposal
    if not proposal.is_tree:
        valid = processors.valid_prefix(proposal.token_ids)
        return proposal if valid >= len(proposal) - 1 else proposal.truncated(valid + 1)
    paths = row_paths(proposal)[1:]
    admitted = [processors.valid_prefix(path) == len(path) for path in paths]
    kept: list[int] = []  # old node indices, in topological order
    index: dict[int, int] = {}
    for node, parent in enumerate(proposal.node_parents):
        if parent == -1 or (parent in index and admitted[parent]):
            index[node] = len(kept)
            kept.append(node)
    if len(kept) == len(proposal):
        return proposal
    parents = tuple(-1 if proposal.node_parents[n] == -1 else index[proposal.node_parents[n]] for n in kept)
    return DraftProposal(tuple(proposal.token_ids[n] for n in kept), None, parents, proposal.hybrid_side,
                         proposal.model_drafted, proposal.jump_forward)


def jump_forward_counts(stats: SpeculativeStats, proposal: DraftProposal, num_drafted: int, num_accepted: int,
                        ) -> tuple[int, int]:
    """A verified step's drafted and accepted counts for the proposer's statistics and K policy: a jump-forward
    draft's accepted tokens go to ``stats.num_jump_forward_tokens`` instead, and count as nothing drafted (they
    teach no K policy)."""
    if not proposal.jump_forward:
        return num_drafted, num_accepted
    stats.num_jump_forward_tokens += num_accepted
    return 0, 0


def forced_draft(processors: LogitsProcessor, max_tokens: int) -> DraftProposal | None:
    """The tokens spelling the only continuation text the processors admit (at most ``max_tokens``;
    :meth:`~draftwise.processors.base.LogitsProcessor.jump_forward_tokens`), as a jump-forward draft, or None
    when the next text is not forced."""
    if max_tokens < 1:
        return None
    forced: Sequence[int] = processors.jump_forward_tokens(max_tokens)
    if not forced:
        return None
    return DraftProposal(tuple(int(t) for t in forced), model_drafted=False, jump_forward=True)
