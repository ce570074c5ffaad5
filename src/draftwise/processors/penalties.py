"""Presence, frequency and repetition penalties as one position-aware logits processor.

Definitions (vLLM's ``apply_penalties``, ``vllm/model_executor/layers/utils.py``, in its order):

- repetition penalty ``r`` (CTRL, Keskar et al. 2019; transformers' ``RepetitionPenaltyLogitsProcessor``): for
  every token seen in the prompt or the output, ``logit / r`` if ``logit > 0`` else ``logit * r``;
- then frequency ``f`` and presence ``a`` (OpenAI's definition, over the output only):
  ``logit -= f * count + a * (count > 0)``.

Under speculation row i counts the committed output plus ``paths[i]`` (the draft tokens before it), so a
verification row at draft depth i penalizes exactly what plain decoding would after those tokens; only
:meth:`PenaltyProcessor.accept` moves the counts, so a rejected draft leaves no trace. A step touches only the
columns of tokens seen so far (prompt, output and the paths' tokens): ``[n_rows, seen]`` gathers and scatters,
never a dense ``[n_rows, vocab]`` count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from draftwise.processors.base import LogitsProcessor, Path, check_rows

__all__ = ["PenaltyProcessor"]


class PenaltyProcessor(LogitsProcessor):
    """One request's penalties (see the module docstring); nothing is refused.

    Args:
        presence_penalty: ``a``, subtracted once from every token in the output (0: off).
        frequency_penalty: ``f``, subtracted per occurrence in the output (0: off).
        repetition_penalty: ``r > 0`` over the prompt and the output (1: off).
        prompt_ids: the request's prompt (read by the repetition penalty only).

    Raises:
        ValueError: ``repetition_penalty <= 0``.

    Attributes:
        num_committed: output tokens committed through :meth:`accept`.
    """

    def __init__(self, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, prompt_ids: Iterable[int] = ()) -> None:
        if not repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.repetition_penalty = float(repetition_penalty)
        self.num_committed = 0
        self._seen = _SeenTokens()
        if self.repetition_penalty != 1.0:
            self._seen.add_prompt(prompt_ids)

    def apply(self, logits: torch.Tensor, paths: Sequence[Path]) -> None:
        """Penalize each row's seen tokens in place (committed output plus ``paths[i]``, and the prompt for the
        repetition penalty). See :meth:`LogitsProcessor.apply`.

        Raises:
            ValueError: if ``logits`` is not ``[len(paths), vocab]``.
        """
        check_rows(logits, paths)
        columns, counts, in_prompt = self._seen.rows(paths, logits.device)
        if columns.numel() == 0:
            return
        values = logits[:, columns]  # [n_rows, seen]
        if self.repetition_penalty != 1.0:
            seen = in_prompt | (counts > 0)  # [n_rows, seen]
            penalized = torch.where(values > 0, values / self.repetition_penalty, values * self.repetition_penalty)
            values = torch.where(seen, penalized, values)
        if self.frequency_penalty:
            values = values - self.frequency_penalty * counts
        if self.presence_penalty:
            values = values - self.presence_penalty * (counts > 0).float()
        logits[:, columns] = values

    def accept(self, tokens: Sequence[int]) -> None:
        """Count committed output ``tokens``."""
        self._seen.add_output(tokens)
        self.num_committed += len(tokens)


class _SeenTokens:
    """The tokens a request has seen, one column each in order of first appearance: ``tokens[c]`` its id,
    ``output_counts[c]`` its occurrences in the committed output, ``in_prompt[c]`` whether the prompt holds it
    (numpy arrays grown by doubling; ``column`` maps an id to its column)."""

    def __init__(self) -> None:
        self.column: dict[int, int] = {}
        self.size = 0
        self.tokens = np.zeros(64, dtype=np.int64)
        self.output_counts = np.zeros(64, dtype=np.float32)
        self.in_prompt = np.zeros(64, dtype=np.bool_)

    def add_prompt(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            column = self._column_of(int(token))  # first: it may grow the arrays
            self.in_prompt[column] = True

    def add_output(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            column = self._column_of(int(token))  # first: it may grow the arrays
            self.output_counts[column] += 1.0

    def rows(self, paths: Sequence[Path], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The columns seen by any row and, per row, the output counts with its path and the prompt flags.

        Returns:
            ``(columns [seen] int64, counts [n_rows, seen] float32, in_prompt [1, seen] bool)`` on ``device``:
            the committed tokens' columns first, then the paths' new tokens; ``counts[i]`` is the committed
            output's counts plus ``paths[i]``'s.
        """
        extra: dict[int, int] = {}
        path_rows: list[int] = []
        path_columns: list[int] = []
        for row, path in enumerate(paths):
            for token in path:
                column = self.column.get(int(token))
                if column is None:
                    column = extra.setdefault(int(token), self.size + len(extra))
                path_rows.append(row)
                path_columns.append(column)
        size = self.size + len(extra)
        columns = torch.from_numpy(np.concatenate([self.tokens[: self.size],
                                                   np.fromiter(extra, dtype=np.int64, count=len(extra))]))
        counts = torch.zeros(len(paths), size, dtype=torch.float32)  # [n_rows, seen]
        counts[:, : self.size] = torch.from_numpy(self.output_counts[: self.size])
        if path_rows:
            counts.index_put_((torch.tensor(path_rows), torch.tensor(path_columns)), torch.ones(len(path_rows)),
                              accumulate=True)
        in_prompt = torch.zeros(1, size, dtype=torch.bool)
        in_prompt[0, : self.size] = torch.from_numpy(self.in_prompt[: self.size])
        return columns.to(device), counts.to(device), in_prompt.to(device)

    def _column_of(self, token: int) -> int:
        column = self.column.get(token)
        if column is None:
            column = self.column[token] = self.size
            if self.size == len(self.tokens):
                self._grow()
            self.tokens[column] = token
            self.size += 1
        return column

    def _grow(self) -> None:
        arrays = (self.tokens, self.output_counts, self.in_prompt)
        self.tokens, self.output_counts, self.in_prompt = (np.concatenate([a, np.zeros_like(a)]) for a in arrays)
