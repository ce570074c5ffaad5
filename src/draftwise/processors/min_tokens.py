"""vLLM's ``min_tokens`` as a logits processor: the stop tokens are forbidden until the output holds
``min_tokens`` tokens.

Row i of a step is at output position ``committed + len(paths[i])``, so under speculation a row deep in a draft
may allow the stop tokens that the first row forbids. The processor refuses tokens, so it cuts drafts
(:meth:`MinTokensProcessor.valid_prefix`: a stop token drafted too early), as a grammar does. A row where the
stop tokens are the only tokens still allowed (a grammar that must end) keeps them: no row is ever left without
an allowed token, and the output then ends before ``min_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from draftwise.processors.base import LogitsProcessor, Path, check_rows

__all__ = ["MinTokensProcessor"]


class MinTokensProcessor(LogitsProcessor):
    """Forbids ``stop_token_ids`` at output positions below ``min_tokens`` (see the module docstring).

    Args:
        min_tokens: output tokens before a stop token is allowed (>= 1).
        stop_token_ids: the request's stop tokens (its ``stop_token_ids`` and the EOS ids unless ``ignore_eos``),
            at least one.

    Raises:
        ValueError: ``min_tokens < 1`` or no stop token.

    Attributes:
        num_committed: output tokens committed through :meth:`accept`.
    """

    def __init__(self, min_tokens: int, stop_token_ids: Iterable[int]) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1 for a processor, got {min_tokens}")
        self.min_tokens = int(min_tokens)
        self.stop_token_ids = frozenset(int(token) for token in stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("min_tokens needs at least one stop token to forbid")
        self._stops = torch.tensor(sorted(self.stop_token_ids), dtype=torch.int64)  # [s]
        self.num_committed = 0

    def apply(self, logits: torch.Tensor, paths: Sequence[Path]) -> None:
        """Set the stop tokens' logits to -inf in each row still short of ``min_tokens`` output tokens (a row
        whose path holds a forbidden stop token is the row of the path's admitted prefix), unless nothing else
        is allowed there. See :meth:`LogitsProcessor.apply`.

        Raises:
            ValueError: if ``logits`` is not ``[len(paths), vocab]`` or is narrower than a stop token id.
        """
        check_rows(logits, paths)
        if self.num_committed >= self.min_tokens:
            return
        if logits.shape[1] <= int(self._stops[-1]):
            raise ValueError(f"logits have {logits.shape[1]} columns; stop token {int(self._stops[-1])} is past them")
        rows = [row for row, path in enumerate(paths)
                if self.num_committed + self.valid_prefix(path) < self.min_tokens]
        if not rows:
            return
        if self._stops.device != logits.device:
            self._stops = self._stops.to(logits.device)
        index = torch.tensor(rows, device=logits.device)[:, None]  # [r, 1]
        kept = logits[index, self._stops]  # [r, s]
        logits[index, self._stops] = float("-inf")
        nothing_left = torch.isneginf(logits.amax(dim=-1))[index[:, 0]]  # [r]
        if bool(nothing_left.any()):
            logits[index[nothing_left], self._stops] = kept[nothing_left]

    def accept(self, tokens: Sequence[int]) -> None:
        """Count committed output ``tokens`` (never stop tokens: a stop ends the request uncommitted)."""
        self.num_committed += len(tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """The leading ``tokens`` up to the first stop token at an output position below ``min_tokens``."""
        for index, token in enumerate(tokens):
            if self.num_committed + index >= self.min_tokens:
                break
            if int(token) in self.stop_token_ids:
                return index
        return len(tokens)
