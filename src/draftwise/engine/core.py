"""The engine core: one loop for one or many requests, every proposer, every backend.

:class:`EngineCore` drives a :class:`~draftwise.backends.slots.SlotBackend`: a lean target with many KV-cache
slots (:class:`~draftwise.backends.slots.LeanSlots`), or any single-sequence backend as one slot
(:class:`~draftwise.backends.slots.OneSlot`: transformers, llama.cpp, the lean runtime's one-sequence view). A
single request is a batch of one (vLLM v1's engine core: there is no prefill phase nor decoding phase, each step
gives every running request some rows). Each running request owns a slot, its proposer state, sampler and K.
One step:

1. waiting requests take the free slots (continuous batching: they join the running batch at the next step),
   re-using a kept KV prefix when the prefix cache holds one (:mod:`draftwise.prefix_cache`);
2. every decoding sequence gets its K (fixed; its own :class:`~draftwise.controller.KController` such as AutoK;
   or load-aware for the batch, :func:`draftwise.cost_model.plan_batch_k`) and its proposer drafts up to K
   tokens deep (a chain, or a tree on backends that run trees);
3. the pass's pieces are, per decoding sequence, its last committed token and its draft tokens, then chunks of
   the prompts still being prefilled within a token budget per step (``max_num_batched_tokens``, vLLM's name),
   so a long prompt does not stall the decoders;
4. ONE backend pass over all pieces;
5. per sequence: verification with the request's rule (:func:`draftwise.verification.verify`: greedy, coupled,
   rejection; chains and trees), commit up to a stop condition, the slot cut to the committed tokens (a chain:
   setting its length; a tree: keeping the accepted path, ``compact``); proposers that read the target's hidden
   states (Medusa, EAGLE) observe those of the kept positions; a prefill that completes its prompt samples the
   first token; finished sequences free their slot at once.

Exactness: the lean runtime gives a row the same logits whatever other rows share the pass (bit for bit,
:mod:`draftwise.backends.lean.attention`), and a k-token verification the same logits as one-token decoding.
So a sequence's greedy output is identical whatever else is in the batch, with or without speculation, and
under coupled sampling with a seed (:mod:`draftwise.sampling`) its text is the one it gets served alone.

Not thread-safe: one thread calls :meth:`EngineCore.add`, :meth:`~EngineCore.step` and
:meth:`~EngineCore.cancel` (the server's :class:`draftwise.server.batch_scheduler.BatchScheduler` does; the
library's :class:`draftwise.engine.facade.SpeculativeEngine` does for one request at a time).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from draftwise.backends.base import CausalLM, ContextOverflowError
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.slots import (
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    Piece,
    SlotBackend,
    as_slot_backend,
    chunk_counts,
)
from draftwise.config import SamplingParams
from draftwise.controller import AcceptanceEstimator, KController, ProbeBackoff
from draftwise.cost_model import PassCostCurve, StepOverhead, batch_step_rate, expected_tokens, plan_batch_k
from draftwise.engine.sequence import DECODING, PREFILLING, BatchSequence, GenerationResult, commit_tokens
from draftwise.methods import K_POLICIES
from draftwise.prefix_cache import PrefixCache, PrefixEntry
from draftwise.proposers.base import DraftProposal, Proposer, StepPricing, common_prefix_length
from draftwise.sampling import Sampler
from draftwise.stats import SpeculativeStats
from draftwise.verification import verify

__all__ = ["EngineCore", "SequenceOutput", "StepInfo", "UnattributedStepError", "calibrate_pass_costs",
           "BATCHED_METHODS"]

logger = logging.getLogger(__name__)

#: Speculative methods that run many sequences per pass on a lean multi-slot target (every method runs on one
#: slot).
BATCHED_METHODS = ("ngram", "suffix", "draft_model", "hybrid")


@dataclass(frozen=True)
class SequenceOutput:
    """What one step did for one sequence: ``token_ids`` newly committed (possibly none) and whether it
    finished (then ``sequence.result`` is set). ``error``: the exception that failed this sequence (its
    ``finish_reason`` is then ``"error"``), None otherwise."""

    sequence: BatchSequence
    token_ids: list[int]
    finished: bool
    error: BaseException | None = None


class UnattributedStepError(RuntimeError):
    """A batched step failed and so did every one of its sequences when retried alone: the fault is not one
    request's (the engine itself fails), so no request can be told apart as its cause. ``cause`` is the
    batched step's exception."""

    def __init__(self, num_sequences: int, cause: BaseException) -> None:
        super().__init__(f"the batched step failed for all {num_sequences} requests in it, and for each of them "
                         f"retried alone, so the failure cannot be attributed to one request: "
                         f"{type(cause).__name__}: {cause}")
        self.cause = cause


@dataclass(frozen=True)
class StepInfo:
    """One step of the engine (for metrics and logs).

    Attributes:
        rows: rows in the target pass; ``prefill_rows`` / ``draft_rows`` of them: prompt chunks and draft tokens.
        num_sequences: sequences with rows in the pass; ``num_decoding``: of them, decoding ones.
        committed_tokens: output tokens committed by the step (all sequences).
        pass_s, draft_s: seconds of the target pass and of drafting.
        ks: draft tokens (rows) of every decoding sequence (0: plain step), in slot order.
        overhead_s: the engine's estimate of its own seconds per step after this one (the median over recent
            steps, :attr:`EngineCore.step_overhead`; 0 until the step is measured).
    """

    rows: int
    prefill_rows: int
    draft_rows: int
    num_sequences: int
    num_decoding: int
    committed_tokens: int
    pass_s: float
    draft_s: float
    ks: tuple[int, ...]
    overhead_s: float = 0.0


@dataclass(frozen=True)
class _LiveSequence:
    """What a slot of a backend that cannot export its cache still holds after a request, and whose it is."""

    scope: str
    tokens: tuple[int, ...]
    marker: object


# ---------------------------------------------------------------------------------------------- calibration
def calibrate_pass_costs(backend: SlotBackend | LeanLlama, counts: Iterable[int], slots: Sequence[int], *,
                         repeats: int = 1, curve: PassCostCurve | None = None,
                         per_sequence: bool = False) -> PassCostCurve:
    """Time passes over ``n`` rows for each ``n`` in ``counts`` (seconds, the best of ``repeats``) on ``slots``
    (which must be free: their lengths are reset to 0 afterwards).

    Without ``per_sequence``: the rows are spread one chain per slot (a draft model's passes look like this:
    one row per drafting sequence). With it: the rows are one chain in one slot, which times the per-row part,
    and one pass over ``len(slots)`` rows spread over every slot, whose extra time over the same rows in one slot
    gives the curve's ``per_sequence`` seconds (attention runs once per sequence and layer).

    A short start for :class:`~draftwise.cost_model.PassCostCurve`, which the engine then refines with every pass
    it runs. Returns ``curve`` (a new one by default) with the points added.

    Raises:
        ValueError: no slots, or a count < 1.
    """
    if not slots:
        raise ValueError("calibration needs at least one free slot")
    backend = as_slot_backend(backend)
    curve = curve or PassCostCurve()
    vocab = backend.vocab_size
    backend.forward([Piece(slots[0], 0, [1 % vocab])])  # warm-up (first-use kernel setup)

    def timed(n: int, spread: list[int]) -> float:
        spread = spread[:backend.max_pieces]
        per_slot = [n // len(spread) + (1 if i < n % len(spread) else 0) for i in range(len(spread))]
        pieces = [Piece(slot, 0, [(7 * j + 3) % vocab for j in range(m)], logits=LOGITS_LAST)
                  for slot, m in zip(spread, per_slot) if m > 0]
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            backend.forward(pieces)
            best = min(best, time.perf_counter() - t0)
        return max(best, 1e-9)

    counts = sorted(set(int(c) for c in counts))
    if counts and counts[0] < 1:
        raise ValueError(f"row counts must be >= 1, got {counts[0]}")
    if per_sequence and len(slots) > 1:
        n = len(slots)
        extra = timed(n, list(slots)) - timed(n, [slots[0]])
        curve.per_sequence = max(0.0, extra / (n - 1))
    for n in counts:
        if per_sequence:
            curve.observe(n, timed(n, [slots[0]]), sequences=1)
        else:
            curve.observe(n, timed(n, list(slots)))
    for slot in slots:
        backend.set_length(slot, 0)
    return curve


# ---------------------------------------------------------------------------------------------- the engine
class EngineCore:
    """Speculative decoding for one or many requests over one slot backend (see the module docstring).

    Args:
        target: the target: a :class:`~draftwise.backends.slots.SlotBackend`, a lean target (its multi-slot
            cache; the engine owns every slot, do not use its single-sequence interface at the same time) or any
            :class:`~draftwise.backends.base.CausalLM` (one slot).
        proposer: a :class:`~draftwise.proposers.base.Proposer`, or None for plain decoding.
        num_speculative_tokens: K, the largest draft depth per sequence and step (ignored without a proposer).
        eos_token_ids: token ids that end a request (unless it sets ``ignore_eos``).
        max_num_seqs: sequences running at once (default: every slot of the backend).
        max_num_batched_tokens: rows per target pass (decode rows, draft rows and prompt chunks together);
            prompt chunks fill what decoding leaves, at least ``min_prefill_tokens`` per step while a prompt waits.
        k_policy: ``"fixed"`` or ``"auto"`` (load-aware K for the batch, see :data:`K_POLICIES`).
        controller_factory: makes a per-request :class:`~draftwise.controller.KController` (e.g. AutoK with
            its probe schedule) for requests without their own K; then ``k_policy`` must be ``"fixed"``.
        pass_costs: the target's pass seconds per row count (``"auto"``, and a proposer that ``wants_pricing``);
            default: measured at construction by :func:`calibrate_pass_costs` (a few passes; for a proposer that
            only wants pricing, a failed measurement is logged and its steps go unpriced).
        learn_costs: refine ``pass_costs`` (and a draft model's) with every pass, and price the engine's own time
            per step (:attr:`step_overhead`) into them; False: the given costs alone (scripted).
        prefix_cache: keeps finished sequences' KV states (target and proposer) for later requests sharing a
            prompt prefix in the same scope; None or disabled: every request prefills its whole prompt. Ignored
            for proposers that read the target's hidden states (they need every prompt position's features). A
            backend that cannot export its cache reuses only the sequence its slot still holds.
        min_prefill_tokens: prompt tokens prefilled per step at least, whatever decoding takes.
        max_probe_interval: load-aware K: a sequence planned at K = 0 while drafts are offered gets a probe with
            K = 1 after 4, 8, ... up to this many plain steps (only when a fully accepted draft token would pay).

    Raises:
        ValueError: a bad size or policy, too few slots in the target's (or draft's) cache, or a proposer the
            backend cannot serve (hidden states).
    """

    def __init__(
        self,
        target: SlotBackend | CausalLM,
        proposer: Proposer | None = None,
        num_speculative_tokens: int = 5,
        eos_token_ids: Iterable[int] = (),
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 256,
        k_policy: str = "fixed",
        controller_factory: Callable[[], KController] | None = None,
        pass_costs: PassCostCurve | None = None,
        learn_costs: bool = True,
        prefix_cache: PrefixCache | None = None,
        min_prefill_tokens: int = 32,
        max_probe_interval: int = 64,
    ) -> None:
        self.target = target
        self.backend = as_slot_backend(target)
        self.model: LeanLlama | None = getattr(self.backend, "model", None)  # the lean decoder, when lean
        slots = self.backend.num_slots
        self.max_num_seqs = slots if max_num_seqs is None else max_num_seqs
        if not 1 <= self.max_num_seqs <= slots:
            raise ValueError(f"max_num_seqs must be in 1..{slots} (the target's cache slots), got {max_num_seqs}")
        if proposer is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with a proposer, got {num_speculative_tokens}")
        drafting = proposer.drafting_model if proposer is not None else None
        if drafting is not None and drafting.num_slots < self.max_num_seqs:
            raise ValueError(f"the draft model's cache has {drafting.num_slots} slots for {self.max_num_seqs} "
                             "sequences")
        if k_policy not in K_POLICIES:
            raise ValueError(f"unknown k_policy {k_policy!r}; choose one of {K_POLICIES}")
        if controller_factory is not None and k_policy != "fixed":
            raise ValueError("per-request K controllers and a load-aware batch policy exclude each other")
        if max_num_batched_tokens < 1 or min_prefill_tokens < 1 or max_probe_interval < 4:
            raise ValueError("need max_num_batched_tokens >= 1, min_prefill_tokens >= 1 and max_probe_interval >= 4")
        self.needs_hidden = proposer is not None and proposer.needs_target_hidden
        if self.needs_hidden and not self.backend.supports_hidden_states:
            raise ValueError(f"proposer {proposer.name!r} reads the target's hidden states; {self.backend.name} is "
                             "not a PyTorch backend (use --backend torch)")
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_prefill_tokens = min(min_prefill_tokens, max_num_batched_tokens)
        self.k_policy = k_policy
        self.controller_factory = controller_factory
        self.learn_costs = learn_costs
        self.max_probe_interval = max_probe_interval
        self.prefix_cache = None if self.needs_hidden else prefix_cache
        self.memory = AcceptanceEstimator(max(1, self.num_speculative_tokens), decay=0.995)
        self._waiting: deque[BatchSequence] = deque()
        self._running: dict[int, BatchSequence] = {}  # slot -> sequence
        self._free = list(range(self.max_num_seqs))
        self._live: dict[int, _LiveSequence] = {}  # slot -> what it still holds (backends without export)
        self._next_id = 0
        self.last_step: StepInfo | None = None
        self.step_overhead = StepOverhead()  # the engine's own seconds per step, priced with the passes
        self._busy_since: float | None = None  # end of the last step while sequences ran (None: idle)
        self._unpriced_s = 0.0  # this step's time that is no per-step cost: a proposer observing the target's
        # features (its draft time) and a finishing sequence's export to the prefix cache (once per request)
        self.pass_costs = pass_costs
        priced = self.proposer is not None and (self.k_policy == "auto" or self.proposer.wants_pricing)
        if priced and (pass_costs is None or not len(pass_costs)):
            self.pass_costs = self.calibrate() if self.k_policy == "auto" else self._calibrate_for_pricing()

    # ------------------------------------------------------------------ public API
    @property
    def num_running(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences added but not yet given a slot."""
        return len(self._waiting)

    @property
    def num_free_slots(self) -> int:
        """Slots a waiting sequence could take now."""
        return max(0, len(self._free) - len(self._waiting))

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def running(self) -> list[BatchSequence]:
        """The running sequences, in slot order."""
        return [self._running[slot] for slot in sorted(self._running)]

    def calibrate(self) -> PassCostCurve:
        """Measure the target's (and a draft model's) pass seconds for row counts up to what a step can hold
        (powers of two), on free slots. Call while the engine is idle.

        Raises:
            RuntimeError: sequences are running.
        """
        if self._running:
            raise RuntimeError("calibrate while no sequence runs")
        top = min(self.max_num_batched_tokens, self.max_num_seqs * (self.num_speculative_tokens + 1))
        counts = sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top, self.max_num_seqs})
        counts = [c for c in counts if c <= self.backend.max_context]  # timed in one slot; a step never holds more
        slots = list(range(self.max_num_seqs))
        t0 = time.perf_counter()
        curve = calibrate_pass_costs(self.backend, counts, slots, curve=self.pass_costs, repeats=2,
                                     per_sequence=True)
        self._live.clear()
        drafting = self.proposer.drafting_model if self.proposer is not None else None
        if drafting is not None:
            draft_counts = sorted({1 << i for i in range(self.max_num_seqs.bit_length())} | {self.max_num_seqs})
            calibrate_pass_costs(drafting.slots.backend, draft_counts, slots, curve=drafting.pass_costs, repeats=2)
        logger.info("engine: pass costs measured in %.1f s: %s; %.2f ms per sequence in a pass",
                    time.perf_counter() - t0,
                    ", ".join(f"{n} rows {s * 1e3:.1f} ms" for n, s in sorted(curve.points.items())),
                    curve.per_sequence * 1e3)
        return curve

    def _calibrate_for_pricing(self) -> PassCostCurve | None:
        """:meth:`calibrate` for a proposer that prices its drafts on the engine's measured step; when the backend
        cannot be timed that way, its steps go unpriced (the proposer falls back to its own costs) instead of the
        engine failing to build."""
        try:
            return self.calibrate()
        except Exception as exc:  # noqa: BLE001 - pricing is an optimisation; decoding works without it
            logger.warning("engine: could not measure the pass costs for %s's pricing (%s: %s); it uses its own costs",
                           self.proposer.name, type(exc).__name__, exc)
            for slot in range(self.max_num_seqs):
                self.backend.set_length(slot, 0)
            self._live.clear()
            return None

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, *, scope: str = "",
            num_speculative_tokens: int | None = None, arrival_s: float | None = None) -> BatchSequence:
        """Queue a request; it joins the batch at the next step with a free slot.

        Args:
            prompt_ids: ``[n]`` prompt token ids, 1 <= n < the context length.
            params: sampling parameters.
            scope: who may share cached state with it.
            num_speculative_tokens: the request's largest K, fixed (0: plain), at most the engine's; None: the
                engine's K and policy.
            arrival_s: ``time.perf_counter()`` of its arrival (default now).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, a K outside 0..K.
            ContextOverflowError: the prompt leaves no room for a new token.
        """
        prompt = [int(t) for t in prompt_ids]
        if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= self.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in 0..{self.num_speculative_tokens} (the engine's K), "
                             f"got {num_speculative_tokens}")
        self._validate_prompt(prompt)
        max_k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        controller = None
        if self.controller_factory is not None and num_speculative_tokens is None and self.proposer is not None:
            controller = self.controller_factory()
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        sequence = BatchSequence(
            seq_id=self._next_id, prompt=prompt, params=params, sampler=Sampler(params), scope=scope, max_k=max_k,
            stop_ids=stop_ids, estimator=self.memory.seeded(8.0),
            stats=SpeculativeStats(num_prompt_tokens=len(prompt)),
            arrival_s=time.perf_counter() if arrival_s is None else arrival_s, controller=controller,
            backoff=ProbeBackoff(4, self.max_probe_interval))
        if max_k and self.proposer is not None and self.proposer.has_sides:
            sequence.stats.start_hybrid_steps()
        self._next_id += 1
        self._waiting.append(sequence)
        return sequence

    def cancel(self, sequence: BatchSequence) -> None:
        """Stop a sequence now (idempotent): a waiting one leaves the queue, a running one frees its slot (its
        committed KV state is kept in the prefix cache). Its result has ``finish_reason="cancelled"``."""
        if sequence.finish_reason:
            return
        if sequence.slot < 0:
            try:
                self._waiting.remove(sequence)
            except ValueError:
                pass
        self._finish(sequence, "cancelled")

    def abort_all(self, reason: str = "error") -> list[BatchSequence]:
        """Finish every waiting and running sequence with ``reason`` (e.g. after a failed pass; their KV states
        are not kept); returns them."""
        ended = list(self._waiting) + self.running()
        self._waiting.clear()
        for sequence in ended:
            self._finish(sequence, reason, keep=False)
        return ended

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 ) -> list[GenerationResult]:
        """Run requests to completion together (continuous batching when they outnumber the slots)."""
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        sequences = [self.add(p, sp) for p, sp in zip(prompts, all_params, strict=True)]
        while any(not s.finish_reason for s in sequences):
            self.step()
        return [s.result for s in sequences]

    # ------------------------------------------------------------------ one step
    def step(self) -> list[SequenceOutput]:
        """Admit waiting sequences, run one target pass over every running sequence's rows, verify and commit.

        A failure is confined to the sequence that caused it where that can be told apart: a sequence whose
        admission (prefix import) or verification raises fails alone; when the shared part of the step
        (drafting and the target pass) raises, the step is retried one sequence at a time (the failed attempt
        changed no committed state): each sequence that fails alone too fails with its own error, the others
        take their step. When every sequence of a step of several fails alone too, each fails with an
        :class:`UnattributedStepError` saying so.

        Returns:
            one :class:`SequenceOutput` per sequence that took part (decoding ones, prefilling ones whose
            prompt completed, and failed ones with ``error`` set); an empty list when nothing runs.
        """
        entered, was_busy = time.perf_counter(), bool(self._running)
        failed = self._admit()
        if not self._running:
            self.last_step = None
            self._busy_since = None
            return failed
        running = self.running()
        self.last_step = None  # set by a step that completes (a failed one has none to report)
        self._unpriced_s = 0.0
        t0 = time.perf_counter()
        try:
            outputs = self._step_over(running)
        except Exception as exc:  # noqa: BLE001 - confined below to the sequences that cause it
            outputs = self._retry_alone(running, exc)
        self._measure_overhead(entered if was_busy else None, t0)
        return failed + outputs

    def _measure_overhead(self, entered: float | None, start: float) -> None:
        """Fold the step (begun after admission at ``start``) into :attr:`step_overhead`: its wall time less its
        target pass and drafting (a proposer observing the target's features included), plus, when sequences ran
        from the previous step until this one was called (at ``entered``; None: the engine was idle in between),
        the gap (the caller's own work per step: a server streaming each step's text). Admission (prefix-cache
        imports) and a finishing sequence's export to the prefix cache are once per request, not per step, and
        stay out; a retried step is not measured."""
        now = time.perf_counter()
        step = self.last_step
        if step is not None:
            gap = entered - self._busy_since if entered is not None and self._busy_since is not None else 0.0
            self.step_overhead.observe(gap + (now - start) - step.pass_s - step.draft_s - self._unpriced_s)
            self.last_step = replace(step, overhead_s=self.step_overhead.seconds)
        self._busy_since = now if self._running else None

    def _retry_alone(self, running: list[BatchSequence], exc: BaseException) -> list[SequenceOutput]:
        """The shared part of a step over ``running`` raised ``exc``: retry it one sequence at a time (see
        :meth:`step`)."""
        if len(running) == 1:
            logger.debug("a step of 1 sequence failed: %s: %s", type(exc).__name__, exc)
            return [self._fail(running[0], exc)]
        logger.warning("a batched step of %d sequences failed (%s: %s); retrying each alone to find the cause",
                       len(running), type(exc).__name__, exc, exc_info=exc)
        outputs, errors = [], {}
        for sequence in running:
            try:
                outputs.extend(self._step_over([sequence]))
            except Exception as alone:  # noqa: BLE001 - this sequence's own failure
                errors[sequence.seq_id] = alone
        if len(errors) == len(running):
            logger.error("every one of the %d sequences failed alone too: the failure cannot be attributed to one "
                         "request; failing all of them", len(running))
            return [self._fail(s, UnattributedStepError(len(running), exc)) for s in running]
        for sequence in running:
            if sequence.seq_id in errors:
                error = errors[sequence.seq_id]
                logger.error("sequence %d caused the failed step (it fails alone: %s: %s); failing it only",
                             sequence.seq_id, type(error).__name__, error)
                outputs.append(self._fail(sequence, error))
        if not errors:
            logger.warning("each of the %d sequences succeeded alone: the step was retried one sequence at a time",
                           len(running))
        self.last_step = None  # several passes: no single step to report
        return outputs

    def _fail(self, sequence: BatchSequence, error: BaseException) -> SequenceOutput:
        """End a sequence with ``finish_reason="error"`` (its KV state is not kept)."""
        self._finish(sequence, "error", keep=False)
        return SequenceOutput(sequence, [], True, error)

    def _step_over(self, running: list[BatchSequence]) -> list[SequenceOutput]:
        """One step (drafting, one target pass, verification) over ``running``, a subset of the running
        sequences. Raises what drafting or the pass raises, before any committed state changes; a sequence
        whose verification raises fails alone."""
        decoding = [s for s in running if s.state == DECODING]
        prefilling = [s for s in running if s.state == PREFILLING]
        pending_prefill = sum(len(s.prompt) - s.num_computed for s in prefilling)
        reserve = min(pending_prefill, self.min_prefill_tokens)
        draft_budget = max(0, self.max_num_batched_tokens - len(decoding) - reserve)
        expected_prefill = min(pending_prefill, max(reserve, self.max_num_batched_tokens - len(decoding)))
        in_pass = len(decoding) + min(len(prefilling), 1 if expected_prefill else 0)  # sequences in the pass
        proposals, asked, draft_s = self._draft(decoding, len(decoding) + expected_prefill, draft_budget, in_pass)
        draft_rows = sum(len(p) for p in proposals)
        prefill_budget = max(reserve, self.max_num_batched_tokens - len(decoding) - draft_rows)
        chunks = self._prefill_chunks(prefilling, prefill_budget, self.backend.max_pieces - len(decoding))

        pieces = [self._verify_piece(s, p) for s, p in zip(decoding, proposals)]
        pieces += [self._prefill_piece(s, count) for s, count in chunks]
        t0 = time.perf_counter()
        out = self.backend.forward(pieces)  # logits [rows with logits, V]; hidden [rows, H] or None
        pass_s = time.perf_counter() - t0
        rows = sum(len(p.token_ids) for p in pieces)
        if self.learn_costs and self.pass_costs is not None:
            self.pass_costs.observe(rows, max(pass_s, 1e-9), sequences=len(pieces))

        outputs: list[SequenceOutput] = []
        cursor = hidden_cursor = 0
        for sequence, proposal, was_asked in zip(decoding, proposals, asked):
            n = 1 + len(proposal)
            hidden = None
            if out.hidden is not None:
                hidden = out.hidden[hidden_cursor:hidden_cursor + n]
                hidden_cursor += n
            outputs.append(self._guarded(sequence, self._verify, sequence, proposal, out.logits[cursor:cursor + n],
                                         hidden, pass_s, draft_s if was_asked else 0.0))
            cursor += n
        for sequence, count in chunks:
            sequence.num_computed += count
            if out.hidden is not None:
                sequence.prompt_hidden.append(out.hidden[hidden_cursor:hidden_cursor + count])
                hidden_cursor += count
            if sequence.num_computed == len(sequence.prompt):
                outputs.append(self._guarded(sequence, self._first_token, sequence, out.logits[cursor]))
                cursor += 1
        self.last_step = StepInfo(
            rows=rows, prefill_rows=sum(c for _, c in chunks), draft_rows=draft_rows,
            num_sequences=len(pieces), num_decoding=len(decoding),
            committed_tokens=sum(len(o.token_ids) for o in outputs), pass_s=pass_s, draft_s=draft_s,
            ks=tuple(len(p) for p in proposals))
        return outputs

    def _verify_piece(self, sequence: BatchSequence, proposal: DraftProposal) -> Piece:
        """A decoding sequence's rows: its last committed token, then its draft (a chain or a tree)."""
        context = sequence.context
        return Piece(sequence.slot, len(context) - 1, [context[-1], *proposal.token_ids],
                     parents=proposal.parents if proposal.is_tree else None, logits=LOGITS_ALL,
                     hidden=self.needs_hidden)

    def _prefill_piece(self, sequence: BatchSequence, count: int) -> Piece:
        """The next ``count`` prompt tokens of a prefilling sequence (logits of the last one when it ends the
        prompt)."""
        start = sequence.num_computed
        done = start + count == len(sequence.prompt)
        return Piece(sequence.slot, start, sequence.prompt[start:start + count],
                     logits=LOGITS_LAST if done else LOGITS_NONE, hidden=self.needs_hidden)

    def _guarded(self, sequence: BatchSequence, work: Callable[..., SequenceOutput], *args) -> SequenceOutput:
        """``work(*args)`` for one sequence; if it raises, that sequence alone fails."""
        try:
            return work(*args)
        except Exception as exc:  # noqa: BLE001 - this sequence's own failure
            logger.error("sequence %d failed in its own part of the step: %s: %s", sequence.seq_id,
                         type(exc).__name__, exc, exc_info=exc)
            return self._fail(sequence, exc)

    # ------------------------------------------------------------------ admission and prefix reuse
    def _admit(self) -> list[SequenceOutput]:
        """Give waiting sequences the free slots (with prefix reuse); returns the outputs of those whose
        admission failed (each fails alone)."""
        failed = []
        while self._waiting and self._free:
            sequence = self._waiting.popleft()
            slot = self._free.pop(0)
            sequence.slot = slot
            sequence.admitted_s = time.perf_counter()
            self._running[slot] = sequence
            try:
                if self._speculates(sequence):
                    self.proposer.open(sequence)
                sequence.num_computed = self._reuse_prefix(sequence)
            except Exception as exc:  # noqa: BLE001 - this sequence's own failure
                logger.error("sequence %d failed at admission: %s: %s", sequence.seq_id, type(exc).__name__, exc,
                             exc_info=exc)
                failed.append(self._fail(sequence, exc))
                continue
            sequence.stats.num_cached_prompt_tokens = sequence.num_computed
            if sequence.controller is not None:
                sequence.controller.start(len(sequence.prompt), sequence.params.max_tokens,
                                          cached_tokens=sequence.num_computed)
        return failed

    def _speculates(self, sequence: BatchSequence) -> bool:
        return self.proposer is not None and sequence.max_k > 0

    def _reuse_prefix(self, sequence: BatchSequence) -> int:
        """Put the KV state of the longest kept prefix of the sequence's prompt (same scope) into its slot and its
        proposer; returns its length (at most ``len(prompt) - 1``: the last prompt token is always fed, for the
        first token's logits). Without one, the slot (and the proposer) start empty."""
        slot = sequence.slot
        live = self._live.pop(slot, None)
        cache = self.prefix_cache
        reused = 0
        if cache is not None and cache.enabled:
            limit = len(sequence.prompt) - 1
            if self.backend.supports_export:
                match = cache.lookup(sequence.scope, sequence.prompt)
                if match.entry is not None and min(match.length, limit) > 0:
                    reused = min(match.length, limit)
                    self.backend.import_slot(slot, match.entry.target_state, reused)
                    if self._speculates(sequence):
                        self.proposer.import_state(sequence, match.entry.proposer_state, reused)
            elif live is not None and live.scope == sequence.scope and \
                    self.backend.holds(slot, live.marker, len(live.tokens)):
                # only the sequence the slot still holds can be reused; the proposer reconciles by common prefix
                reused = min(common_prefix_length(live.tokens, sequence.prompt), limit)
                if reused > 0:
                    self.backend.set_length(slot, reused)
            cache.record(len(sequence.prompt), reused)
        if not self.backend.supports_export:
            self.backend.unmark(slot)  # the slot is about to change
        if reused == 0:
            self.backend.set_length(slot, 0)
            if self._speculates(sequence):
                self.proposer.import_state(sequence, None, 0)
        return reused

    def _keep(self, sequence: BatchSequence) -> None:
        """Keep the sequence's committed KV state (target and proposer) for later requests: in the prefix cache,
        or (a backend that cannot export) as what its slot still holds."""
        tokens = sequence.context
        length = min(self.backend.length(sequence.slot), len(tokens))
        if length <= 0:
            return
        if not self.backend.supports_export:
            self.backend.set_length(sequence.slot, length)
            self._live[sequence.slot] = _LiveSequence(sequence.scope, tuple(tokens[:length]),
                                                      self.backend.mark(sequence.slot))
            return
        target_state = self.backend.export_slot(sequence.slot, length)
        proposer_state = self.proposer.export_state(sequence) if self._speculates(sequence) else None
        self.prefix_cache.insert(PrefixEntry(sequence.scope, tuple(tokens[:length]), target_state, proposer_state,
                                             target_state.nbytes))

    # ------------------------------------------------------------------ drafting and K
    def _clamp_k(self, sequence: BatchSequence) -> int:
        """The sequence's largest K now: within its max K, the tokens still wanted and the context room (a step
        commits at most K + 1 tokens and writes K + 1 cache entries on top of ``len(context) - 1``)."""
        remaining = sequence.params.max_tokens - len(sequence.generated)
        room = self.backend.max_context - len(sequence.prompt) - len(sequence.generated)
        return max(0, min(sequence.max_k, remaining - 1, room - 1))

    def _draft(self, decoding: list[BatchSequence], base_rows: int, draft_budget: int, sequences: int,
               ) -> tuple[list[DraftProposal], list[bool], float]:
        """Every decoding sequence's proposal for this step, whether it was asked to draft, and the drafting
        time (seconds)."""
        empty = DraftProposal(token_ids=())
        caps = [self._clamp_k(s) for s in decoding]
        for i, sequence in enumerate(decoding):  # a request's own policy chooses its K (AutoK)
            if sequence.controller is not None:
                caps[i] = max(0, min(caps[i], sequence.controller.choose_k()))
        asked = [c > 0 for c in caps]
        if self.proposer is None or not any(caps):
            return [empty] * len(decoding), asked, 0.0
        t0 = time.perf_counter()
        pricing = self._pricing(base_rows, sequences)
        given = pricing if self.proposer.wants_pricing else None
        if self.k_policy == "fixed":  # a lookup drafts its cap, a model only what the row budget holds
            ks = caps if self.proposer.drafts_first else self._within_rows(caps, draft_budget)
            proposals = self._fit_rows(self._propose(decoding, ks, given), draft_budget)
        else:
            offered: list[DraftProposal | None] = [None] * len(decoding)
            if self.proposer.drafts_first:
                offered = self._propose(decoding, caps, given)
                caps = [min(c, len(p)) for c, p in zip(caps, offered)]
            ks = self._plan(decoding, caps, pricing, draft_budget)
            if self.proposer.drafts_first:
                proposals = [p.truncated(k) if k else empty for p, k in zip(offered, ks)]
            else:
                proposals = self._propose(decoding, ks, given)
        proposals = [self._fit_context(s, p) for s, p in zip(decoding, proposals)]
        return proposals, asked, time.perf_counter() - t0

    def _propose(self, decoding: list[BatchSequence], ks: list[int], pricing: StepPricing | None = None,
                 ) -> list[DraftProposal]:
        """The proposer's drafts for the sequences with ``k > 0`` (an empty one for the others); ``pricing``
        goes to a proposer that ``wants_pricing``."""
        wanted = [i for i, k in enumerate(ks) if k > 0]
        proposals = [DraftProposal(token_ids=())] * len(decoding)
        for i, proposal in zip(wanted, self.proposer.propose([(decoding[i], ks[i]) for i in wanted], pricing)):
            if proposal.is_tree and not self.backend.supports_tree:
                raise RuntimeError(f"proposer {self.proposer.name!r} returned a draft tree; {self.backend.name} "
                                   "verifies chains only")
            proposals[i] = proposal
        return proposals

    def _pricing(self, base_rows: int, sequences: int) -> StepPricing | None:
        """The step's measured costs (None before any measurement): the target pass over ``sequences``
        sequences with the engine's own time per step (:attr:`step_overhead`), and a draft model's passes (None
        for a lookup, whose drafting costs nothing worth counting). The load-aware K plans on them; a proposer
        that ``wants_pricing`` gets them."""
        if self.pass_costs is None or not len(self.pass_costs):
            return None
        drafting = self.proposer.drafting_model
        draft_curve = drafting.pass_costs if drafting is not None else None
        draft_pass_seconds = None
        if draft_curve is not None and len(draft_curve):
            def draft_pass_seconds(rows: int) -> float:  # one row per drafting sequence
                return draft_curve.pass_seconds(rows, rows)

        overhead = self.step_overhead.seconds if self.learn_costs else 0.0

        def pass_seconds(rows: int) -> float:  # a step's time: the pass and the engine's own work
            return self.pass_costs.pass_seconds(rows, sequences) + overhead

        return StepPricing(base_rows, pass_seconds, draft_pass_seconds)

    @staticmethod
    def _within_rows(caps: list[int], budget: int) -> list[int]:
        """Fixed K: each sequence's cap, oldest slot first, within the step's draft-row budget."""
        ks = []
        for cap in caps:
            ks.append(min(cap, budget))
            budget -= ks[-1]
        return ks

    @staticmethod
    def _fit_rows(proposals: list[DraftProposal], budget: int) -> list[DraftProposal]:
        """Cut drafts (a tree has a row per node) to the step's draft-row budget."""
        fitted = []
        for proposal in proposals:
            if len(proposal) > budget:
                proposal = proposal.truncated(max(0, budget))
            fitted.append(proposal)
            budget -= len(proposal)
        return fitted

    def _fit_context(self, sequence: BatchSequence, proposal: DraftProposal) -> DraftProposal:
        """A tree pass writes one cache entry per node on top of the context: cut it at the context's end."""
        if proposal.is_tree:
            return proposal.truncated(self.backend.max_context - len(sequence.prompt) - len(sequence.generated))
        return proposal

    def _plan(self, decoding: list[BatchSequence], caps: list[int], pricing: StepPricing, draft_budget: int,
              ) -> list[int]:
        """Load-aware K per decoding sequence with probes, on the step's measured costs (:meth:`_pricing`),
        within the step's draft-row budget."""
        rates = [s.estimator.rates(cap) for s, cap in zip(decoding, caps)]
        base_rows, pass_seconds, draft_seconds = pricing.base_rows, pricing.pass_seconds, pricing.draft_pass_seconds
        ks = plan_batch_k(rates, caps, base_rows, pass_seconds, draft_seconds, draft_budget)
        self._probe(decoding, caps, ks, rates, base_rows, draft_budget, pass_seconds, draft_seconds)
        return ks

    def _probe(self, decoding, caps, ks, rates, base_rows, draft_budget, pass_seconds, draft_seconds) -> None:
        """A sequence kept at K = 0 (its acceptance looked too low) gets a one-token probe after its interval
        of plain steps, when one fully accepted draft token would raise the batch's rate: without it, its
        acceptance estimate would never learn that the text became predictable. The interval doubles after a
        rejected probe (up to ``max_probe_interval``) and resets after an accepted one."""
        expected = sum(expected_tokens(r[:k]) for r, k in zip(rates, ks))
        rows = base_rows + sum(ks)
        draft_s = 0.0
        if draft_seconds is not None and any(ks):
            draft_s = sum(draft_seconds(sum(1 for k in ks if k > d)) for d in range(max(ks)))
        now = batch_step_rate([expected], pass_seconds(rows), draft_s)
        for i, sequence in enumerate(decoding):
            sequence.probing = False
            if ks[i] > 0 or caps[i] == 0:
                continue
            sequence.plain_streak += 1
            if sequence.plain_streak < sequence.backoff.interval or sum(ks) >= draft_budget:
                continue
            extra = 0.0 if draft_seconds is None else draft_seconds(max(1, sum(1 for k in ks if k > 0)))
            if batch_step_rate([expected + 1.0], pass_seconds(rows + 1), draft_s + extra) <= now:
                continue
            ks[i], sequence.probing, sequence.plain_streak = 1, True, 0

    # ------------------------------------------------------------------ prefill
    def _prefill_chunks(self, prefilling: list[BatchSequence], budget: int, pieces_left: int
                        ) -> list[tuple[BatchSequence, int]]:
        """Prompt chunks for this step, oldest sequence first, within ``budget`` rows and the pieces a pass can
        still hold (:func:`~draftwise.backends.slots.chunk_counts`)."""
        ordered = sorted(prefilling, key=lambda s: s.seq_id)
        counts = chunk_counts([len(s.prompt) - s.num_computed for s in ordered], budget, pieces_left)
        return [(s, count) for s, count in zip(ordered, counts) if count > 0]

    # ------------------------------------------------------------------ results
    def _first_token(self, sequence: BatchSequence, logits: torch.Tensor) -> SequenceOutput:
        """The prompt is in the cache: sample the first output token from the last prompt row's logits
        (``[V]``); a proposer reading the target's features observes the prompt's."""
        stats = sequence.stats
        stats.prefill_time_s = time.perf_counter() - sequence.admitted_s
        first = sequence.sampler.sample(logits, len(sequence.prompt))
        chunk, _, reason = self._commit(sequence, (first,))
        sequence.first_token_done = True
        if sequence.prompt_hidden and not reason and self._speculates(sequence):
            hidden = torch.cat(sequence.prompt_hidden) if len(sequence.prompt_hidden) > 1 else sequence.prompt_hidden[0]
            stats.draft_time_s += self._observe(sequence, hidden, sequence.prompt[1:] + [first])
        sequence.prompt_hidden = []
        return self._output(sequence, chunk, reason)

    def _observe(self, sequence: BatchSequence, hidden: torch.Tensor, next_token_ids: Sequence[int]) -> float:
        """Hand the target's features to the proposer; returns the time it took (seconds, draft time)."""
        t0 = time.perf_counter()
        self.proposer.observe(sequence, hidden, next_token_ids)
        seconds = time.perf_counter() - t0
        self._unpriced_s += seconds
        return seconds

    def _verify(self, sequence: BatchSequence, proposal: DraftProposal, logits: torch.Tensor,
                hidden: torch.Tensor | None, pass_s: float, draft_s: float) -> SequenceOutput:
        """Verify one sequence's rows (``logits [1 + n, V]``, ``hidden [1 + n, H]`` or None), commit, and cut its
        slot to the committed tokens (for a tree: the accepted path's entries)."""
        context_len = len(sequence.prompt) + len(sequence.generated)
        result = verify(proposal.token_ids, proposal.node_parents, proposal.draft_probs, logits, sequence.sampler,
                        context_len)
        keep = [0] + [1 + node for node in result.accepted_nodes]
        self.backend.compact(sequence.slot, context_len - 1, keep)  # a chain's accepted prefix: a rollback
        sequence.sampler.release(context_len + len(result.token_ids))
        chunk, consumed, reason = self._commit(sequence, result.token_ids)
        # a stop inside the accepted drafts ends the step there: count drafted and accepted up to it
        num_drafted = proposal.depth if consumed > result.num_accepted else consumed
        num_accepted = min(result.num_accepted, consumed)
        if hidden is not None and not reason and self._speculates(sequence):
            draft_s += self._observe(sequence, hidden[keep], result.token_ids)
        stats = sequence.stats
        stats.target_time_s += pass_s
        stats.draft_time_s += draft_s
        stats.record_step(num_drafted, num_accepted, len(chunk))
        stats.num_tree_nodes += len(proposal) if proposal.is_tree else 0
        if proposal.hybrid_side:
            stats.record_hybrid_step(proposal.hybrid_side, num_drafted)
        stats.step_end_s.append(time.perf_counter() - sequence.admitted_s)
        if not reason:  # the last step (perhaps cut by a stop) tells nothing about later ones
            if self._speculates(sequence):
                self.proposer.accept(sequence, num_accepted)
            self._learn(sequence, num_drafted, num_accepted, draft_s, pass_s, proposal.model_drafted)
        if num_drafted:
            sequence.plain_streak = 0
        return self._output(sequence, chunk, reason)

    def _learn(self, sequence: BatchSequence, num_drafted: int, num_accepted: int, draft_s: float,
               pass_s: float, model_drafted: bool = True) -> None:
        """Report a step's outcome to the sequence's K policy (its controller, or the acceptance estimates);
        ``model_drafted``: False for a ``hybrid`` step the suffix side drafted (its draft model fell behind)."""
        if sequence.controller is not None:
            sequence.controller.observe(num_drafted, num_accepted, draft_s, pass_s,
                                        overhead_s=self.step_overhead.seconds, model_drafted=model_drafted)
            return
        if not num_drafted:
            return
        sequence.estimator.observe(num_drafted, num_accepted)
        self.memory.observe(num_drafted, num_accepted)
        if sequence.probing:
            if num_accepted == num_drafted:
                sequence.backoff.reset()
            else:
                sequence.backoff.rejected()

    def _commit(self, sequence: BatchSequence, tokens: Sequence[int]) -> tuple[list[int], int, str]:
        return commit_tokens(sequence.generated, tokens, stop_ids=sequence.stop_ids,
                             max_tokens=sequence.params.max_tokens,
                             max_generated=self.backend.max_context - len(sequence.prompt))

    def _output(self, sequence: BatchSequence, chunk: list[int], reason: str) -> SequenceOutput:
        if reason:
            self._finish(sequence, reason)
        return SequenceOutput(sequence, chunk, bool(reason))

    def _finish(self, sequence: BatchSequence, reason: str, keep: bool = True) -> None:
        """End a sequence: keep its KV state (prefix cache), free its slot, fill its result."""
        sequence.finish_reason = reason
        if sequence.slot >= 0:
            slot = sequence.slot
            if keep and self.prefix_cache is not None and self.prefix_cache.enabled:
                t0 = time.perf_counter()
                self._keep(sequence)
                self._unpriced_s += time.perf_counter() - t0
            if self._speculates(sequence):
                self.proposer.close(sequence)
            if slot not in self._live:
                self.backend.set_length(slot, 0)
            del self._running[slot]
            self._free.append(slot)
            self._free.sort()
            sequence.slot = -1
        stats = sequence.stats
        if sequence.controller is not None:
            for note in sequence.controller.notes():
                if note not in stats.warnings:
                    stats.warnings.append(note)
        stats.num_generated_tokens = len(sequence.generated)
        stats.total_time_s = time.perf_counter() - sequence.admitted_s if sequence.admitted_s else 0.0
        stats.finish_reason = reason
        for warning in stats.warnings:
            logger.warning("%s", warning)
        sequence.result = GenerationResult(token_ids=list(sequence.generated), finish_reason=reason, stats=stats)

    def _validate_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.backend.vocab_size:
            raise ValueError(f"prompt holds a token id outside [0, {self.backend.vocab_size})")
        if len(prompt) >= self.backend.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens; the context length is {self.backend.max_context} tokens, "
                "which leaves no room for new tokens")

