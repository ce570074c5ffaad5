"""Continuous batching with speculative decoding: many sequences, one target pass per step.

:class:`BatchedEngine` drives a lean target (:mod:`draftwise.backends.lean`) whose KV cache has several slots.
Each running request owns a slot, its own proposer state, sampler, acceptance estimate and K. One step:

1. sequences whose request was cancelled have already left (:meth:`BatchedEngine.cancel` frees the slot at
   once); waiting requests take the free slots (continuous batching: they join the running batch at the next
   step), re-using a kept KV prefix when the prefix cache holds one (:mod:`draftwise.prefix_cache`);
2. every decoding sequence gets its K (fixed, or load-aware: :func:`draftwise.cost_model.plan_batch_k` over the
   measured cost of a pass per row count) and its proposer drafts up to K tokens;
3. the rows of the pass are, per decoding sequence, its last committed token and its draft tokens (a chain,
   :func:`draftwise.backends.lean.rows.chain_rows`), then chunks of the prompts still being prefilled within a
   token budget per step (``max_num_batched_tokens``, vLLM's name), so a long prompt does not stall the
   decoders;
4. ONE :meth:`~draftwise.backends.lean.model.LeanLlama.forward_rows` pass over all rows;
5. per sequence: verification with the request's rule (:func:`draftwise.verification.verify`: greedy,
   coupled, rejection), commit up to a stop condition, rollback by setting the slot's length; a prefill that
   completes its prompt samples the first token; finished sequences free their slot at once.

Exactness: the lean runtime gives a row the same logits whatever other rows share the pass (bit for bit,
:mod:`draftwise.backends.lean.attention`), and a k-token verification the same logits as one-token decoding.
So a sequence's greedy output is identical whatever else is in the batch, with or without speculation, and
under coupled sampling with a seed (:mod:`draftwise.sampling`) its text is the one it gets served alone.

Proposers: model-free ones (n-gram, suffix) run one instance per sequence (:class:`PerSequenceProposers`); a
draft model runs as a multi-slot lean draft over rows of all drafting sequences (:class:`BatchedDraftModel`:
one catch-up pass, then one pass per draft depth). Trees (suffix ``tree_width`` > 1) and proposers that read
the target's hidden states (Medusa, EAGLE) are not batched: they stay on the single-sequence
:class:`draftwise.engine.SpeculativeEngine`.

Not thread-safe: one thread calls :meth:`BatchedEngine.add`, :meth:`~BatchedEngine.step` and
:meth:`~BatchedEngine.cancel` (the server's :class:`draftwise.server.batch_scheduler.BatchScheduler` does).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from draftwise.backends.base import ContextOverflowError, KVState
from draftwise.backends.lean.backend import LeanCausalLM
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.lean.rows import RowBatch, chain_rows
from draftwise.config import SamplingParams
from draftwise.controller import AcceptanceEstimator
from draftwise.cost_model import PassCostCurve, batch_step_rate, expected_tokens, plan_batch_k
from draftwise.engine import GenerationResult, commit_tokens
from draftwise.methods import K_POLICIES
from draftwise.prefix_cache import PrefixCache, PrefixEntry
from draftwise.proposers.base import DraftProposal, Proposer, common_prefix_length
from draftwise.proposers.draft_model import fit_vocab
from draftwise.sampling import Sampler
from draftwise.stats import SpeculativeStats
from draftwise.verification import verify

__all__ = ["BatchedEngine", "BatchSequence", "SequenceOutput", "StepInfo", "BatchProposer", "PerSequenceProposers",
           "BatchedDraftModel", "UnattributedStepError", "calibrate_pass_costs", "concat_rows", "K_POLICIES",
           "BATCHED_METHODS"]

logger = logging.getLogger(__name__)

#: ``"fixed"``: every decoding sequence speculates its K (clamped near max_tokens and the context end);
#: ``"auto"``: load-aware K per sequence (:func:`draftwise.cost_model.plan_batch_k`).

#: Speculative methods the batched engine runs (the others stay on the single-sequence engine).
BATCHED_METHODS = ("ngram", "suffix", "draft_model")

WAITING, PREFILLING, DECODING, FINISHED = "waiting", "prefilling", "decoding", "finished"


# ---------------------------------------------------------------------------------------------- sequences
@dataclass(eq=False)
class BatchSequence:
    """One request in a :class:`BatchedEngine`: its handle, and the state the engine keeps for it.

    Attributes:
        seq_id: unique per engine, in arrival order.
        prompt: ``[n]`` prompt token ids.
        params: sampling parameters; ``sampler``: its randomness and rule (:class:`draftwise.sampling.Sampler`).
        scope: who may share cached state with it (prefix cache, suffix index).
        max_k: its largest K (the request's own, else the engine's; 0: plain decoding).
        stop_ids: token ids that end it (its ``stop_token_ids``, and the EOS ids unless ``ignore_eos``).
        arrival_s: ``time.perf_counter()`` when it was added; ``admitted_s``: when it got a slot.
        generated: committed output tokens (stop token excluded).
        stats: its :class:`~draftwise.stats.SpeculativeStats` (``target_time_s`` counts the whole batched passes
            it took part in, which it shared with the other sequences).
        finish_reason: ``""`` while running; then ``"stop"``, ``"length"``, ``"cancelled"`` or ``"error"``.
        result: the :class:`~draftwise.engine.GenerationResult` once finished.
        slot: its KV-cache slot while running (-1 otherwise).
        num_computed: prompt tokens whose keys and values its slot holds (prefill progress, tokens).
        estimator: its acceptance estimate (seeded from the engine's long-memory estimate).
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
    generated: list[int] = field(default_factory=list)
    finish_reason: str = ""
    result: GenerationResult | None = None
    slot: int = -1
    num_computed: int = 0
    admitted_s: float = 0.0
    first_token_done: bool = False  # the prompt is prefilled and its first output token committed
    plain_streak: int = 0  # load-aware K: consecutive steps planned at K = 0 while a draft was offered
    probe_interval: int = 4  # plain steps before a probe with K = 1
    probing: bool = False

    @property
    def state(self) -> str:
        """``"waiting"``, ``"prefilling"``, ``"decoding"`` or ``"finished"``."""
        if self.finish_reason:
            return FINISHED
        if self.slot < 0:
            return WAITING
        return DECODING if self.first_token_done else PREFILLING

    @property
    def context(self) -> list[int]:
        """Prompt + committed output."""
        return self.prompt + self.generated


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
        ks: K of every decoding sequence (0: plain step), in slot order.
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


# ---------------------------------------------------------------------------------------------- proposers
class BatchProposer(ABC):
    """Drafts for the decoding sequences of a batch (one state per sequence).

    Attributes:
        name: method name (``"ngram"``, ``"suffix"``, ``"draft_model"``).
        drafts_first: True when drafting costs next to nothing (a lookup): the engine drafts each sequence's
            largest K first and plans K knowing the tokens actually offered; False (a draft model): K is planned
            first and only that many tokens are drafted.
        pass_costs: measured seconds of the proposer's own passes per row count (a draft model's), or None.
    """

    name: str = "proposer"
    drafts_first: bool = True
    pass_costs: PassCostCurve | None = None

    def open(self, sequence: BatchSequence) -> None:
        """A sequence joined the batch (its slot is set). Default: nothing."""

    def close(self, sequence: BatchSequence) -> None:
        """A sequence left the batch. Default: nothing."""

    def export_state(self, sequence: BatchSequence) -> Any:
        """State worth keeping in the prefix cache with the sequence's target KV (default None)."""
        return None

    def import_state(self, sequence: BatchSequence, state: Any, length: int) -> None:
        """Adopt a kept state for the first ``length`` tokens of the sequence's prompt. Default: nothing."""

    @abstractmethod
    def propose(self, requests: Sequence[tuple[BatchSequence, int]]) -> list[DraftProposal]:
        """Draft at most ``k`` tokens (chains) for each ``(sequence, k)`` (k >= 1), after its committed context.

        Raises:
            RuntimeError: a proposer returned a tree or more than k tokens.
        """


class PerSequenceProposers(BatchProposer):
    """One :class:`~draftwise.proposers.base.Proposer` per sequence, made by ``factory`` (n-gram, suffix).

    Args:
        factory: makes a fresh proposer (instances may share read-mostly state, e.g. the suffix proposer's
            cross-request index).
        name: the method name.
    """

    drafts_first = True

    def __init__(self, factory: Callable[[], Proposer], name: str) -> None:
        self._factory = factory
        self.name = name
        self._proposers: dict[int, Proposer] = {}

    def open(self, sequence: BatchSequence) -> None:
        proposer = self._factory()
        if proposer.needs_target_hidden:
            raise ValueError(f"proposer {proposer.name!r} reads the target's hidden states; the batched engine "
                             "does not run it")
        proposer.start(sequence.prompt, scope=sequence.scope)
        self._proposers[sequence.seq_id] = proposer

    def close(self, sequence: BatchSequence) -> None:
        proposer = self._proposers.pop(sequence.seq_id, None)
        if proposer is not None:
            proposer.finish()

    def propose(self, requests: Sequence[tuple[BatchSequence, int]]) -> list[DraftProposal]:
        proposals = []
        for sequence, k in requests:
            proposal = self._proposers[sequence.seq_id].propose(sequence.context, k, sequence.params, sequence.sampler)
            _check_chain(proposal, k, self.name)
            proposals.append(proposal)
        return proposals


def _check_chain(proposal: DraftProposal, k: int, name: str) -> None:
    if proposal.is_tree:
        raise RuntimeError(f"proposer {name!r} returned a draft tree; the batched engine verifies chains only")
    if len(proposal) > k:
        raise RuntimeError(f"proposer {name!r} returned {len(proposal)} tokens for k={k}")


@dataclass(frozen=True)
class _DraftSlotState:
    """A batched draft model's kept state: the tokens its slot held and their keys/values."""

    tokens: tuple[int, ...]
    kv: KVState

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class BatchedDraftModel(BatchProposer):
    """A draft model drafting for every sequence of the batch at once (Leviathan et al. 2023 per sequence).

    The draft is a lean model with as many slots as the engine (a sequence uses the same slot index in both).
    A call: one pass over the tokens each drafting sequence's slot lacks (at least its last committed token;
    the prompt after joining; longer catch-ups are split into passes of at most ``max_pass_rows`` rows), whose
    last row per sequence gives the logits of its first draft token; then one pass per further draft depth over
    one row per sequence still drafting. Tokens are drawn with each sequence's sampler (greedy, coupled with the
    target's noise, or rejection with ``draft_probs``). A slot is rolled back to the longest common prefix
    with the sequence's context at each call (rejected drafts are simply overwritten).

    Args:
        draft: the draft as a lean model (its cache needs the engine's number of slots).
        target_vocab_size: the target's logits width (draft logits are cut or padded to it).
        max_pass_rows: rows per catch-up pass.
    """

    name = "draft_model"
    drafts_first = False

    def __init__(self, draft: LeanCausalLM | LeanLlama, target_vocab_size: int, max_pass_rows: int = 512) -> None:
        self.model = draft.model if isinstance(draft, LeanCausalLM) else draft
        self.target_vocab_size = target_vocab_size
        self.max_pass_rows = max_pass_rows
        self.vocab_size = self.model.config.vocab_size
        self.pass_costs = PassCostCurve()
        self._cached: dict[int, list[int]] = {}  # seq_id -> tokens in its draft slot

    @property
    def num_slots(self) -> int:
        return self.model.cache.num_slots

    def open(self, sequence: BatchSequence) -> None:
        self._cached[sequence.seq_id] = []
        self.model.cache.lengths[sequence.slot] = 0

    def close(self, sequence: BatchSequence) -> None:
        self._cached.pop(sequence.seq_id, None)
        if 0 <= sequence.slot < self.num_slots:
            self.model.cache.lengths[sequence.slot] = 0

    def export_state(self, sequence: BatchSequence) -> _DraftSlotState | None:
        cached = self._cached.get(sequence.seq_id, [])
        length = common_prefix_length(cached, sequence.context)  # not the drafts past the committed tokens
        if length <= 0:
            return None
        payload = self.model.cache.export_slot(sequence.slot, length)
        return _DraftSlotState(tuple(cached[:length]), KVState(payload, length, sum(k.nbytes + v.nbytes for k, v in payload)))

    def import_state(self, sequence: BatchSequence, state: _DraftSlotState | None, length: int) -> None:
        if state is None:
            return
        length = min(length, len(state.tokens), common_prefix_length(state.tokens, sequence.prompt))
        if length <= 0:
            return
        self.model.cache.import_slot(sequence.slot, state.kv.payload, length)
        self._cached[sequence.seq_id] = list(state.tokens[:length])

    def propose(self, requests: Sequence[tuple[BatchSequence, int]]) -> list[DraftProposal]:
        room = [min(k, self.model.config.max_context - len(s.prompt) - len(s.generated)) for s, k in requests]
        active = [i for i, k in enumerate(room) if k > 0]
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        logits = self._catch_up([requests[i][0] for i in active])  # [len(active), V]
        for depth in range(max((room[i] for i in active), default=0)):
            feed = []
            for row, i in enumerate(active):
                sequence = requests[i][0]
                if depth >= room[i]:
                    continue
                token, p = sequence.sampler.choose(logits[row], len(sequence.context) + depth)
                tokens[i].append(token)
                if p is not None:
                    probs[i].append(p)
                if depth + 1 < room[i]:
                    feed.append(i)
            if not feed:
                break
            pieces = [(requests[i][0], [tokens[i][-1]]) for i in feed]
            logits = self._run(pieces, [len(requests[i][0].context) + depth for i in feed])
            active = feed
        return [DraftProposal(tuple(t), torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def _catch_up(self, sequences: list[BatchSequence]) -> torch.Tensor:
        """Feed every sequence's slot what it lacks of its context; returns the logits after each context
        (``[len(sequences), target_vocab]``)."""
        pieces, starts = [], []
        for sequence in sequences:
            context, cached = sequence.context, self._cached[sequence.seq_id]
            common = min(common_prefix_length(cached, context), len(context) - 1)
            del cached[common:]
            pieces.append((sequence, context[common:]))
            starts.append(common)
        if not pieces:
            return torch.empty(0, self.target_vocab_size)
        # split into passes of at most max_pass_rows rows; a sequence's logits come from its last row
        out: dict[int, torch.Tensor] = {}
        pending = [(s, toks, start) for (s, toks), start in zip(pieces, starts)]
        while pending:
            batch, rest, used = [], [], 0
            for sequence, toks, start in pending:
                take = min(len(toks), self.max_pass_rows - used)
                if take <= 0:
                    rest.append((sequence, toks, start))
                    continue
                batch.append((sequence, toks[:take], start, take == len(toks)))
                if take < len(toks):
                    rest.append((sequence, toks[take:], start + take))
                used += take
            logits = self._run([(s, t) for s, t, _, _ in batch], [start for _, _, start, _ in batch],
                               want=[done for *_, done in batch])
            row = 0
            for sequence, _, _, done in batch:
                if done:
                    out[sequence.seq_id] = logits[row]
                    row += 1
            pending = rest
        return torch.stack([out[s.seq_id] for s in sequences])

    def _run(self, pieces: list[tuple[BatchSequence, list[int]]], starts: list[int],
             want: list[bool] | None = None) -> torch.Tensor:
        """One draft pass over chains ``pieces`` starting at ``starts``; returns the last row's logits of each
        piece (``want[i]`` False: none for piece i), cut or padded to the target's width."""
        batches, last_rows, row = [], [], 0
        for i, ((sequence, toks), start) in enumerate(zip(pieces, starts)):
            readable = [t if t < self.vocab_size else 0 for t in toks]  # an id only the target's vocab has
            batches.append(chain_rows(readable, start, sequence.slot))
            row += len(toks)
            if want is None or want[i]:
                last_rows.append(row - 1)
        rows = concat_rows(batches)
        t0 = time.perf_counter()
        logits, _ = self.model.forward_rows(rows, logit_rows=torch.tensor(last_rows, dtype=torch.long))
        self.pass_costs.observe(len(rows), max(time.perf_counter() - t0, 1e-9))
        for (sequence, toks), start in zip(pieces, starts):
            cached = self._cached[sequence.seq_id]
            if len(cached) == start:
                cached.extend(toks)
            self.model.cache.lengths[sequence.slot] = start + len(toks)
        return fit_vocab(logits, self.target_vocab_size)


def concat_rows(batches: Sequence[RowBatch]) -> RowBatch:
    """The rows of several chains in one pass (``tree_mask`` must be None everywhere)."""
    if len(batches) == 1:
        return batches[0]
    return RowBatch(*(torch.cat([getattr(b, name) for b in batches])
                      for name in ("tokens", "slots", "positions", "cache_index", "context_len")))


# ---------------------------------------------------------------------------------------------- calibration
def calibrate_pass_costs(model: LeanLlama, counts: Iterable[int], slots: Sequence[int], *, repeats: int = 1,
                         curve: PassCostCurve | None = None, per_sequence: bool = False) -> PassCostCurve:
    """Time forward passes over ``n`` rows for each ``n`` in ``counts`` (seconds, the best of ``repeats``) on
    ``slots`` (which must be free: their lengths are reset to 0 afterwards).

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
    curve = curve or PassCostCurve()
    vocab = model.config.vocab_size
    model.forward_rows(chain_rows([1 % vocab], 0, slots[0]))  # warm-up (first-use kernel setup)

    def timed(n: int, spread: list[int]) -> float:
        per_slot = [n // len(spread) + (1 if i < n % len(spread) else 0) for i in range(len(spread))]
        rows = concat_rows([chain_rows([(7 * j + 3) % vocab for j in range(m)], 0, slot)
                            for slot, m in zip(spread, per_slot) if m > 0])
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            model.forward_rows(rows, logit_rows=torch.arange(min(n, len(spread))))
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
        model.cache.lengths[slot] = 0
    return curve


# ---------------------------------------------------------------------------------------------- the engine
class BatchedEngine:
    """Continuous batching with per-sequence speculative decoding over a multi-slot lean target.

    Args:
        target: the lean target (:class:`~draftwise.backends.lean.LeanCausalLM`); the engine owns every slot of
            its cache (do not use its single-sequence interface at the same time).
        proposer: a :class:`BatchProposer`, or None for plain decoding.
        num_speculative_tokens: K, the largest draft per sequence and step (ignored without a proposer).
        eos_token_ids: token ids that end a request (unless it sets ``ignore_eos``).
        max_num_seqs: sequences running at once (default: every slot of the target's cache).
        max_num_batched_tokens: rows per target pass (decode rows, draft rows and prompt chunks together);
            prompt chunks fill what decoding leaves, at least ``min_prefill_tokens`` per step while a prompt waits.
        k_policy: ``"fixed"`` or ``"auto"`` (see :data:`K_POLICIES`).
        pass_costs: the target's pass seconds per row count (``"auto"``); default: measured at construction by
            :func:`calibrate_pass_costs` (a few passes).
        learn_costs: refine ``pass_costs`` (and a draft model's) with every pass (``"auto"``).
        prefix_cache: keeps finished sequences' KV states (target and draft model) for later requests sharing a
            prompt prefix in the same scope; None or disabled: every request prefills its whole prompt.
        min_prefill_tokens: prompt tokens prefilled per step at least, whatever decoding takes.
        max_probe_interval: load-aware K: a sequence planned at K = 0 while drafts are offered gets a probe with
            K = 1 after 4, 8, ... up to this many plain steps (only when a fully accepted draft token would pay).

    Raises:
        ValueError: a bad size or policy, too few slots in the target's (or draft's) cache, or a proposer the
            engine does not run.
    """

    def __init__(
        self,
        target: LeanCausalLM,
        proposer: BatchProposer | None = None,
        num_speculative_tokens: int = 5,
        eos_token_ids: Iterable[int] = (),
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 256,
        k_policy: str = "fixed",
        pass_costs: PassCostCurve | None = None,
        learn_costs: bool = True,
        prefix_cache: PrefixCache | None = None,
        min_prefill_tokens: int = 32,
        max_probe_interval: int = 64,
    ) -> None:
        if not isinstance(target, LeanCausalLM):
            raise ValueError(f"the batched engine needs a lean target (runtime='lean'), got {type(target).__name__}")
        self.target = target
        self.model: LeanLlama = target.model
        slots = self.model.cache.num_slots
        self.max_num_seqs = slots if max_num_seqs is None else max_num_seqs
        if not 1 <= self.max_num_seqs <= slots:
            raise ValueError(f"max_num_seqs must be in 1..{slots} (the target's cache slots), got {max_num_seqs}")
        if proposer is not None and num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1 with a proposer, got {num_speculative_tokens}")
        if isinstance(proposer, BatchedDraftModel) and proposer.num_slots < self.max_num_seqs:
            raise ValueError(f"the draft model's cache has {proposer.num_slots} slots for {self.max_num_seqs} sequences")
        if k_policy not in K_POLICIES:
            raise ValueError(f"unknown k_policy {k_policy!r}; choose one of {K_POLICIES}")
        if max_num_batched_tokens < 1 or min_prefill_tokens < 1 or max_probe_interval < 4:
            raise ValueError("need max_num_batched_tokens >= 1, min_prefill_tokens >= 1 and max_probe_interval >= 4")
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_prefill_tokens = min(min_prefill_tokens, max_num_batched_tokens)
        self.k_policy = k_policy
        self.learn_costs = learn_costs
        self.max_probe_interval = max_probe_interval
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        self.memory = AcceptanceEstimator(max(1, self.num_speculative_tokens), decay=0.995)
        self._waiting: deque[BatchSequence] = deque()
        self._running: dict[int, BatchSequence] = {}  # slot -> sequence
        self._free = list(range(self.max_num_seqs))
        self._next_id = 0
        self.last_step: StepInfo | None = None
        self.pass_costs = pass_costs
        if self.k_policy == "auto" and self.proposer is not None and (pass_costs is None or not len(pass_costs)):
            self.pass_costs = self.calibrate()

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
        slots = list(range(self.max_num_seqs))
        t0 = time.perf_counter()
        curve = calibrate_pass_costs(self.model, counts, slots, curve=self.pass_costs, repeats=2, per_sequence=True)
        if isinstance(self.proposer, BatchedDraftModel):
            calibrate_pass_costs(self.proposer.model, sorted({1 << i for i in range(self.max_num_seqs.bit_length())}
                                                             | {self.max_num_seqs}), slots,
                                 curve=self.proposer.pass_costs, repeats=2)
        logger.info("batched engine: pass costs measured in %.1f s: %s; %.2f ms per sequence in a pass",
                    time.perf_counter() - t0,
                    ", ".join(f"{n} rows {s * 1e3:.1f} ms" for n, s in sorted(curve.points.items())),
                    curve.per_sequence * 1e3)
        return curve

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, *, scope: str = "",
            num_speculative_tokens: int | None = None, arrival_s: float | None = None) -> BatchSequence:
        """Queue a request; it joins the batch at the next step with a free slot.

        Args:
            prompt_ids: ``[n]`` prompt token ids, 1 <= n < the context length.
            params: sampling parameters.
            scope: who may share cached state with it.
            num_speculative_tokens: the request's largest K (0: plain), at most the engine's; None: the engine's.
            arrival_s: ``time.perf_counter()`` of its arrival (default now).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, a K outside 0..K.
            ContextOverflowError: the prompt leaves no room for a new token.
        """
        prompt = [int(t) for t in prompt_ids]
        self._validate_prompt(prompt)
        if num_speculative_tokens is not None and not 0 <= num_speculative_tokens <= self.num_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in 0..{self.num_speculative_tokens} (the engine's K), "
                             f"got {num_speculative_tokens}")
        max_k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        sequence = BatchSequence(
            seq_id=self._next_id, prompt=prompt, params=params, sampler=Sampler(params), scope=scope, max_k=max_k,
            stop_ids=stop_ids, estimator=self.memory.seeded(8.0),
            stats=SpeculativeStats(num_prompt_tokens=len(prompt)),
            arrival_s=time.perf_counter() if arrival_s is None else arrival_s)
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
        failed = self._admit()
        if not self._running:
            self.last_step = None
            return failed
        running = self.running()
        try:
            return failed + self._step_over(running)
        except Exception as exc:  # noqa: BLE001 - confined below to the sequences that cause it
            return failed + self._retry_alone(running, exc)

    def _retry_alone(self, running: list[BatchSequence], exc: BaseException) -> list[SequenceOutput]:
        """The shared part of a step over ``running`` raised ``exc``: retry it one sequence at a time (see
        :meth:`step`)."""
        if len(running) == 1:
            logger.error("a batched step of 1 sequence failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
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
        proposals, ks, draft_s = self._draft(decoding, len(decoding) + expected_prefill, draft_budget, in_pass)
        draft_rows = sum(ks)
        prefill_budget = max(reserve, self.max_num_batched_tokens - len(decoding) - draft_rows)
        chunks = self._prefill_chunks(prefilling, prefill_budget)

        pieces: list[RowBatch] = []
        logit_rows: list[int] = []
        row = 0
        for sequence, proposal in zip(decoding, proposals):
            context = sequence.context
            pieces.append(chain_rows([context[-1], *proposal.token_ids], len(context) - 1, sequence.slot))
            logit_rows.extend(range(row, row + 1 + len(proposal)))
            row += 1 + len(proposal)
        for sequence, count in chunks:
            start = sequence.num_computed
            pieces.append(chain_rows(sequence.prompt[start:start + count], start, sequence.slot))
            row += count
            if start + count == len(sequence.prompt):
                logit_rows.append(row - 1)
        rows = concat_rows(pieces)
        t0 = time.perf_counter()
        logits, _ = self.model.forward_rows(rows, logit_rows=torch.tensor(logit_rows, dtype=torch.long))
        pass_s = time.perf_counter() - t0
        if self.learn_costs and self.pass_costs is not None:
            self.pass_costs.observe(len(rows), max(pass_s, 1e-9), sequences=len(decoding) + len(chunks))

        outputs: list[SequenceOutput] = []
        cursor = 0
        for sequence, proposal in zip(decoding, proposals):
            n = 1 + len(proposal)
            outputs.append(self._guarded(sequence, self._verify, sequence, proposal, logits[cursor:cursor + n],
                                         pass_s, draft_s))
            cursor += n
        for sequence, count in chunks:
            sequence.num_computed += count
            self.model.cache.lengths[sequence.slot] = sequence.num_computed
            if sequence.num_computed == len(sequence.prompt):
                outputs.append(self._guarded(sequence, self._first_token, sequence, logits[cursor]))
                cursor += 1
        self.last_step = StepInfo(
            rows=len(rows), prefill_rows=sum(c for _, c in chunks), draft_rows=draft_rows,
            num_sequences=len(decoding) + len(chunks), num_decoding=len(decoding),
            committed_tokens=sum(len(o.token_ids) for o in outputs), pass_s=pass_s, draft_s=draft_s, ks=tuple(ks))
        return outputs

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
            self.model.cache.lengths[slot] = 0
            try:
                if self.proposer is not None and sequence.max_k > 0:
                    self.proposer.open(sequence)
                sequence.num_computed = self._reuse_prefix(sequence)
            except Exception as exc:  # noqa: BLE001 - this sequence's own failure
                logger.error("sequence %d failed at admission: %s: %s", sequence.seq_id, type(exc).__name__, exc,
                             exc_info=exc)
                failed.append(self._fail(sequence, exc))
                continue
            sequence.stats.num_cached_prompt_tokens = sequence.num_computed
        return failed

    def _reuse_prefix(self, sequence: BatchSequence) -> int:
        """Import the longest kept prefix of the sequence's prompt (same scope) into its slot; returns its
        length (at most ``len(prompt) - 1``: the last prompt token is always fed, for the first token's
        logits)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        match = cache.lookup(sequence.scope, sequence.prompt)
        reused = min(match.length, len(sequence.prompt) - 1)
        if match.entry is not None and reused > 0:
            self.model.cache.import_slot(sequence.slot, match.entry.target_state.payload, reused)
            if self.proposer is not None and sequence.max_k > 0:
                self.proposer.import_state(sequence, match.entry.proposer_state, reused)
        else:
            reused = 0
        cache.record(len(sequence.prompt), reused)
        return reused

    def _keep(self, sequence: BatchSequence) -> None:
        """Export the sequence's committed KV state (target and proposer) into the prefix cache."""
        tokens = sequence.context
        length = min(self.model.cache.lengths[sequence.slot], len(tokens))
        if length <= 0:
            return
        payload = self.model.cache.export_slot(sequence.slot, length)
        target_state = KVState(payload, length, sum(k.nbytes + v.nbytes for k, v in payload))
        proposer_state = (self.proposer.export_state(sequence)
                          if self.proposer is not None and sequence.max_k > 0 else None)
        nbytes = target_state.nbytes + int(getattr(proposer_state, "nbytes", 0))
        self.prefix_cache.insert(PrefixEntry(sequence.scope, tuple(tokens[:length]), target_state, proposer_state,
                                             nbytes))

    # ------------------------------------------------------------------ drafting and K
    def _clamp_k(self, sequence: BatchSequence) -> int:
        """The sequence's largest K now: within its max K, the tokens still wanted and the context room (a step
        commits at most K + 1 tokens and writes K + 1 cache entries on top of ``len(context) - 1``)."""
        remaining = sequence.params.max_tokens - len(sequence.generated)
        room = self.model.config.max_context - len(sequence.prompt) - len(sequence.generated)
        return max(0, min(sequence.max_k, remaining - 1, room - 1))

    def _draft(self, decoding: list[BatchSequence], base_rows: int, draft_budget: int, sequences: int,
               ) -> tuple[list[DraftProposal], list[int], float]:
        """Every decoding sequence's proposal and K for this step, and the drafting time (seconds)."""
        empty = DraftProposal(token_ids=())
        caps = [self._clamp_k(s) for s in decoding]
        if self.proposer is None or not any(caps):
            return [empty] * len(decoding), [0] * len(decoding), 0.0
        t0 = time.perf_counter()
        offered: list[DraftProposal | None] = [None] * len(decoding)
        if self.proposer.drafts_first:
            wanted = [(i, (s, c)) for i, (s, c) in enumerate(zip(decoding, caps)) if c > 0]
            for (i, _), proposal in zip(wanted, self.proposer.propose([r for _, r in wanted])):
                offered[i] = proposal
                caps[i] = min(caps[i], len(proposal))
        ks = self._plan(decoding, caps, base_rows, draft_budget, sequences)
        if self.proposer.drafts_first:
            proposals = [offered[i].truncated(k) if k else empty for i, k in enumerate(ks)]
        else:
            wanted = [(i, (s, k)) for i, (s, k) in enumerate(zip(decoding, ks)) if k > 0]
            proposals = [empty] * len(decoding)
            for (i, _), proposal in zip(wanted, self.proposer.propose([r for _, r in wanted])):
                _check_chain(proposal, ks[i], self.proposer.name)
                proposals[i] = proposal
        draft_s = time.perf_counter() - t0
        return proposals, [len(p) for p in proposals], draft_s

    def _plan(self, decoding: list[BatchSequence], caps: list[int], base_rows: int, draft_budget: int,
              sequences: int) -> list[int]:
        """K per decoding sequence: its cap (fixed) or the load-aware plan with probes (auto), within the
        step's draft-row budget; ``sequences``: how many sequences the pass spans."""
        if self.k_policy == "fixed":
            ks, left = [], draft_budget
            for cap in caps:
                ks.append(min(cap, left))
                left -= ks[-1]
            return ks
        rates = [s.estimator.rates(cap) for s, cap in zip(decoding, caps)]
        draft_curve = self.proposer.pass_costs if not self.proposer.drafts_first else None
        draft_seconds = None
        if draft_curve is not None and len(draft_curve):
            def draft_seconds(rows: int) -> float:  # a draft pass per depth: one row per drafting sequence
                return draft_curve.pass_seconds(rows, rows)

        def pass_seconds(rows: int) -> float:
            return self.pass_costs.pass_seconds(rows, sequences)

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
            if sequence.plain_streak < sequence.probe_interval or sum(ks) >= draft_budget:
                continue
            extra = 0.0 if draft_seconds is None else draft_seconds(max(1, sum(1 for k in ks if k > 0)))
            if batch_step_rate([expected + 1.0], pass_seconds(rows + 1), draft_s + extra) <= now:
                continue
            ks[i], sequence.probing, sequence.plain_streak = 1, True, 0

    # ------------------------------------------------------------------ prefill
    def _prefill_chunks(self, prefilling: list[BatchSequence], budget: int) -> list[tuple[BatchSequence, int]]:
        """Prompt chunks for this step, oldest sequence first, within ``budget`` rows."""
        chunks = []
        for sequence in sorted(prefilling, key=lambda s: s.seq_id):
            if budget <= 0:
                break
            count = min(len(sequence.prompt) - sequence.num_computed, budget)
            chunks.append((sequence, count))
            budget -= count
        return chunks

    # ------------------------------------------------------------------ results
    def _first_token(self, sequence: BatchSequence, logits: torch.Tensor) -> SequenceOutput:
        """The prompt is in the cache: sample the first output token from the last prompt row's logits."""
        stats = sequence.stats
        stats.prefill_time_s = time.perf_counter() - sequence.admitted_s
        first = sequence.sampler.sample(logits, len(sequence.prompt))
        chunk, _, reason = self._commit(sequence, (first,))
        sequence.first_token_done = True
        return self._output(sequence, chunk, reason)

    def _verify(self, sequence: BatchSequence, proposal: DraftProposal, logits: torch.Tensor, pass_s: float,
                draft_s: float) -> SequenceOutput:
        """Verify one sequence's rows (``logits [1 + k, V]``), commit, and cut its slot to the committed tokens."""
        context_len = len(sequence.prompt) + len(sequence.generated)
        result = verify(proposal.token_ids, proposal.node_parents, proposal.draft_probs, logits, sequence.sampler,
                        context_len)
        self.model.cache.lengths[sequence.slot] = context_len + result.num_accepted  # rollback past the accepted
        sequence.sampler.release(context_len + len(result.token_ids))
        chunk, consumed, reason = self._commit(sequence, result.token_ids)
        num_drafted = len(proposal) if consumed > result.num_accepted else consumed
        num_accepted = min(result.num_accepted, consumed)
        stats = sequence.stats
        stats.target_time_s += pass_s
        stats.draft_time_s += draft_s if len(proposal) else 0.0
        stats.record_step(num_drafted, num_accepted, len(chunk))
        stats.step_end_s.append(time.perf_counter() - sequence.admitted_s)
        if not reason and num_drafted:
            sequence.estimator.observe(num_drafted, num_accepted)
            self.memory.observe(num_drafted, num_accepted)
            if sequence.probing:
                full = num_accepted == num_drafted
                sequence.probe_interval = 4 if full else min(2 * sequence.probe_interval, self.max_probe_interval)
        if num_drafted:
            sequence.plain_streak = 0
        return self._output(sequence, chunk, reason)

    def _commit(self, sequence: BatchSequence, tokens: Sequence[int]) -> tuple[list[int], int, str]:
        return commit_tokens(sequence.generated, tokens, stop_ids=sequence.stop_ids,
                             max_tokens=sequence.params.max_tokens,
                             max_generated=self.model.config.max_context - len(sequence.prompt))

    def _output(self, sequence: BatchSequence, chunk: list[int], reason: str) -> SequenceOutput:
        if reason:
            self._finish(sequence, reason)
        return SequenceOutput(sequence, chunk, bool(reason))

    def _finish(self, sequence: BatchSequence, reason: str, keep: bool = True) -> None:
        """End a sequence: keep its KV state (prefix cache), free its slot, fill its result."""
        sequence.finish_reason = reason
        if sequence.slot >= 0:
            if keep and self.prefix_cache is not None:
                self._keep(sequence)
            if self.proposer is not None and sequence.max_k > 0:
                self.proposer.close(sequence)
            self.model.cache.lengths[sequence.slot] = 0
            del self._running[sequence.slot]
            self._free.append(sequence.slot)
            self._free.sort()
            sequence.slot = -1
        stats = sequence.stats
        stats.num_generated_tokens = len(sequence.generated)
        stats.total_time_s = time.perf_counter() - sequence.admitted_s if sequence.admitted_s else 0.0
        stats.finish_reason = reason
        sequence.result = GenerationResult(token_ids=list(sequence.generated), finish_reason=reason, stats=stats)

    def _validate_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        if min(prompt) < 0 or max(prompt) >= self.target.vocab_size:
            raise ValueError(f"prompt holds a token id outside [0, {self.target.vocab_size})")
        if len(prompt) >= self.model.config.max_context:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens; the context length is {self.model.config.max_context} "
                "tokens, which leaves no room for new tokens")
