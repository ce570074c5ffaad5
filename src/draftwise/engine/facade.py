"""The library's one-request interface: :class:`SpeculativeEngine`, a thin facade over the engine core.

``stream`` adds the request to an :class:`~draftwise.engine.core.EngineCore` (by default over the target as one
slot, :func:`one_slot_core`; or any core, :meth:`SpeculativeEngine.over`) and steps the core until the request
ends; each step is the speculative loop of Leviathan et al. 2023: propose -> verify (one target pass over
``[last, drafts...]``, a chain or a tree) -> commit up to a stop -> roll back the target's cache to the committed
tokens. A step with
K = 0 is a plain decoding step, so plain autoregressive decoding (the oracle and the benchmark baseline) is the
same loop without a proposer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

from draftwise.backends.base import CausalLM
from draftwise.backends.slots import OneSlot
from draftwise.config import SamplingParams
from draftwise.speculation.controller import KController
from draftwise.engine.core import EngineCore
from draftwise.engine.sequence import BatchSequence, GenerationResult
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.base import PerSequenceProposers, Proposer, SequenceProposer

__all__ = ["SpeculativeEngine", "Generation", "EngineBusyError", "one_slot_core"]


class EngineBusyError(RuntimeError):
    """A second request was started on an engine whose previous :class:`Generation` is still in flight."""


class Generation:
    """An in-progress request: iterate it to receive committed token chunks (``list[int]`` per step).

    After iteration ends, :attr:`result` holds the :class:`~draftwise.engine.sequence.GenerationResult`. Calling
    :meth:`close` (or leaving the iteration early and closing) stops the generation and frees the engine.
    """

    def __init__(self, steps: Iterator[list[int]], finish: Callable[[str], GenerationResult]) -> None:
        self._steps = steps
        self._finish = finish
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[list[int]]:
        try:
            yield from self._steps
        finally:
            if self.result is None:
                self.close()

    def close(self) -> None:
        """Stop generating (if still running) and fill :attr:`result`."""
        if self.result is None:
            self._steps.close()
            self.result = self._finish("cancelled")


def one_slot_core(target: CausalLM, proposer: Proposer | SequenceProposer | None = None,
                  num_speculative_tokens: int = 5, eos_token_ids: Iterable[int] = (), *,
                  controller_factory: Callable[[], KController] | None = None,
                  prefix_cache: PrefixCache | None = None) -> EngineCore:
    """An engine core over ``target`` as one slot (:class:`~draftwise.backends.slots.OneSlot`: one request at a
    time, a whole prompt in one pass); arguments as :class:`SpeculativeEngine`'s.

    Raises:
        ValueError: see :class:`~draftwise.engine.core.EngineCore`.
    """
    return EngineCore(OneSlot(target), _as_proposer(proposer), num_speculative_tokens, eos_token_ids,
                      max_num_batched_tokens=target.max_context, controller_factory=controller_factory,
                      prefix_cache=prefix_cache)


class SpeculativeEngine:
    """Speculative decoding of one request at a time with a target model and an optional proposer.

    Args:
        target: the target model backend; its output is the oracle.
        proposer: draft proposer (a :class:`~draftwise.proposers.base.SequenceProposer` runs through
            :meth:`PerSequenceProposers.of <draftwise.proposers.base.PerSequenceProposers.of>`), or None for plain
            decoding.
        num_speculative_tokens: K, the maximum draft depth per step (ignored without a proposer).
        eos_token_ids: token ids that end generation (unless a request sets ``ignore_eos``).
        controller_factory: builds a per-request :class:`~draftwise.speculation.controller.KController`; default:
            fixed K.
        prefix_cache: keeps finished sequences' KV states (target and proposer) so a request re-uses the
            longest token prefix it shares with one of the same scope and prefills only the rest (see
            :mod:`draftwise.prefix_cache`). None: every request starts from an empty cache. Ignored for proposers
            that read the target's hidden states (Medusa, EAGLE), which need the whole prompt's features.

    The engine serves one request at a time (one KV cache): :meth:`stream` refuses a second request while a
    :class:`Generation` is still in flight.

    Raises:
        ValueError: K < 1 with a proposer, or a proposer that reads hidden states on a backend without them.
    """

    def __init__(
        self,
        target: CausalLM,
        proposer: Proposer | SequenceProposer | None = None,
        num_speculative_tokens: int = 5,
        eos_token_ids: Iterable[int] = (),
        controller_factory: Callable[[], KController] | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        core = one_slot_core(target, proposer, num_speculative_tokens, eos_token_ids,
                             controller_factory=controller_factory, prefix_cache=prefix_cache)
        self._attach(core, target, proposer)

    @classmethod
    def over(cls, core: EngineCore, target: CausalLM | None = None) -> SpeculativeEngine:
        """The facade over an existing core (e.g. :attr:`draftwise.builder.EngineBundle.core`); it still serves one
        request at a time. ``target``: the target model (default: what the core was built over)."""
        engine = cls.__new__(cls)
        engine._attach(core, core.target if target is None else target, core.proposer)
        return engine

    def _attach(self, core: EngineCore, target: CausalLM, proposer: Proposer | SequenceProposer | None) -> None:
        self.target = target
        self.proposer = proposer
        self.core = core
        self._active: weakref.ref[Generation] | None = None
        self._sequence: BatchSequence | None = None  # the last request started

    @property
    def num_speculative_tokens(self) -> int:
        """K, the largest draft depth per step (0 without a proposer)."""
        return self.core.num_speculative_tokens

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.core.eos_token_ids

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache the core keeps sequences in (None for proposers that read hidden states)."""
        return self.core.prefix_cache

    @property
    def _controller_factory(self) -> Callable[[], KController] | None:
        return self.core.controller_factory

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Generate to completion. See :meth:`stream` for arguments and errors."""
        generation = self.stream(prompt_ids, params)
        for _ in generation:
            pass
        assert generation.result is not None
        return generation.result

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams, *, scope: str = "",
               num_speculative_tokens: int | None = None) -> Generation:
        """Start a request and return a :class:`Generation` yielding committed token chunks.

        Args:
            prompt_ids: ``[n]`` prompt token ids, 1 <= n < target.max_context.
            params: sampling parameters.
            scope: who may share cached state with this request (an API key, a ``user``): the prefix cache
                reuses only sequences of the same scope.
            num_speculative_tokens: this request's K, fixed (0: plain decoding; at most the engine's K); None
                uses the engine's K policy.

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, or a K outside 0..K.
            ContextOverflowError: the prompt leaves no room for a new token in the context.
            EngineBusyError: another :class:`Generation` of this engine is still in flight.
        """
        active = self._active() if self._active is not None else None
        if active is not None and active.result is None:
            raise EngineBusyError(
                "this engine is already generating another request; iterate that Generation to its end or close() "
                "it first (one engine serves one sequence at a time)")
        if self._sequence is not None:  # a request whose Generation was dropped unfinished
            self.core.cancel(self._sequence)
        sequence = self.core.add(prompt_ids, params, scope=scope, num_speculative_tokens=num_speculative_tokens)
        self._sequence = sequence
        generation = Generation(self._steps(sequence), lambda reason: self._finish(sequence, reason))
        self._active = weakref.ref(generation)
        return generation

    def _steps(self, sequence: BatchSequence) -> Iterator[list[int]]:
        """Step the core until the request ends; yields its committed chunks and raises its error."""
        while not sequence.finish_reason:
            for output in self.core.step():
                if output.sequence is not sequence:
                    continue
                if output.error is not None:
                    raise output.error
                if output.token_ids:
                    yield output.token_ids

    def _finish(self, sequence: BatchSequence, reason: str) -> GenerationResult:
        self.core.cancel(sequence)  # no-op when it already finished
        assert sequence.result is not None
        return sequence.result


def _as_proposer(proposer: Proposer | SequenceProposer | None) -> Proposer | None:
    """The engine's face of ``proposer``: itself, or a one-sequence proposer shared by every request."""
    if isinstance(proposer, SequenceProposer):
        return PerSequenceProposers.of(proposer)
    return proposer
