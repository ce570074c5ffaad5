"""N-gram (prompt lookup) proposer: copy what followed the last time the current suffix appeared.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding;
vLLM's ``method: "ngram"`` with ``prompt_lookup_min`` / ``prompt_lookup_max``): no second model. For n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, take the last n tokens of the committed context (prompt
+ generated text) and look for their most recent earlier occurrence; the first n that matches wins, and the
draft is the tokens that followed that occurrence. Edits, quotes and repetitions of given text make these
drafts long and right; elsewhere they are short or absent and the engine takes a plain step.

The copy may run into the suffix itself (an LZ77-style overlapping copy): with ``ext = context + draft``,
``draft[i] = ext[s + n + i]`` where s is the occurrence's start. On periodic text (a line the model repeats)
this predicts the period for the full K tokens instead of stopping at the end of the context.

The draft is deterministic (``draft_probs=None``), so sampling verification treats it as a one-hot draft
distribution and stays lossless.

Index: for each n, a dict from n-gram (tuple) to the start of its latest indexed occurrence, plus, per
start position, the start of the previous occurrence of the same n-gram (a linked list through ``prev``).
Appending a token indexes the n-grams that end at it: O(number of n) dict operations. Rolling back (a new
request, or any context that differs from what was indexed) unlinks the n-grams past the longest common
prefix in reverse order, restoring each key's previous occurrence: O(tokens removed), or rebuilds the kept
prefix when that is shorter. A lookup is one dict
access per n. Checking that the context still extends the indexed tokens is one C-level list comparison
(the same order of cost as the engine building the context list), never a Python loop over the context.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from draftwise.config import SamplingParams
from draftwise.proposers.base import DraftProposal, SequenceProposer, common_prefix_length
from draftwise.sampling import Sampler

__all__ = ["NgramProposer", "NgramIndex"]

logger = logging.getLogger(__name__)


class NgramIndex:
    """Latest-occurrence index of every n-gram (n in ``[min_n, max_n]``) of a growing token list.

    Args:
        min_n, max_n: n-gram lengths indexed, 1 <= min_n <= max_n.

    Raises:
        ValueError: on invalid lengths.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not (1 <= min_n <= max_n):
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._prev: dict[int, list[int]] = {n: [] for n in range(min_n, max_n + 1)}  # start -> previous start or -1

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens and index the n-grams that end at each of them (O(len(token_ids)) per n)."""
        old_len = len(self.tokens)
        self.tokens.extend(int(t) for t in token_ids)
        tokens = self.tokens
        for n in range(self.min_n, self.max_n + 1):
            first, end = max(0, old_len - n + 1), len(tokens) - n + 1  # starts of the new n-grams
            if end <= first:
                continue
            table, prev = self._last[n], self._prev[n]
            for start, key in enumerate(zip(*(tokens[first + i : end + i] for i in range(n))), first):
                prev.append(table.get(key, -1))
                table[key] = start

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (0 <= length), unlinking the n-grams past them.

        Costs O(min(tokens removed, tokens kept)): a large rollback rebuilds the kept part instead.
        """
        length = max(0, length)
        if length >= len(self.tokens):
            return
        if length < len(self.tokens) - length:
            kept = self.tokens[:length]
            self.clear()
            self.extend(kept)
            return
        while len(self.tokens) > length:
            self._unindex_last_token()
            self.tokens.pop()

    def clear(self) -> None:
        """Forget every token."""
        self.tokens = []
        self._last = {n: {} for n in self._last}
        self._prev = {n: [] for n in self._prev}

    def last_occurrence(self, ngram: Sequence[int]) -> int | None:
        """Start position of the latest indexed occurrence of ``ngram`` (its length must be in
        ``[min_n, max_n]``), or None."""
        table = self._last.get(len(ngram))
        if table is None:
            raise ValueError(f"n-gram length {len(ngram)} is outside [{self.min_n}, {self.max_n}]")
        return table.get(tuple(ngram))

    def _unindex_last_token(self) -> None:
        end = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            start = end - n
            key = tuple(self.tokens[start:end])
            previous = self._prev[n].pop()
            if previous < 0:
                del self._last[n][key]
            else:
                self._last[n][key] = previous


class NgramProposer(SequenceProposer):
    """Prompt-lookup proposer over the committed context (see the module docstring).

    Args:
        prompt_lookup_min: shortest suffix n-gram to match (tokens, >= 1).
        prompt_lookup_max: longest suffix n-gram to match (tokens, >= prompt_lookup_min).

    Raises:
        ValueError: on invalid lengths.

    The index is kept across requests and re-synchronised by longest common prefix, so a request that
    shares a prefix with the previous one keeps that part of the index.
    """

    name = "ngram"
    drafts_first = True  # a lookup: the engine sees the tokens offered before it plans K

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4) -> None:
        self.index = NgramIndex(prompt_lookup_min, prompt_lookup_max)
        self.last_match_length = 0  # n of the last successful lookup (0: no match), for diagnostics

    @property
    def prompt_lookup_min(self) -> int:
        return self.index.min_n

    @property
    def prompt_lookup_max(self) -> int:
        return self.index.max_n

    def propose(
        self, context_ids: Sequence[int], k: int, params: SamplingParams, sampler: Sampler
    ) -> DraftProposal:
        context = context_ids if isinstance(context_ids, list) else list(context_ids)
        if k <= 0 or len(context) < 2:
            self.last_match_length = 0
            return DraftProposal(token_ids=())
        self._sync(context)
        return DraftProposal(token_ids=self.lookup(context, k))

    def lookup(self, context: Sequence[int], k: int) -> tuple[int, ...]:
        """Draft up to k tokens after ``context``, whose first ``len(context) - 1`` tokens must be indexed.

        Returns an empty tuple when no suffix n-gram has an earlier occurrence.
        """
        length = len(context)
        for n in range(min(self.index.max_n, length - 1), self.index.min_n - 1, -1):
            start = self.index.last_occurrence(context[length - n :])
            if start is not None:
                self.last_match_length = n
                return _overlapping_copy(context, start + n, k)
        self.last_match_length = 0
        return ()

    def _sync(self, context: list[int]) -> None:
        """Make the index hold exactly ``context[:-1]`` (every n-gram that ends before the last token, so
        each found occurrence starts strictly before the suffix)."""
        target_len = len(context) - 1
        indexed = self.index.tokens
        if len(indexed) <= target_len and context[: len(indexed)] == indexed:
            common = len(indexed)
        else:
            common = common_prefix_length(indexed, context[:target_len])
            logger.debug("ngram index rolled back from %d to %d tokens", len(indexed), common)
            self.index.truncate(common)
        self.index.extend(context[common:target_len])


def _overlapping_copy(context: Sequence[int], source: int, k: int) -> tuple[int, ...]:
    """``k`` tokens copied from ``context + copied`` starting at ``source`` (< len(context)), LZ77-style."""
    length = len(context)
    draft: list[int] = []
    for i in range(k):
        position = source + i
        draft.append(context[position] if position < length else draft[position - length])
    return tuple(draft)
