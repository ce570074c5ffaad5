"""OpenAI's ``logit_bias`` as a logits processor: a fixed bias added to chosen tokens' logits at every position
(as vLLM's ``LogitBiasLogitsProcessor``). It depends on no token, so every row gets the same bias whatever its
draft path, and committed tokens change nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.processors.base import LogitsProcessor, Path, check_rows

__all__ = ["LogitBiasProcessor"]


class LogitBiasProcessor(LogitsProcessor):
    """Adds ``bias`` to the logit of each ``token_id`` in every row.

    Args:
        bias: ``(token_id, bias)`` pairs with distinct ids (:attr:`draftwise.config.SamplingParams.logit_bias`).
        vocab_size: the width of the target's logits; every id must be below it.

    Raises:
        ValueError: an id outside ``[0, vocab_size)`` or repeated, or no pair at all.
    """

    def __init__(self, bias: Sequence[tuple[int, float]], vocab_size: int) -> None:
        ids = [int(token) for token, _ in bias]
        if not ids:
            raise ValueError("logit_bias needs at least one (token_id, bias) pair")
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias token ids must be distinct")
        bad = [token for token in ids if not 0 <= token < vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self._ids = torch.tensor(ids, dtype=torch.int64)  # [b]
        self._bias = torch.tensor([float(value) for _, value in bias], dtype=torch.float32)  # [b]

    def apply(self, logits: torch.Tensor, paths: Sequence[Path]) -> None:
        """Add the biases to every row in place (see :meth:`LogitsProcessor.apply`).

        Raises:
            ValueError: if ``logits`` is not ``[len(paths), vocab]`` or is narrower than ``vocab_size``.
        """
        check_rows(logits, paths)
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than the vocabulary ({self.vocab_size})")
        if self._ids.device != logits.device:
            self._ids, self._bias = self._ids.to(logits.device), self._bias.to(logits.device)
        logits[:, self._ids] += self._bias.to(logits.dtype)

    def accept(self, tokens: Sequence[int]) -> None:
        """Nothing to advance: the bias is the same at every position."""
