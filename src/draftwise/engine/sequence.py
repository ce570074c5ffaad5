"""A request inside the engine core: its state, its result, and the rule that commits a step's tokens."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draftwise.backends.base import ContextOverflowError
from draftwise.backends.slots import SlotBackend
from draftwise.config import SamplingParams
from draftwise.logprobs import TokenLogprob, cumulative_logprob
from draftwise.speculation.controller import AcceptanceEstimator, KController, ProbeBackoff
from draftwise.processors.base import LogitsProcessor
from draftwise.proposers.base import DraftProposal
from draftwise.sampling import Sampler
from draftwise.stats import SpeculativeStats

__all__ = ["BatchSequence", "GenerationResult", "RequestState", "SequenceOutput", "check_request", "commit_tokens"]

logger = logging.getLogger(__name__)


class RequestState(enum.Enum):
    """Where a request is in an engine core. A running request has no phase: its prefill progress is how many
    prompt tokens its slot holds (:attr:`BatchSequence.num_computed` against the prompt's length)."""

    WAITING = "waiting"  # added, no slot yet
    RUNNING = "running"  # holds a slot: prompt chunks, then its last token and drafts, in each step
    FINISHED = "finished"  # its result is set


@dataclass
class GenerationResult:
    """A finished request.

    Attributes:
        token_ids: generated tokens (stop token excluded).
        finish_reason: ``"stop"`` (EOS or a stop token id), ``"length"`` (max_tokens or context length),
            ``"cancelled"`` (the consumer stopped early) or ``"error"`` (the engine failed it).
        stats: the request's statistics.
        logprobs: one :class:`~draftwise.logprobs.TokenLogprob` per token of ``token_ids`` when its
            ``params.logprobs`` is set, else None.
        prompt_logprobs: when its ``params.prompt_logprobs`` is set, one per prompt token (None for the first,
            which has no row before it), else None.
    """

    token_ids: list[int]
    finish_reason: str
    stats: SpeculativeStats
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the output tokens' log-probabilities (a choice's score for ``best_of``), or None when
        they were not asked for."""
        return None if self.logprobs is None else cumulative_logprob(self.logprobs)


@dataclass(eq=False)
class BatchSequence:
    """One request in an :class:`~draftwise.engine.core.EngineCore`: its handle, and the state the core keeps.

    Attributes:
        seq_id: unique per engine, in arrival order.
        prompt: ``[n]`` prompt token ids.
        params: sampling parameters; ``sampler``: its randomness and rule (:class:`draftwise.sampling.Sampler`).
        scope: who may share cached state with it (prefix cache, suffix index).
        max_k: its largest K (the request's own, else the engine's; 0: plain decoding).
        stop_ids: token ids that end it (its ``stop_token_ids``, and the EOS ids unless ``ignore_eos``).
        arrival_s: ``time.perf_counter()`` when it was added; ``admitted_s``: when it got a slot.
        generated: committed output tokens (stop token excluded).
        stats: its :class:`~draftwise.stats.SpeculativeStats` (``target_time_s`` counts the whole passes it took
            part in, which it shared with the other sequences).
        finish_reason: ``""`` while running; then ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``.
        result: the :class:`GenerationResult` once finished.
        slot: its KV-cache slot while running (-1 otherwise).
        num_computed: prompt tokens whose keys and values its slot holds (prefill progress, tokens); the prompt
            is prefilled, and its first output token committed, once it equals ``len(prompt)``.
        estimator: its acceptance estimate (seeded from the engine's long-memory estimate).
        controller: its own K policy (:class:`~draftwise.speculation.controller.KController`, e.g. AutoK), or None
            when the engine plans K for the batch (fixed or load-aware; ``backoff``: the load-aware plan's probe
            schedule).
        processors: its logits processors (:class:`~draftwise.processors.base.LogitsProcessor`: a grammar from
            ``response_format``, then those its ``params`` ask for), applied to every verification row and draft,
            advanced by committed tokens only; None: none.
        prompt_source: a sibling sequence with the same prompt (another choice of one request, ``n`` > 1) whose
            slot's prompt KV this one forks when it takes a slot (:mod:`~draftwise.engine.prefix_reuse`), so the
            prompt is computed once; it waits for a slot until the sibling's prompt is in the sibling's slot
            (:attr:`ready`). None: it prefills (or reuses a kept prefix) on its own.
        logprobs: the committed tokens' :class:`~draftwise.logprobs.TokenLogprob` (``params.logprobs`` set),
            one per token of ``generated``; None when not asked for.
        prompt_logprobs: the prompt tokens' (``params.prompt_logprobs`` set), filled as its prompt chunks run
            (None for the first token); None when not asked for.
    """

    seq_id: int
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    scope: str
    max_k: int
    stop_ids: frozenset[int]
    estimator: AcceptanceEstimator
    stats: SpeculativeStats
    arrival_s: float
    controller: KController | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    result: GenerationResult | None = None
    slot: int = -1
    num_computed: int = 0
    admitted_s: float = 0.0
    plain_streak: int = 0  # load-aware K: consecutive steps planned at K = 0 while a draft was offered
    backoff: ProbeBackoff | None = None  # load-aware K: plain steps before a probe with K = 1
    probing: bool = False
    prompt_hidden: list[torch.Tensor] = field(default_factory=list)  # [rows, H] per prefill chunk (Medusa/EAGLE)
    processors: LogitsProcessor | None = None  # its logits processors (grammar, penalties), moved by committed tokens
    prompt_source: BatchSequence | None = None  # the sibling whose prompt KV it forks (n > 1 choices)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, when params.prompt_logprobs

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no row before it

    @property
    def state(self) -> RequestState:
        """Waiting, running or finished."""
        if self.finish_reason:
            return RequestState.FINISHED
        return RequestState.WAITING if self.slot < 0 else RequestState.RUNNING

    @property
    def ready(self) -> bool:
        """May take a slot now: it has no :attr:`prompt_source`, or that sibling's prompt is in its slot, or the
        sibling has finished (then a kept prefix, if any, serves instead), or it asked for its prompt's
        log-probabilities (it prefills its whole prompt itself, forking nothing)."""
        source = self.prompt_source
        return source is None or self.prompt_logprobs is not None or bool(source.finish_reason) or \
            (source.slot >= 0 and not source.prompt_left)

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill (0: its steps decode)."""
        return len(self.prompt) - self.num_computed

    @property
    def context(self) -> list[int]:
        """Prompt + committed output."""
        return self.prompt + self.generated

    def commit(self, tokens: Sequence[int], max_context: int) -> tuple[list[int], int, str]:
        """Append a step's ``tokens`` to :attr:`generated` up to a stop condition (:func:`commit_tokens`; the
        context holds ``max_context`` tokens); the committed ones advance its :attr:`processors`."""
        chunk, consumed, reason = commit_tokens(self.generated, tokens, stop_ids=self.stop_ids,
                                                max_tokens=self.params.max_tokens,
                                                max_generated=max_context - len(self.prompt))
        if self.processors is not None and chunk:
            self.processors.accept(chunk)
        return chunk, consumed, reason

    def record_step(self, proposal: DraftProposal, num_drafted: int, num_accepted: int, num_committed: int,
                    pass_s: float, draft_s: float) -> None:
        """Count a verified step in :attr:`stats`: its draft (``num_drafted`` tokens deep, ``num_accepted`` of them
        accepted, up to a stop), ``num_committed`` output tokens, and the seconds of its pass and drafting."""
        stats = self.stats
        stats.target_time_s += pass_s
        stats.draft_time_s += draft_s
        stats.record_step(num_drafted, num_accepted, num_committed)
        stats.num_tree_nodes += len(proposal) if proposal.is_tree else 0
        if proposal.hybrid_side:
            stats.record_hybrid_step(proposal.hybrid_side, num_drafted)
        stats.step_end_s.append(time.perf_counter() - self.admitted_s)

    def set_result(self, reason: str) -> None:
        """Fill :attr:`result` for a request that ended with ``reason`` (its controller's notes join its warnings,
        which are logged)."""
        stats = self.stats
        if self.controller is not None:
            for note in self.controller.notes():
                if note not in stats.warnings:
                    stats.warnings.append(note)
        stats.num_generated_tokens = len(self.generated)
        stats.total_time_s = time.perf_counter() - self.admitted_s if self.admitted_s else 0.0
        stats.finish_reason = reason
        for warning in stats.warnings:
            logger.warning("%s", warning)
        self.result = GenerationResult(token_ids=list(self.generated), finish_reason=reason, stats=stats,
                                       logprobs=None if self.logprobs is None else list(self.logprobs),
                                       prompt_logprobs=self.prompt_logprobs)


@dataclass(frozen=True)
class SequenceOutput:
    """What one step did for one sequence: ``token_ids`` newly committed (possibly none) and whether it
    finished (then ``sequence.result`` is set). ``error``: the exception that failed this sequence (its
    ``finish_reason`` is then ``"error"``), None otherwise. ``logprobs``: one
    :class:`~draftwise.logprobs.TokenLogprob` per token of ``token_ids`` when the request asked for them, else
    None. ``prompt_logprobs``: the step that committed the first token of a request that asked for them carries
    all its prompt tokens' (None for the first token), else None."""

    sequence: BatchSequence
    token_ids: list[int]
    finished: bool
    error: BaseException | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def check_request(prompt: Sequence[int], num_speculative_tokens: int | None, max_k: int,
                  backend: SlotBackend) -> None:
    """Refuse a request an engine over ``backend`` (whose K is ``max_k``) cannot run.

    Raises:
        ValueError: a ``num_speculative_tokens`` outside ``0..max_k``, an empty prompt, or a token id outside the
            vocabulary.
        ContextOverflowError: the context leaves no room for a new token after the prompt.
    """
    if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= max_k:
        raise ValueError(f"num_speculative_tokens must be in 0..{max_k} (the engine's K), got {num_speculative_tokens}")
    if not prompt:
        raise ValueError("the prompt is empty: at least one token is needed")
    if min(prompt) < 0 or max(prompt) >= backend.vocab_size:
        raise ValueError(f"prompt holds a token id outside [0, {backend.vocab_size})")
    if len(prompt) >= backend.max_context:
        raise ContextOverflowError(
            f"the prompt has {len(prompt)} tokens; the context length is {backend.max_context} tokens, "
            "which leaves no room for new tokens")


def commit_tokens(generated: list[int], tokens: Sequence[int], *, stop_ids: frozenset[int], max_tokens: int,
                  max_generated: int) -> tuple[list[int], int, str]:
    """Append a step's tokens to a request's output until a stop condition.

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
