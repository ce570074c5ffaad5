"""A grammar as a position-aware logits processor, over an xgrammar matcher.

One :class:`GrammarProcessor` per request holds one ``xgrammar.GrammarMatcher`` (a pushdown automaton over the
tokenizer's byte strings, with unlimited token rollback). Its state is the committed tokens; :meth:`apply`
walks each row's draft path on top of it (rolling back only to the common prefix of consecutive paths, so a
chain costs one token advance and one mask fill per row, and a DFS-ordered tree one per node), fills one
bitmask row per logits row, and rolls every speculative token back before it returns. This is what vLLM v1's
``StructuredOutputManager.grammar_bitmask`` does for a chain of drafts (``vllm/v1/structured_output/``).

Stop tokens (the request's EOS ids, e.g. Qwen's ``<|im_end|>`` and ``<|endoftext|>``) are the matcher's stop
tokens: allowed exactly where the grammar may end, and the only tokens allowed once it must end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar

from draftwise.processors.base import LogitsProcessor, Path, RefusedTokenError, check_rows

__all__ = ["GrammarProcessor", "apply_bitmask_"]


class GrammarProcessor(LogitsProcessor):
    """One request's grammar state (see the module docstring).

    Args:
        compiled: the grammar compiled for the tokenizer (:meth:`draftwise.structured.grammar.GrammarCompiler.compile`).
        stop_token_ids: ids allowed exactly where the grammar may end (None: the compiled tokenizer's).

    Attributes:
        vocab_size: the tokenizer's vocabulary size (logits columns at or past it are always masked).
        stop_token_ids: the matcher's stop tokens.
        num_committed: tokens committed through :meth:`accept`.
    """

    def __init__(self, compiled: xgrammar.CompiledGrammar, stop_token_ids: Sequence[int] | None = None) -> None:
        stops = None if stop_token_ids is None else [int(token) for token in stop_token_ids]
        self._matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.vocab_size = int(compiled.tokenizer_info.vocab_size)
        self.stop_token_ids: tuple[int, ...] = tuple(self._matcher.stop_token_ids)
        self._bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)  # [rows, ceil(vocab / 32)] int32
        self._speculative: list[int] = []  # draft tokens on the matcher beyond the committed ones
        self.num_committed = 0
        self._finished_at: tuple[int, bool] | None = None  # (num_committed, is_finished) memo

    # -- the LogitsProcessor contract ---------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, paths: Sequence[Path]) -> None:
        """Mask each row to the tokens the grammar admits after the committed tokens plus ``paths[i]`` (ids
        at or past the tokenizer's vocabulary are masked too). See :meth:`LogitsProcessor.apply`.

        Raises:
            ValueError: if ``logits`` is not ``[len(paths), vocab >= tokenizer vocabulary]``.
        """
        check_rows(logits, paths)
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than the grammar's vocabulary "
                             f"({self.vocab_size} tokens)")
        bitmask = self._rows(len(paths))  # [n_rows, ceil(vocab / 32)]
        try:
            for row, path in enumerate(paths):
                self._walk_to(path)
                self._fill(bitmask, row)
        finally:
            self._roll_back_speculation()
        apply_bitmask_(logits, bitmask, self.vocab_size)

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance the grammar by committed ``tokens``.

        Raises:
            RefusedTokenError: if the grammar refuses one (the tokens before it stay accepted).
        """
        self._roll_back_speculation()
        for token in tokens:
            if not self._advance(token):
                raise RefusedTokenError(f"the grammar refused committed token {int(token)} after "
                                        f"{self.num_committed} committed tokens (a token outside the mask was "
                                        "committed: an engine bug)")
            self.num_committed += 1

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar admits after the committed tokens (a stop token counts when
        the grammar may end there, and nothing after it is admitted)."""
        admitted = 0
        for token in tokens:
            if not self._advance(token):
                break
            admitted += 1
        if admitted:
            self._matcher.rollback(admitted)
        return admitted

    def forced_tokens(self, max_n: int) -> list[int]:
        """Up to ``max_n`` tokens, each the only token the grammar admits at its position (stop tokens never
        count: a position where the grammar may end is not forced)."""
        forced: list[int] = []
        bitmask = self._rows(1)
        while len(forced) < max_n and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, 0)
            token = only_allowed(bitmask[0])
            if token is None or token in self.stop_token_ids or not self._matcher.accept_token(token):
                break
            forced.append(token)
        if forced:
            self._matcher.rollback(len(forced))
        return forced

    def jump_forward_tokens(self, max_n: int) -> list[int]:
        """xgrammar's longest-match tokenization of the text the grammar forces next (``find_jump_forward_tokens``),
        up to ``max_n`` tokens, cut to what the grammar admits."""
        if max_n <= 0 or self._matcher.is_terminated():
            return []
        tokens = [int(token) for token in self._matcher.find_jump_forward_tokens()[:max_n]]
        return tokens[: self.valid_prefix(tokens)]

    @property
    def is_finished(self) -> bool:
        """True once a stop token was committed, or when the committed text completes the grammar and only
        stop tokens may follow."""
        if self._finished_at is None or self._finished_at[0] != self.num_committed:
            self._finished_at = (self.num_committed, self._only_stops_allowed())
        return self._finished_at[1]

    # -- internals ----------------------------------------------------------------------------------------

    def _rows(self, n_rows: int) -> torch.Tensor:
        """The scratch bitmask's first ``n_rows`` rows (``[n_rows, ceil(vocab / 32)]`` int32), grown as needed."""
        if self._bitmask.shape[0] < n_rows:
            self._bitmask = xgrammar.allocate_token_bitmask(n_rows, self.vocab_size)
        return self._bitmask[:n_rows]

    def _walk_to(self, path: Path) -> None:
        """Move the matcher to the committed tokens plus the longest admitted prefix of ``path``, rolling back
        only to the common prefix with the speculative tokens already on it."""
        speculative = self._speculative
        common = 0
        limit = min(len(speculative), len(path))
        while common < limit and speculative[common] == path[common]:
            common += 1
        if len(speculative) > common:
            self._matcher.rollback(len(speculative) - common)
            del speculative[common:]
        for token in path[common:]:
            if not self._advance(token):
                break
            speculative.append(int(token))

    def _advance(self, token: int) -> bool:
        """Accept ``token`` on the matcher if the grammar admits it (nothing is admitted after a stop token)."""
        return not self._matcher.is_terminated() and self._matcher.accept_token(int(token))

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Fill ``bitmask[row]`` for the matcher's state; a terminated state (a stop token accepted) allows the
        stop tokens only, so no row is ever empty."""
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for token in self.stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _roll_back_speculation(self) -> None:
        if self._speculative:
            self._matcher.rollback(len(self._speculative))
            self._speculative.clear()

    def _only_stops_allowed(self) -> bool:
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        bitmask = self._rows(1)
        self._matcher.fill_next_token_bitmask(bitmask, 0)
        return set(allowed_ids(bitmask[0]).tolist()) <= set(self.stop_token_ids)


def _bit(index: int) -> int:
    """The int32 value with only bit ``index`` set (bit 31 is the sign bit)."""
    return -(1 << 31) if index == 31 else 1 << index


def allowed_ids(bitmask_row: torch.Tensor) -> torch.Tensor:
    """The token ids a bitmask row (``[ceil(vocab / 32)]`` int32, bit j of word w = token 32 w + j) allows, as
    a sorted int64 tensor."""
    bits = np.unpackbits(bitmask_row.contiguous().numpy().view(np.uint8), bitorder="little")  # [words * 32]
    return torch.from_numpy(np.flatnonzero(bits))


def only_allowed(bitmask_row: torch.Tensor) -> int | None:
    """The one token id a bitmask row allows, or None when it allows none or several."""
    words = torch.nonzero(bitmask_row).flatten()
    if words.numel() != 1:
        return None
    word = int(bitmask_row[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(words[0]) * 32 + word.bit_length() - 1


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Set ``logits[i, t] = -inf`` where bit t of ``bitmask[i]`` is 0, and for every ``t >= vocab_size``.

    On CPU the bits are unpacked with numpy and applied with one ``torch.where`` (about 3x faster than
    xgrammar's CPU kernel on a 152k-token vocabulary); on an accelerator xgrammar's kernel runs there.

    Args:
        logits: ``[n_rows, width >= vocab_size]`` float32, modified in place (CPU or an accelerator).
        bitmask: ``[n_rows, ceil(vocab_size / 32)]`` int32, contiguous, on CPU (bit j of word w: token 32 w + j).
        vocab_size: the tokenizer's vocabulary size (the mask's width in tokens).
    """
    if logits.device.type != "cpu":
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                             vocab_size=vocab_size)
    else:
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [n_rows, words * 32]
        allowed = torch.from_numpy(bits[:, :vocab_size].view(np.bool_))  # [n_rows, vocab_size]
        head = logits[:, :vocab_size]
        torch.where(allowed, head, torch.tensor(float("-inf"), dtype=logits.dtype), out=head)
    if logits.shape[1] > vocab_size:
        logits[:, vocab_size:] = float("-inf")
