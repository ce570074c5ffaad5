"""The speculative decoding loop: propose -> verify -> commit -> roll back.

One step, with the target's KV cache holding every committed token but the last one:

1. the proposer drafts k tokens ``d_1..d_k`` after the committed context;
2. the target runs one forward pass over ``[last, d_1..d_k]`` (k + 1 positions) and returns ``[k + 1, vocab]``
   logits;
3. verification keeps the accepted prefix ``d_1..d_n`` and adds one target token (greedy: argmax; coupled:
   the target's Gumbel-argmax; rejection: Leviathan et al. 2023 rejection sampling; see
   :mod:`draftwise.sampling`). A draft *tree* (Medusa, EAGLE) runs as one pass with a tree attention mask
   (:mod:`draftwise.tree`); chains and trees go through the same verifiers (:mod:`draftwise.verification`),
   which return the accepted root-to-node path;
4. the committed tokens are checked against stop conditions (EOS, stop token ids, max_tokens, context
   length); tokens past a stop are discarded and never counted;
5. the target cache keeps the context plus the accepted path (``compact``; for a chain, a rollback), and
   the new last token is fed at the next step. The proposer reconciles its own state at its next call.

A step with k = 0 is a plain decoding step, so plain autoregressive decoding (the oracle and the
benchmark baseline) is the same loop without a proposer.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from draftwise.backends.base import CausalLM, ContextOverflowError
from draftwise.config import SamplingParams
from draftwise.controller import FixedK, KController
from draftwise.prefix_cache import PrefixCache, PrefixEntry
from draftwise.proposers.base import DraftProposal, Proposer, common_prefix_length
from draftwise.sampling import Sampler
from draftwise.stats import SpeculativeStats
from draftwise.verification import VerificationResult, verify

__all__ = ["SpeculativeEngine", "GenerationResult", "Generation", "EngineBusyError", "commit_tokens"]

logger = logging.getLogger(__name__)


class EngineBusyError(RuntimeError):
    """A second request was started on an engine whose previous :class:`Generation` is still in flight."""


@dataclass
class GenerationResult:
    """A finished request.

    Attributes:
        token_ids: generated tokens (stop token excluded).
        finish_reason: ``"stop"`` (EOS or a stop token id), ``"length"`` (max_tokens or context length) or
            ``"cancelled"`` (the consumer stopped early).
        stats: the request's statistics.
    """

    token_ids: list[int]
    finish_reason: str
    stats: SpeculativeStats


class Generation:
    """An in-progress request: iterate it to receive committed token chunks (``list[int]`` per step).

    After iteration ends, :attr:`result` holds the :class:`GenerationResult`. Calling :meth:`close` (or
    leaving the iteration early and closing) stops the generation and frees the engine.
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


class SpeculativeEngine:
    """Drives a target model and an optional proposer.

    Args:
        target: the target model backend; its output is the oracle.
        proposer: draft proposer, or None for plain decoding.
        num_speculative_tokens: K, the maximum draft length per step (ignored without a proposer).
        eos_token_ids: token ids that end generation (unless a request sets ``ignore_eos``).
        controller_factory: builds a per-request :class:`KController`; default: fixed K.
        prefix_cache: keeps finished sequences' KV states (target and proposer) so a request re-uses the
            longest token prefix it shares with one of the same scope and prefills only the rest (see
            :mod:`draftwise.prefix_cache`). None: every request starts from an empty cache. Ignored for proposers
            that read the target's hidden states (Medusa, EAGLE), which need the whole prompt's features.

    The engine serves one request at a time (one KV cache): :meth:`stream` refuses a second request while a
    :class:`Generation` is still in flight.
    """

    def __init__(
        self,
        target: CausalLM,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 5,
        eos_token_ids: Iterable[int] = (),
        controller_factory: Callable[[], KController] | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if proposer is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with a proposer, got {num_speculative_tokens}")
        self.target = target
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._needs_hidden = proposer is not None and proposer.needs_target_hidden
        if self._needs_hidden and not getattr(target, "supports_hidden_states", False):
            raise ValueError(f"proposer {proposer.name!r} reads the target's hidden states; {target.name} is not a "
                             "PyTorch backend (use --backend torch)")
        self._controller_factory = controller_factory or (lambda: FixedK(self.num_speculative_tokens))
        # Prefix reuse needs every prompt position's features for proposers that read them (Medusa / EAGLE).
        self.prefix_cache = None if self._needs_hidden else prefix_cache
        self._live: _LiveSequence | None = None  # what the target's cache holds between requests
        self._active: weakref.ref[Generation] | None = None

    # ------------------------------------------------------------------ public API
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
            ValueError: empty prompt or token ids outside the vocabulary.
            ContextOverflowError: the prompt leaves no room for a new token in the context.
            EngineBusyError: another :class:`Generation` of this engine is still in flight.
        """
        active = self._active() if self._active is not None else None
        if active is not None and active.result is None:
            raise EngineBusyError(
                "this engine is already generating another request; iterate that Generation to its end or close() "
                "it first (one engine serves one sequence at a time)")
        if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= self.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in 0..{self.num_speculative_tokens} (the engine's K), "
                             f"got {num_speculative_tokens}")
        prompt = [int(t) for t in prompt_ids]
        self._validate_prompt(prompt)
        state = _RequestState(prompt=prompt, params=params, stats=SpeculativeStats(num_prompt_tokens=len(prompt)),
                              scope=scope, k_override=num_speculative_tokens)
        state.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        generation = Generation(self._steps(state), lambda reason: self._finish(state, reason))
        self._active = weakref.ref(generation)
        return generation

    # ------------------------------------------------------------------ the loop
    def _steps(self, state: _RequestState) -> Iterator[list[int]]:
        params, stats = state.params, state.stats
        state.start = time.perf_counter()
        sampler = Sampler(params)
        controller = self._controller_factory() if state.k_override is None else FixedK(state.k_override)
        t0 = time.perf_counter()
        state.started = True
        reused = self._reuse_prefix(state.prompt, state.scope)
        stats.num_cached_prompt_tokens = reused
        controller.start(len(state.prompt), params.max_tokens, cached_tokens=reused)
        if self.proposer is not None:
            self.proposer.start(state.prompt, scope=state.scope)

        hidden_args = {"return_hidden": True, "hidden_rows": len(state.prompt)} if self._needs_hidden else {}
        try:
            prefill = self.target.forward(state.prompt[reused:], num_logits=1, **hidden_args)
        except BaseException:
            state.cache_valid = False
            raise
        stats.prefill_time_s = time.perf_counter() - t0
        first = self._sample_one(prefill.logits[-1], sampler, len(state.prompt))
        chunk, _ = self._commit(state, (first,))
        if self._needs_hidden and not state.finish_reason:
            stats.draft_time_s += self._observe(prefill.hidden, state.prompt[1:] + [first])
        if chunk:
            yield chunk

        while not state.finish_reason:
            context = state.prompt + state.generated
            k = self._clamp_k(controller.choose_k(), state, context)
            proposal, draft_time = self._propose(context, k, params, sampler)
            if proposal.is_tree:  # a tree pass writes one cache entry per node on top of the context
                proposal = proposal.truncated(self.target.max_context - len(context))
            t0 = time.perf_counter()
            state.cache_valid = False  # until the pass is verified and the cache cut to the committed tokens
            result, hidden = self._verify_step(context, proposal, sampler)
            state.cache_valid = True
            target_time = time.perf_counter() - t0
            stats.target_time_s += target_time
            chunk, consumed = self._commit(state, result.token_ids)
            # a stop inside the accepted drafts ends the step there: count drafted and accepted up to it
            num_drafted = proposal.depth if consumed > result.num_accepted else consumed
            num_accepted = min(result.num_accepted, consumed)
            if hidden is not None and not state.finish_reason:
                draft_time += self._observe(hidden, result.token_ids)
            stats.draft_time_s += draft_time
            stats.record_step(num_drafted, num_accepted, len(chunk))
            stats.num_tree_nodes += len(proposal) if proposal.is_tree else 0
            stats.step_end_s.append(time.perf_counter() - state.start)
            if not state.finish_reason:  # the last step (perhaps cut by a stop) tells nothing about later ones
                controller.observe(num_drafted, num_accepted, draft_time, target_time)
            if chunk:
                yield chunk
        for note in controller.notes():
            if note not in stats.warnings:
                stats.warnings.append(note)

    # ------------------------------------------------------------------ prefix reuse across requests
    def _reuse_prefix(self, prompt: list[int], scope: str) -> int:
        """Put the KV state of the longest kept prefix of ``prompt`` (same scope) into the target's cache and
        the proposer; returns how many prompt tokens it covers (at most ``len(prompt) - 1``: the last prompt
        token is always fed, to get the logits of the first new token)."""
        live, self._live = self._live, None  # the cache is about to change
        if live is not None and (self.target.cache_owner is not live.owner or self.target.num_cached != len(live.tokens)):
            live = None  # another user of the backend changed the cache since
        self.target.cache_owner = None
        cache = self.prefix_cache
        if cache is None or not cache.enabled:
            self._start_empty()
            return 0
        limit = len(prompt) - 1
        if self.target.supports_cache_export:
            match = cache.lookup(scope, prompt)
            reused = min(match.length, limit)
            if match.entry is not None and reused > 0:
                self.target.import_cache(match.entry.target_state, reused)
                if self.proposer is not None:
                    self.proposer.import_state(match.entry.proposer_state)
        else:  # only the sequence the cache still holds can be reused
            same_scope = live is not None and live.scope == scope
            reused = min(common_prefix_length(live.tokens, prompt), limit) if same_scope else 0
            if reused > 0:
                self.target.rollback(reused)  # the proposer keeps its state and reconciles by common prefix
        if reused == 0:
            self._start_empty()
        cache.record(len(prompt), reused)
        return reused

    def _start_empty(self) -> None:
        self.target.reset()
        if self.proposer is not None:
            self.proposer.import_state(None)

    def _keep_sequence(self, state: _RequestState) -> None:
        """After a request: cut the target's cache to committed tokens and keep it for later requests."""
        sequence = state.prompt + state.generated
        length = min(self.target.num_cached, len(sequence))
        self.target.rollback(length)
        tokens = tuple(sequence[:length])
        self._live = _LiveSequence(scope=state.scope, tokens=tokens, owner=object())
        self.target.cache_owner = self._live.owner
        if not self.target.supports_cache_export or not tokens:
            return
        target_state = self.target.export_cache()
        proposer_state = self.proposer.export_state() if self.proposer is not None else None
        nbytes = target_state.nbytes + int(getattr(proposer_state, "nbytes", 0))
        self.prefix_cache.insert(PrefixEntry(state.scope, tokens, target_state, proposer_state, nbytes))

    # ------------------------------------------------------------------ steps
    def _propose(
        self, context: list[int], k: int, params: SamplingParams, sampler: Sampler
    ) -> tuple[DraftProposal, float]:
        """Ask the proposer for at most k tokens; returns the proposal and the time it took (seconds)."""
        if k == 0 or self.proposer is None:
            return DraftProposal(token_ids=()), 0.0
        t0 = time.perf_counter()
        proposal = self.proposer.propose(context, k, params, sampler)
        draft_time = time.perf_counter() - t0
        if proposal.depth > k:
            raise RuntimeError(f"proposer {self.proposer.name!r} returned {proposal.depth} tokens deep for k={k}")
        return proposal, draft_time

    def _verify_step(
        self, context: list[int], proposal: DraftProposal, sampler: Sampler
    ) -> tuple[VerificationResult, torch.Tensor | None]:
        """One target pass over ``[last, drafts...]`` (a tree pass for a tree), verification, and the KV cache
        cut to the context plus the accepted path. Returns the result and, for proposers that read target
        features, the hidden states ``[1 + accepted, H]`` of the kept positions."""
        rows = [context[-1], *proposal.token_ids]
        if proposal.is_tree:
            out = self.target.forward_tree(rows, proposal.parents, return_hidden=self._needs_hidden)
        else:
            out = self.target.forward(rows, return_hidden=self._needs_hidden)
        result = self._verify(proposal, out.logits, sampler, len(context))  # logits [n + 1, vocab]
        keep = [0] + [1 + node for node in result.accepted_nodes]
        self.target.compact(len(context) - 1, keep)  # a chain's accepted prefix: a rollback
        sampler.release(len(context) + len(result.token_ids))
        return result, None if out.hidden is None else out.hidden[keep]

    def _observe(self, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> float:
        """Hand the target's features to the proposer; returns the time it took (seconds, draft time)."""
        t0 = time.perf_counter()
        self.proposer.observe(hidden, list(next_token_ids))
        return time.perf_counter() - t0

    @staticmethod
    def _verify(
        proposal: DraftProposal, target_logits: torch.Tensor, sampler: Sampler, position: int
    ) -> VerificationResult:
        """Verify a chain or tree; ``position`` is the sequence position of the token after the root."""
        return verify(proposal.token_ids, proposal.node_parents, proposal.draft_probs, target_logits, sampler, position)

    @staticmethod
    def _sample_one(logits: torch.Tensor, sampler: Sampler, position: int) -> int:
        """Plain decoding: the token at sequence ``position`` from the target's ``logits`` ``[vocab]``."""
        return sampler.sample(logits, position)

    def _clamp_k(self, k: int, state: _RequestState, context: list[int]) -> int:
        """K within the configured maximum, the tokens still wanted and the context room (each step commits
        at most k + 1 tokens and writes k + 1 cache entries on top of ``len(context) - 1``)."""
        remaining = state.params.max_tokens - len(state.generated)
        room = self.target.max_context - len(context)
        return max(0, min(k, self.num_speculative_tokens, remaining - 1, room - 1))

    def _commit(self, state: _RequestState, tokens: Sequence[int]) -> tuple[list[int], int]:
        """Append tokens until a stop condition; returns (tokens appended, tokens consumed incl. a stop token)."""
        chunk, consumed, state.finish_reason = commit_tokens(
            state.generated, tokens, stop_ids=state.stop_ids, max_tokens=state.params.max_tokens,
            max_generated=self.target.max_context - len(state.prompt))
        return chunk, consumed

    def _finish(self, state: _RequestState, reason: str) -> GenerationResult:
        if state.started and state.cache_valid and self.prefix_cache is not None and self.prefix_cache.enabled:
            self._keep_sequence(state)
        stats = state.stats
        stats.num_generated_tokens = len(state.generated)
        stats.total_time_s = time.perf_counter() - state.start if state.start else 0.0
        stats.finish_reason = state.finish_reason or reason
        for warning in stats.warnings:
            logger.warning("%s", warning)
        return GenerationResult(token_ids=list(state.generated), finish_reason=stats.finish_reason, stats=stats)

    def _validate_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.target.vocab_size:
            raise ValueError(f"prompt holds a token id outside [0, {self.target.vocab_size})")
        if len(prompt) >= self.target.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens; the context length is {self.target.max_context} tokens, "
                "which leaves no room for new tokens"
            )


def commit_tokens(generated: list[int], tokens: Sequence[int], *, stop_ids: frozenset[int], max_tokens: int,
                  max_generated: int) -> tuple[list[int], int, str]:
    """Append a step's tokens to a request's output until a stop condition (shared by
    :class:`SpeculativeEngine` and :class:`draftwise.batching.BatchedEngine`).

    Args:
        generated: the request's output so far (appended to in place).
        tokens: the step's tokens (accepted drafts, then the target's own token).
        stop_ids: token ids that end the request (the stop token is consumed, not appended).
        max_tokens: the request's ``max_tokens``.
        max_generated: output tokens the context can hold (``max_context - len(prompt)``); reaching it ends
            the request with ``"length"``.

    Returns:
        ``(tokens appended, tokens consumed incl. a stop token, finish reason or "")``.
    """
    chunk: list[int] = []
    consumed = 0
    reason = ""
    for token in tokens:
        consumed += 1
        if token in stop_ids:
            reason = "stop"
            break
        chunk.append(token)
        generated.append(token)
        if len(generated) >= max_tokens:
            reason = "length"
            break
    if not reason and len(generated) >= max_generated:
        reason = "length"
    return chunk, consumed, reason


@dataclass
class _RequestState:
    prompt: list[int]
    params: SamplingParams
    stats: SpeculativeStats
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_ids: frozenset[int] = frozenset()
    start: float = 0.0
    scope: str = ""
    k_override: int | None = None  # the request's own fixed K (0: plain), or None for the engine's policy
    started: bool = False  # the loop has touched the caches
    cache_valid: bool = True  # the target's cache holds committed tokens only (false mid-pass or after a failure)


@dataclass(frozen=True)
class _LiveSequence:
    """The tokens the target's KV cache holds between requests, and whose they are."""

    scope: str
    tokens: tuple[int, ...]
    owner: object  # the marker left in ``target.cache_owner``
