"""Per-request logits processors for speculative decoding: the contract and the chain.

A processor constrains or reshapes the target's (and a proposer's) next-token logits for one request. Under
speculation one forward pass scores several positions at once, so a processor is *position-aware*: row i of
the logits is processed as if the tokens committed so far plus ``paths[i]`` (the draft tokens between the
committed state and that row) had been emitted. Only committed tokens move a processor's state
(:meth:`LogitsProcessor.accept`); speculative rows never do, so rolling a rejected draft back with the KV cache
costs nothing here.

This follows vLLM v1's structured-output manager (``vllm/v1/structured_output/``: one bitmask row per draft
position, the matcher advanced along the draft and rolled back after filling them), generalised to trees
(each node's ancestor path) and to processors that are not grammars (penalties, ``logit_bias``,
``min_tokens``: a processor needing token counts takes them from the committed tokens plus the row's path).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

__all__ = ["LogitsProcessor", "ProcessorChain", "RefusedTokenError", "Path"]

#: The draft token ids between the committed state and one logits row (``()`` for the first row).
Path = Sequence[int]


class RefusedTokenError(RuntimeError):
    """A committed token was refused by a processor: the engine committed a token that the processor's mask
    forbade (an engine bug, never a user error)."""


class LogitsProcessor(ABC):
    """One request's processor of next-token logits (see the module docstring for the position model).

    Subclasses implement :meth:`apply` and :meth:`accept`; a processor that forbids tokens (a grammar,
    ``min_tokens``) also overrides :meth:`valid_prefix`, and a grammar may offer :meth:`forced_tokens` and
    :meth:`jump_forward_tokens`.
    """

    @abstractmethod
    def apply(self, logits: torch.Tensor, paths: Sequence[Path]) -> None:
        """Process ``logits`` in place.

        Args:
            logits: ``[n_rows, vocab]`` float32; row i is the next-token distribution after the committed tokens
                plus ``paths[i]``. ``vocab`` may exceed the tokenizer's vocabulary (padded ids).
            paths: ``n_rows`` token-id sequences. For a chain of drafts ``d``: ``paths[i] = d[:i]``; for a tree:
                each node's ancestor path (given in DFS order, consecutive paths share long prefixes).

        A row whose path goes through a token this processor refuses is processed as the row of the longest
        admitted prefix of its path (such a row is never reached: its refused ancestor is always rejected);
        no row is left without an allowed token.

        Raises:
            ValueError: if ``logits`` is not 2-D with ``len(paths)`` rows, or is narrower than the vocabulary.
        """

    @abstractmethod
    def accept(self, tokens: Sequence[int]) -> None:
        """Advance the state by committed ``tokens`` (the only way the state moves).

        Raises:
            RefusedTokenError: if a token is not admitted in the current state.
        """

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` (a draft after the committed state) this processor admits, 0..len(tokens).
        Does not change the state. Default: all of them (a processor that only reshapes logits)."""
        return len(tokens)

    def forced_tokens(self, max_n: int) -> list[int]:
        """Up to ``max_n`` tokens that are each the *only* admitted token at their position after the committed
        state (jump-forward): a draft that the masked target accepts with probability 1. Default: none."""
        return []

    def jump_forward_tokens(self, max_n: int) -> list[int]:
        """Up to ``max_n`` tokens spelling text that is the only admitted continuation, in the vocabulary's
        longest-match tokenization: a draft the target usually (not always) accepts, since other spellings of
        the same text stay allowed. Every token is admitted (``valid_prefix`` of it is its length).
        Default: :meth:`forced_tokens`."""
        return self.forced_tokens(max_n)

    @property
    def is_finished(self) -> bool:
        """True when nothing but stop tokens may follow the committed tokens. Default: never."""
        return False


class ProcessorChain(LogitsProcessor):
    """A request's processors, applied in order to the same rows (an empty chain changes nothing).

    The chain is itself a :class:`LogitsProcessor`: :meth:`valid_prefix` is the shortest prefix any processor
    admits, :meth:`forced_tokens` / :meth:`jump_forward_tokens` the first processor's offer cut to what every
    processor admits, and the chain is finished when any processor is.
    """

    def __init__(self, processors: Sequence[LogitsProcessor] = ()) -> None:
        self.processors: tuple[LogitsProcessor, ...] = tuple(processors)

    def __bool__(self) -> bool:
        return bool(self.processors)

    def __len__(self) -> int:
        return len(self.processors)

    def apply(self, logits: torch.Tensor, paths: Sequence[Path]) -> None:
        """Apply every processor in order (see :meth:`LogitsProcessor.apply`)."""
        check_rows(logits, paths)
        for processor in self.processors:
            processor.apply(logits, paths)

    def accept(self, tokens: Sequence[int]) -> None:
        """Advance every processor by the committed ``tokens``.

        Raises:
            RefusedTokenError: if a processor refuses one of them.
        """
        for processor in self.processors:
            processor.accept(tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """The shortest prefix of ``tokens`` that any processor admits."""
        admitted = len(tokens)
        for processor in self.processors:
            if admitted == 0:
                break
            admitted = min(admitted, processor.valid_prefix(tokens[:admitted]))
        return admitted

    def forced_tokens(self, max_n: int) -> list[int]:
        """The first non-empty :meth:`LogitsProcessor.forced_tokens`, cut to what every processor admits."""
        return self._first_offer(lambda processor: processor.forced_tokens(max_n))

    def jump_forward_tokens(self, max_n: int) -> list[int]:
        """The first non-empty :meth:`LogitsProcessor.jump_forward_tokens`, cut to what every processor admits."""
        return self._first_offer(lambda processor: processor.jump_forward_tokens(max_n))

    @property
    def is_finished(self) -> bool:
        """True when any processor is finished."""
        return any(processor.is_finished for processor in self.processors)

    def _first_offer(self, offer) -> list[int]:
        for processor in self.processors:
            tokens = list(offer(processor))
            if tokens:
                return tokens[: self.valid_prefix(tokens)]
        return []


def check_rows(logits: torch.Tensor, paths: Sequence[Path]) -> None:
    """Check the :meth:`LogitsProcessor.apply` arguments' shapes.

    Raises:
        ValueError: if ``logits`` is not ``[len(paths), vocab]``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(paths):
        raise ValueError(f"logits must be [n_rows, vocab] with one row per path; got {tuple(logits.shape)} "
                         f"for {len(paths)} paths")
