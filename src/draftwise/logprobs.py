"""Log-probabilities of committed tokens (OpenAI's ``logprobs`` / ``top_logprobs``, vLLM's ``prompt_logprobs``).

Definition (the same with speculation on or off):

- **Output tokens**: the logprob of a committed token is ``log_softmax`` of the target's logits row it was chosen
  from, after the request's logits processors (a grammar's mask, penalties: whatever the processor chain applied
  to that row) and, at temperature > 0, after temperature, top-k and top-p
  (:func:`draftwise.sampling.processed_scores`); at temperature 0 (greedy), ``log_softmax`` of the processed
  logits at temperature 1. Under speculation the row is the verification pass's row at the committed position
  (the row of the last committed token, then of each accepted draft node on the accepted path), so on a target
  whose rows do not depend on what shares the pass (row-invariant kernels: the lean runtime, int8, Q4_K) the
  values equal plain decoding's bit for bit at temperature 0. A token chosen by rejection sampling's correction
  (drawn from ``max(0, p - q)``) still reports the target's processed distribution ``p`` at that position.
- **Prompt tokens** (``prompt_logprobs``): ``log_softmax`` of the raw logits of the row before each prompt token
  (no processors, temperature 1, as vLLM's default ``raw_logprobs``); the first prompt token has none.

``top`` holds the ``k`` most likely tokens of the same distribution, best first; tokens the processed distribution
excludes (-inf: masked, or outside top-k / top-p) are left out, so fewer than ``k`` may come back. Each value is
computed one row at a time (``[vocab]``), so it never depends on how many rows a pass carried.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftwise.config import SamplingParams
from draftwise.sampling import processed_scores

__all__ = ["TokenLogprob", "row_logprobs", "token_logprobs", "cumulative_logprob"]


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability (natural log) under the distribution it was chosen from.

    Attributes:
        token_id: the token.
        logprob: its log-probability (-inf only for a prompt token the raw distribution cannot give, never in
            practice; an output token is always inside its distribution).
        rank: 1 + the number of tokens with a strictly higher log-probability (1: the most likely; vLLM's rank).
        top: the ``k`` most likely tokens ``(token_id, logprob)``, best first (see the module docstring).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def row_logprobs(logits: torch.Tensor, params: SamplingParams | None) -> torch.Tensor:
    """The log-distribution of one row: ``logits [vocab]`` (processors already applied) -> ``[vocab]`` float32.

    ``params`` None or greedy: ``log_softmax(logits)`` at temperature 1; otherwise ``log_softmax`` of the scores
    after temperature / top-k / top-p (:func:`~draftwise.sampling.processed_scores`).
    """
    if params is None or params.greedy:
        scores = logits.float()
    else:
        scores = processed_scores(logits.unsqueeze(0), params)[0]  # [vocab]
    return torch.log_softmax(scores, dim=-1)


def _one(logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``token`` in a row's ``logprobs [vocab]``."""
    value = logprobs[token]
    rank = int((logprobs > value).sum()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        best = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))  # sorted, best first
        top = tuple((int(t), float(v)) for t, v in zip(best.indices, best.values) if v > float("-inf"))
    return TokenLogprob(int(token), float(value), rank, top)


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], params: SamplingParams | None,
                   num_top: int) -> list[TokenLogprob]:
    """Each token's :class:`TokenLogprob` under its own row.

    Args:
        logits: ``[n, vocab]``: row i is the (processed) logits token i was chosen from.
        token_ids: ``[n]`` the chosen tokens.
        params: the request's sampling parameters (None: the raw distribution, for prompt tokens).
        num_top: how many most likely alternatives each carries (0..:data:`~draftwise.config.MAX_LOGPROBS`).

    Raises:
        ValueError: as many tokens as rows are needed.
    """
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens for {logits.shape[0]} logits rows")
    with torch.inference_mode():  # a pass's logits are inference tensors
        return [_one(row_logprobs(logits[i], params), int(token), num_top) for i, token in enumerate(token_ids)]


def cumulative_logprob(logprobs: Sequence[TokenLogprob]) -> float:
    """The sum of the tokens' log-probabilities (a choice's score for ``best_of``; 0.0 for none)."""
    return float(sum(entry.logprob for entry in logprobs))
