"""The engine core: one loop for one or many requests, every proposer, every backend.

:class:`EngineCore` drives a :class:`~draftwise.backends.slots.SlotBackend` (a lean target with many KV-cache
slots, or any single-sequence backend as one slot). A request is a batch of one or joins a running batch, and as in
vLLM v1 there is no prefill phase nor decoding phase. Each running request owns a slot, its proposer state, sampler
and K. One :meth:`~EngineCore.step`: admit waiting requests into free slots with a kept KV prefix
(:mod:`~draftwise.engine.prefix_reuse`); schedule the step's token budget (:mod:`~draftwise.engine.scheduler`);
draft, K per sequence (:mod:`~draftwise.engine.drafting`); ONE pass over every decoding sequence's last token and
draft and the prompt chunks that fit, laid out by a :class:`~draftwise.engine.scheduler.StepPlan`; per sequence,
verify (:func:`draftwise.verification.verify`), roll its slot back to the accepted tokens and commit them up to a
stop condition. A failure is confined to the sequence that caused it (:mod:`~draftwise.engine.faults`).
A request that asks for log-probabilities gets them from the same rows: each committed token's from the processed
verification row it was chosen from, its prompt's from every prompt row (:mod:`draftwise.logprobs`).

Exactness: the lean runtime gives a row the same logits whatever shares the pass (bit for bit), so a sequence's
greedy output, and its coupled-sampling text with a seed, is the one it gets served alone. Not thread-safe: one
thread calls :meth:`~EngineCore.add`, :meth:`~EngineCore.step` and :meth:`~EngineCore.cancel`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch

from draftwise.backends.base import CausalLM
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.slots import PassOutput, SlotBackend, as_slot_backend
from draftwise.config import SamplingParams
from draftwise.cpu_share import ThreadGovernor
from draftwise.engine.constraints import jump_forward_counts, process_rows
from draftwise.engine.drafting import Drafter, check_speculation_options, step_pricing
from draftwise.engine.faults import guarded, retry_alone
from draftwise.engine.prefix_reuse import PrefixReuse
from draftwise.engine.scheduler import ScheduledSequence, Scheduler, StepInfo, StepPlan
from draftwise.engine.sequence import BatchSequence, GenerationResult, SequenceOutput, check_request
from draftwise.logprobs import TokenLogprob, token_logprobs
from draftwise.prefix_cache import PrefixCache
from draftwise.processors.base import LogitsProcessor
from draftwise.processors.request import request_processors
from draftwise.proposers.base import DraftProposal, Proposer, StepPricing
from draftwise.sampling import Sampler
from draftwise.speculation.controller import AcceptanceEstimator, KController, ProbeBackoff
from draftwise.speculation.cost_model import PassCostCurve, StepOverhead
from draftwise.speculation.pass_costs import StepClock, calibrate_step_costs, calibrated_or_none
from draftwise.stats import SpeculativeStats
from draftwise.verification import VerificationResult, verify

__all__ = ["EngineCore", "BATCHED_METHODS"]

_NO_DRAFT = DraftProposal(token_ids=())  # the first output token's row: nothing drafted before it

#: Methods that run many sequences per pass on a lean multi-slot target (every method runs on one slot).
BATCHED_METHODS = ("ngram", "suffix", "draft_model", "hybrid")


class EngineCore:
    """Speculative decoding for one or many requests over one slot backend (see the module docstring).

    Args:
        target: a :class:`~draftwise.backends.slots.SlotBackend`, a lean target (the engine owns every slot of its
            cache) or any :class:`~draftwise.backends.base.CausalLM` (one slot).
        proposer: a :class:`~draftwise.proposers.base.Proposer`, or None for plain decoding.
        num_speculative_tokens: K, the largest draft depth per sequence and step (ignored without a proposer).
        eos_token_ids: token ids that end a request (unless it sets ``ignore_eos``).
        max_num_seqs: sequences running at once (default: every slot of the backend).
        max_num_batched_tokens, min_prefill_tokens: rows per target pass (decode, draft and prompt rows), and
            prompt rows per step at least while a prompt waits (:class:`~draftwise.engine.scheduler.Scheduler`).
        k_policy: ``"fixed"`` or ``"auto"`` (load-aware K for the batch, :data:`draftwise.methods.K_POLICIES`).
        controller_factory: makes a per-request :class:`~draftwise.speculation.controller.KController` (e.g. AutoK)
            for requests without their own K; then ``k_policy`` must be ``"fixed"``.
        pass_costs: the target's pass seconds per row count (``"auto"``, and a proposer that ``wants_pricing``);
            default: :meth:`calibrate` at construction (for pricing only, a failure leaves the steps unpriced).
        learn_costs: refine ``pass_costs`` (and a draft model's) with every pass, and price the engine's own time
            per step (:attr:`step_overhead`) into them; False: the given costs alone (scripted).
        prefix_cache: kept KV states for requests sharing a prompt prefix in the same scope
            (:class:`~draftwise.engine.prefix_reuse.PrefixReuse`); ignored for proposers that read the target's
            hidden states (they need every prompt position's features).
        max_probe_interval: load-aware K: a sequence planned at K = 0 while drafts are offered gets a probe with
            K = 1 after 4, 8, ... up to this many plain steps (only when a fully accepted draft token would pay).

    Raises:
        ValueError: a bad size or policy, too few slots in the target's (or draft's) cache, or a proposer the
            backend cannot serve (hidden states).
    """

    def __init__(self, target: SlotBackend | CausalLM, proposer: Proposer | None = None,
                 num_speculative_tokens: int = 5, eos_token_ids: Iterable[int] = (), *,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int = 256, k_policy: str = "fixed",
                 controller_factory: Callable[[], KController] | None = None, pass_costs: PassCostCurve | None = None,
                 learn_costs: bool = True, prefix_cache: PrefixCache | None = None, min_prefill_tokens: int = 32,
                 max_probe_interval: int = 64) -> None:
        self.target = target
        self.backend = as_slot_backend(target)
        self.model: LeanLlama | None = getattr(self.backend, "model", None)  # the lean decoder, when lean
        slots = self.backend.num_slots
        self.max_num_seqs = slots if max_num_seqs is None else max_num_seqs
        if not 1 <= self.max_num_seqs <= slots:
            raise ValueError(f"max_num_seqs must be in 1..{slots} (the target's cache slots), got {max_num_seqs}")
        check_speculation_options(proposer, num_speculative_tokens, self.max_num_seqs, k_policy, controller_factory,
                                  max_probe_interval, self.backend)
        self.needs_hidden = proposer is not None and proposer.needs_target_hidden
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.k_policy = k_policy
        self.controller_factory = controller_factory
        self.learn_costs = learn_costs
        self.max_probe_interval = max_probe_interval
        self.prefix_cache = None if self.needs_hidden else prefix_cache
        self.memory = AcceptanceEstimator(max(1, self.num_speculative_tokens), decay=0.995)
        self.scheduler = Scheduler(self.max_num_seqs, max_num_batched_tokens, min_prefill_tokens,
                                   self.backend.max_pieces, self.backend.max_context, self.needs_hidden)
        self.prefix_reuse = PrefixReuse(self.backend, self.prefix_cache)
        self.clock = StepClock()  # measures the engine's own seconds per step (:attr:`step_overhead`)
        self.step_overhead = StepOverhead()  # priced into the passes
        self.drafter = Drafter(proposer, self.scheduler.k_cap, k_policy, self.memory, self.clock,
                               self.backend.supports_tree, self.backend.name)
        self._next_id = 0
        self.threads: ThreadGovernor | None = None  # set by the builder (draftwise.cpu_share); None: fixed threads
        self.last_step: StepInfo | None = None
        self.pass_costs = pass_costs
        priced = self.proposer is not None and (self.k_policy == "auto" or self.proposer.wants_pricing)
        if priced and (pass_costs is None or not len(pass_costs)):
            self.pass_costs = self.calibrate() if self.k_policy == "auto" else calibrated_or_none(
                self.calibrate, self.proposer.name, lambda: self.prefix_reuse.forget(num_slots=self.max_num_seqs))

    # ------------------------------------------------------------------ public API
    @property
    def num_running(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences added but not yet given a slot."""
        return len(self.scheduler.waiting)

    @property
    def num_free_slots(self) -> int:
        """Slots a waiting sequence could take now."""
        return max(0, len(self.scheduler.free) - len(self.scheduler.waiting))

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def running(self) -> list[BatchSequence]:
        """The running sequences, in slot order."""
        return self.scheduler.in_slot_order()

    def calibrate(self) -> PassCostCurve:
        """Measure the target's (and a draft model's) pass seconds up to what a step can hold, on free slots
        (:func:`~draftwise.speculation.pass_costs.calibrate_step_costs`). Call while the engine is idle.

        Raises:
            RuntimeError: sequences are running.
        """
        if self.scheduler.running:
            raise RuntimeError("calibrate while no sequence runs")
        drafting = self.proposer.drafting_model if self.proposer is not None else None
        top = min(self.max_num_batched_tokens, self.max_num_seqs * (self.num_speculative_tokens + 1))
        curve = calibrate_step_costs(self.backend, self.max_num_seqs, top, curve=self.pass_costs,
                                     draft=(drafting.slots.backend, drafting.pass_costs) if drafting else None)
        self.prefix_reuse.forget()
        return curve

    def add(self, prompt_ids: Sequence[int], params: SamplingParams, *, scope: str = "",
            num_speculative_tokens: int | None = None, arrival_s: float | None = None,
            processors: LogitsProcessor | None = None, prompt_source: BatchSequence | None = None
            ) -> BatchSequence:
        """Queue a request; it joins the batch at the next step with a free slot.

        Args:
            prompt_ids: ``[n]`` prompt token ids, 1 <= n < the context length.
            params: sampling parameters.
            scope: who may share cached state with it.
            num_speculative_tokens: the request's largest K, fixed (0: plain), at most the engine's; None: the
                engine's K and policy.
            arrival_s: ``time.perf_counter()`` of its arrival (default now).
            processors: its logits processors (a grammar; :mod:`draftwise.engine.constraints`), fresh (nothing
                accepted yet); None: none. Those ``params`` asks for (penalties, ``logit_bias``, ``min_tokens``)
                follow them (:func:`~draftwise.processors.request.request_processors`).
            prompt_source: a sequence added before it with the same prompt (another choice of the same request):
                this one takes a slot once that one's prompt is in its slot and forks that KV state
                (:mod:`draftwise.engine.prefix_reuse`) instead of prefilling the prompt again; None: none.

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary (the prompt's or ``logit_bias``'s), a K
                outside 0..K.
            ContextOverflowError: the prompt leaves no room for a new token.
        """
        prompt = [int(t) for t in prompt_ids]
        check_request(prompt, num_speculative_tokens, self.num_speculative_tokens, self.backend)
        max_k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        own_policy = num_speculative_tokens is None and self.proposer is not None  # the engine's K policy
        controller = self.controller_factory() if own_policy and self.controller_factory is not None else None
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        processors = request_processors(params, prompt, stop_ids, self.backend.vocab_size, processors)
        sequence = BatchSequence(
            seq_id=self._next_id, prompt=prompt, params=params, sampler=Sampler(params), scope=scope, max_k=max_k,
            stop_ids=stop_ids, estimator=self.memory.seeded(8.0),
            stats=SpeculativeStats(num_prompt_tokens=len(prompt)),
            arrival_s=time.perf_counter() if arrival_s is None else arrival_s, controller=controller,
            backoff=ProbeBackoff(4, self.max_probe_interval), processors=processors, prompt_source=prompt_source)
        if max_k and self.proposer is not None and self.proposer.has_sides:
            sequence.stats.start_hybrid_steps()
        self._next_id += 1
        self.scheduler.add(sequence)
        return sequence

    def cancel(self, sequence: BatchSequence) -> None:
        """Stop a sequence now (idempotent): a waiting one leaves the queue, a running one frees its slot (its
        committed KV state is kept in the prefix cache). Its result has ``finish_reason="cancelled"``."""
        if sequence.finish_reason:
            return
        self.scheduler.drop_waiting(sequence)
        self._finish(sequence, "cancelled")

    def abort_all(self, reason: str = "error") -> list[BatchSequence]:
        """Finish every waiting and running sequence with ``reason`` (e.g. after a failed pass; their KV states
        are not kept); returns them."""
        ended = self.scheduler.drain_waiting() + self.running()
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
        """Admit waiting sequences, then schedule, draft, one pass, verify and commit (:meth:`_step_over`); a
        failure is confined to the sequences that cause it (:mod:`draftwise.engine.faults`).

        Returns:
            one :class:`~draftwise.engine.sequence.SequenceOutput` per sequence that took part (decoding ones,
            prefilling ones whose prompt completed, and failed ones with ``error`` set); an empty list when
            nothing runs.
        """
        entered, was_busy = time.perf_counter(), bool(self.scheduler.running)
        if self.threads is not None:
            self.threads.update()  # between passes: the compute threads follow the CPUs others leave free
        failed = self._admit()
        self.last_step = None  # set by a step that completes (a failed or retried one has none to report)
        if not self.scheduler.running:
            self.clock.busy_since = None
            return failed
        running = self.running()
        self.clock.start_step()
        t0 = time.perf_counter()
        try:
            outputs, step = self._step_over(running)
        except Exception as exc:  # noqa: BLE001 - confined to the sequences that cause it
            outputs, step = retry_alone(running, exc, lambda alone: self._step_over(alone)[0], self._fail), None
        self.last_step = self.clock.end_step(step, self.step_overhead, entered if was_busy else None, t0,
                                             busy=bool(self.scheduler.running))
        return failed + outputs

    def _step_over(self, running: list[BatchSequence]) -> tuple[list[SequenceOutput], StepInfo]:
        """One step over ``running`` (some of the running sequences): schedule, draft, one pass, then verify and
        commit each sequence. Raises what drafting or the pass raises, before any committed state changes; a
        sequence whose own part raises fails alone."""
        budget = self.scheduler.budget(running)
        drafts = self.drafter.draft(budget, self._pricing)
        plan = self.scheduler.plan(budget, drafts.proposals)
        out, pass_s = self._forward(plan)
        outputs = []
        for scheduled, asked in zip(plan.decodes, drafts.asked):  # drafting time is charged to those asked
            verify_one = partial(self._verify, scheduled, out, pass_s, drafts.seconds if asked else 0.0)
            outputs.append(guarded(self._fail, scheduled.sequence, verify_one))
        outputs += [o for o in (self._prefilled(s, out) for s in plan.prefills) if o is not None]
        return outputs, plan.info(sum(len(o.token_ids) for o in outputs), pass_s, drafts.seconds)

    def _forward(self, plan: StepPlan) -> tuple[PassOutput, float]:
        """The step's one target pass (and its seconds), which refines the pass costs."""
        t0 = time.perf_counter()
        out = self.backend.forward(plan.pieces)  # logits [rows with logits, V]; hidden [rows, H] or None
        pass_s = time.perf_counter() - t0
        if self.learn_costs and self.pass_costs is not None:
            self.pass_costs.observe(plan.rows, max(pass_s, 1e-9), sequences=len(plan.pieces))
        return out, pass_s

    # ------------------------------------------------------------------ admission
    def _admit(self) -> list[SequenceOutput]:
        """Give waiting sequences the free slots (with prefix reuse); returns the outputs of those whose
        admission failed (each fails alone)."""
        failed = []
        for sequence in self.scheduler.admit():
            failure = guarded(self._fail, sequence, partial(self._start, sequence), "at admission")
            if failure is not None:
                failed.append(failure)
                continue
            self.drafter.start(sequence)
        return failed

    def _start(self, sequence: BatchSequence) -> None:
        """A sequence took a slot: its proposer state opens, and a kept prefix of its prompt fills its slot."""
        if self._speculates(sequence):
            self.proposer.open(sequence)
        if sequence.prompt_logprobs is None:  # prompt logprobs need every prompt row's logits: no kept prefix
            sequence.num_computed = self.prefix_reuse.reuse(sequence, self._proposer_of(sequence))
        sequence.stats.num_cached_prompt_tokens = sequence.num_computed

    def _speculates(self, sequence: BatchSequence) -> bool:
        return self.proposer is not None and sequence.max_k > 0

    def _proposer_of(self, sequence: BatchSequence) -> Proposer | None:
        return self.proposer if self._speculates(sequence) else None

    # ------------------------------------------------------------------ drafting
    def _pricing(self, base_rows: int, sequences: int) -> StepPricing | None:
        """The step's measured costs (:func:`~draftwise.engine.drafting.step_pricing`), with the engine's own time
        per step (:attr:`step_overhead`) when it learns its costs."""
        overhead = self.step_overhead.seconds if self.learn_costs else 0.0
        return step_pricing(self.pass_costs, overhead, self.proposer.drafting_model, base_rows, sequences)

    # ------------------------------------------------------------------ verify, roll back, commit
    def _verify(self, scheduled: ScheduledSequence, out: PassOutput, pass_s: float, draft_s: float
                ) -> SequenceOutput:
        """Verify one decoding sequence's rows, roll its slot back to the accepted tokens, commit them (up to a
        stop condition), and tell its proposer and K policy."""
        sequence, proposal = scheduled.sequence, scheduled.proposal
        context_len = len(sequence.context)
        logits = out.logits[scheduled.logit_rows]  # [1 + rows of the draft, V]
        sequence.stats.processor_time_s += process_rows(sequence.processors, logits, proposal)  # grammar, penalties
        result = verify(proposal.token_ids, proposal.node_parents, proposal.draft_probs, logits, sequence.sampler,
                        context_len)
        keep = self._roll_back(sequence, context_len, result)
        chunk, consumed, reason = sequence.commit(result.token_ids, self.backend.max_context)
        logprobs = _chosen_logprobs(sequence, logits, keep, chunk)  # committed token i: row keep[i]
        # a stop inside the accepted drafts ends the step there: count drafted and accepted up to it
        num_drafted = proposal.depth if consumed > result.num_accepted else consumed
        num_accepted = min(result.num_accepted, consumed)
        num_drafted, num_accepted = jump_forward_counts(sequence.stats, proposal, num_drafted, num_accepted)
        if out.hidden is not None and not reason and self._speculates(sequence):
            hidden = out.hidden[scheduled.hidden_rows]  # [1 + rows of the draft, H]
            draft_s += self.drafter.observe(sequence, hidden[keep], result.token_ids)
        sequence.record_step(proposal, num_drafted, num_accepted, len(chunk), pass_s, draft_s)
        if not reason and self._speculates(sequence):  # the last step (perhaps cut by a stop) tells nothing
            self.proposer.accept(sequence, num_accepted)
        self.drafter.learn(sequence, num_drafted, num_accepted, draft_s, pass_s, self.step_overhead.seconds,
                           model_drafted=proposal.model_drafted, finished=bool(reason))
        return self._output(sequence, chunk, reason, logprobs)

    def _roll_back(self, sequence: BatchSequence, context_len: int, result: VerificationResult) -> list[int]:
        """Cut the sequence's slot to the entries of its last committed token and the accepted drafts (a chain:
        setting its length; a tree: keeping the accepted path); returns their rows in the sequence's piece."""
        keep = [0] + [1 + node for node in result.accepted_nodes]
        self.backend.compact(sequence.slot, context_len - 1, keep)
        sequence.sampler.release(context_len + len(result.token_ids))
        return keep

    def _prefilled(self, scheduled: ScheduledSequence, out: PassOutput) -> SequenceOutput | None:
        """A prompt chunk ran: the prompt's progress advances; once it is whole, its first token is sampled."""
        sequence = scheduled.sequence
        sequence.num_computed += len(scheduled.piece.token_ids)
        if out.hidden is not None:
            sequence.prompt_hidden.append(out.hidden[scheduled.hidden_rows])  # [chunk, H]
        if sequence.prompt_logprobs is not None:  # every row of the chunk has logits (LOGITS_ALL)
            _add_prompt_logprobs(sequence, scheduled.piece.start, out.logits[scheduled.logit_rows])
        if sequence.prompt_left:
            return None
        logits = out.logits[scheduled.logit_rows.stop - 1]  # [V], the last prompt row's
        return guarded(self._fail, sequence, partial(self._first_token, sequence, logits))

    def _first_token(self, sequence: BatchSequence, logits: torch.Tensor) -> SequenceOutput:
        """The prompt is in the cache: sample the first output token from the last prompt row's logits
        (``[V]``); a proposer reading the target's features observes the prompt's."""
        stats = sequence.stats
        stats.prefill_time_s = time.perf_counter() - sequence.admitted_s
        stats.processor_time_s += process_rows(sequence.processors, logits.unsqueeze(0), _NO_DRAFT)
        first = sequence.sampler.sample(logits, len(sequence.prompt))
        chunk, _, reason = sequence.commit((first,), self.backend.max_context)
        logprobs = _chosen_logprobs(sequence, logits.unsqueeze(0), [0], chunk)
        if sequence.prompt_hidden and not reason and self._speculates(sequence):
            hidden = torch.cat(sequence.prompt_hidden)  # [prompt, H]
            stats.draft_time_s += self.drafter.observe(sequence, hidden, sequence.prompt[1:] + [first])
        sequence.prompt_hidden = []
        return self._output(sequence, chunk, reason, logprobs, sequence.prompt_logprobs)

    # ------------------------------------------------------------------ finishing
    def _output(self, sequence: BatchSequence, chunk: list[int], reason: str,
                logprobs: list[TokenLogprob] | None = None,
                prompt_logprobs: list[TokenLogprob | None] | None = None) -> SequenceOutput:
        if reason:
            self._finish(sequence, reason)
        return SequenceOutput(sequence, chunk, bool(reason), logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _fail(self, sequence: BatchSequence, error: BaseException) -> SequenceOutput:
        """End a sequence with ``finish_reason="error"`` (its KV state is not kept)."""
        self._finish(sequence, "error", keep=False)
        return SequenceOutput(sequence, [], True, error)

    def _finish(self, sequence: BatchSequence, reason: str, keep: bool = True) -> None:
        """End a sequence: keep its KV state (prefix reuse), free its slot, fill its result."""
        sequence.finish_reason = reason
        if sequence.slot >= 0:
            if keep and self.prefix_reuse.enabled:
                t0 = time.perf_counter()
                self._keep(sequence)
                self.clock.exclude(time.perf_counter() - t0)  # once per request, not per step
            if self._speculates(sequence):
                self.proposer.close(sequence)
            self.prefix_reuse.release(sequence.slot)
            self.scheduler.release(sequence)
        sequence.set_result(reason)

    def _keep(self, sequence: BatchSequence) -> None:
        """Keep the sequence's committed KV state for later requests (:meth:`PrefixReuse.keep`)."""
        self.prefix_reuse.keep(sequence, self._proposer_of(sequence))


# ---------------------------------------------------------------------- log-probabilities (requests that ask)
def _chosen_logprobs(sequence: BatchSequence, logits: torch.Tensor, rows: list[int], chunk: list[int],
                     ) -> list[TokenLogprob] | None:
    """The committed ``chunk``'s log-probabilities when the sequence asked for them (None otherwise, at no cost),
    token i under the processed row ``logits[rows[i]]`` it was chosen from (``logits [rows of the piece, V]``,
    after the processors; :mod:`draftwise.logprobs`); appended to ``sequence.logprobs``."""
    if sequence.logprobs is None:
        return None
    entries = token_logprobs(logits[rows[:len(chunk)]], chunk, sequence.params, sequence.params.logprobs)
    sequence.logprobs.extend(entries)
    return entries


def _add_prompt_logprobs(sequence: BatchSequence, start: int, rows: torch.Tensor) -> None:
    """A prompt chunk written at positions ``start..`` ran with logits on every row (``rows [chunk, V]``, raw):
    row r gives the prompt token at ``start + r + 1`` its log-probability, up to the prompt's last token (the
    last prompt row chooses the first output token)."""
    targets = sequence.prompt[start + 1:start + 1 + rows.shape[0]]
    sequence.prompt_logprobs.extend(token_logprobs(rows[:len(targets)], targets, None,
                                                   sequence.params.prompt_logprobs))
