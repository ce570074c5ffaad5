"""The engine's own time per step (verification, sampling, bookkeeping, the caller's work between steps): measured
by the engine core, priced into every step by the one cost model (AutoK, the load-aware K, the hybrid's sides),
so that where passes are short, fewer and longer steps win."""

from __future__ import annotations

import time

import pytest
import torch

from draftwise.backends.base import ForwardOutput
from draftwise.config import SamplingParams
from draftwise.speculation.controller import AutoK
from draftwise.speculation.cost_model import CostModel, PassCostCurve, StepOverhead
from draftwise.engine import EngineCore, SpeculativeEngine
from draftwise.proposers.base import PerSequenceProposers
from draftwise.proposers.base import DraftProposal, SequenceProposer
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.hybrid import HybridProposer
from draftwise.proposers.ngram import NgramProposer
from draftwise.proposers.suffix import SuffixDraft, SuffixProposer
from fakes import BigramLM, ScriptedProposer, peaked_table
from test_hybrid import FakeCosts

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


# ---------------------------------------------------------------------------------------------- the cost model
def test_a_step_costs_its_passes_and_the_overhead_plain_steps_too():
    costs = CostModel((0.010, 0.016, 0.022), 0.002, step_overhead_seconds=0.03)
    assert costs.step_cost(0) == pytest.approx(0.010 + 0.03)
    assert costs.step_cost(2) == pytest.approx(2 * 0.002 + 0.022 + 0.03)
    assert CostModel.from_dict(costs.to_dict()) == costs
    assert CostModel.from_dict({"verify_seconds": [0.01]}).step_overhead_seconds == 0.0  # older files
    with pytest.raises(ValueError, match="step_overhead_seconds"):
        CostModel((0.01,), step_overhead_seconds=-1.0)


def test_the_overhead_favours_longer_steps():
    """A draft row adding 60% to a short pass does not pay at acceptance 0.5 (1.5 tokens for 1.6 passes), but it
    does when every step also pays 30 ms of the engine's own work (1.5 tokens for 46 ms against 1 for 40 ms)."""
    passes = (0.010, 0.016, 0.022)
    assert CostModel(passes).best_k(0.5, 2) == 0
    assert CostModel(passes, step_overhead_seconds=0.03).best_k(0.5, 2) > 0


def test_step_overhead_is_a_windowed_median():
    meter = StepOverhead(window=3)
    assert meter.seconds == 0.0 and len(meter) == 0
    for seconds in (0.001, 0.002, 5.0):  # one caller pause does not move the median
        meter.observe(seconds)
    assert meter.seconds == 0.002
    for seconds in (0.004, 0.004):  # the window forgets the oldest steps
        meter.observe(seconds)
    assert meter.seconds == 0.004 and len(meter) == 3
    meter.observe(-1e-6)  # timer noise counts as 0
    assert meter.seconds == 0.004
    with pytest.raises(ValueError):
        StepOverhead(window=0)


# ---------------------------------------------------------------------------------------------- the engine
def _target():
    return BigramLM(peaked_table(16, seed=3))


def test_the_engine_counts_the_callers_time_between_busy_steps():
    core = EngineCore(_target())
    sequence = core.add([1, 2, 3], GREEDY)
    while not sequence.finish_reason:
        core.step()
        time.sleep(0.02)  # the caller's own work per step (a server streaming the step's text)
    assert core.step_overhead.seconds >= 0.015
    assert core.last_step.overhead_s == core.step_overhead.seconds  # reported with the step (metrics)


@pytest.mark.parametrize("leaves", ["finished", "cancelled"])
def test_idle_time_between_requests_is_not_overhead(leaves):
    """Also when the last request left by a cancel (a stop string, a client gone) rather than by finishing."""
    core = EngineCore(_target())
    core.step_overhead = StepOverhead(window=1)  # the last step alone
    if leaves == "finished":
        core.generate([[1, 2, 3]], GREEDY)
    else:
        sequence = core.add([1, 2, 3], GREEDY)
        core.step()
        core.step()
        core.cancel(sequence)
    time.sleep(0.5)  # idle: nothing runs
    core.add([4, 5], GREEDY)
    core.step()
    assert core.step_overhead.seconds < 0.25


class _HiddenBigram(BigramLM):
    """A bigram target that also returns (zero) hidden states."""

    supports_hidden_states = True

    def forward(self, token_ids, *, num_logits=None, return_hidden=False, hidden_rows=None) -> ForwardOutput:
        out = super().forward(token_ids, num_logits=num_logits)
        rows = hidden_rows or out.logits.shape[0]
        return ForwardOutput(out.logits, torch.zeros(rows, 4) if return_hidden else None)


class _SlowObserver(SequenceProposer):
    """Reads the target's features (as Medusa and EAGLE do), slowly, and never drafts."""

    name = "slow-observer"
    needs_target_hidden = True

    def observe(self, hidden, next_token_ids) -> None:
        time.sleep(0.02)

    def propose(self, context_ids, k, params, sampler) -> DraftProposal:
        return DraftProposal(token_ids=())


def test_a_proposer_reading_features_is_draft_time_not_overhead():
    """Its observe time is the request's draft time (AutoK prices it there); counted as overhead too, it would
    be priced twice."""
    engine = SpeculativeEngine(_HiddenBigram(peaked_table(16, seed=3)), _SlowObserver(), 2)
    result = engine.generate([1, 2, 3], GREEDY)
    assert result.stats.draft_time_s >= 0.02 * (len(result.token_ids) - 1)  # every step but the last observes
    assert engine.core.step_overhead.seconds < 0.01


def test_the_load_aware_k_prices_the_overhead_into_the_pass():
    curve = PassCostCurve(smoothing=1.0, points={1: 0.010, 2: 0.016})
    core = EngineCore(_target(), PerSequenceProposers(lambda: NgramProposer(1, 3), "ngram"), 2, k_policy="auto",
                      pass_costs=curve)
    for _ in range(3):
        core.step_overhead.observe(0.03)
    pricing = core._pricing(base_rows=1, sequences=1)
    assert pricing.pass_seconds(1) == pytest.approx(0.010 + 0.03)
    assert pricing.pass_seconds(2) == pytest.approx(0.016 + 0.03)


def test_scripted_costs_stay_scripted():
    """With ``learn_costs=False`` the given pass costs alone price a step (tests script them)."""
    curve = PassCostCurve(smoothing=1.0, points={1: 0.010, 2: 0.016})
    core = EngineCore(_target(), PerSequenceProposers(lambda: NgramProposer(1, 3), "ngram"), 2, k_policy="auto",
                      pass_costs=curve, learn_costs=False)
    core.step_overhead.observe(0.03)
    assert core._pricing(base_rows=1, sequences=1).pass_seconds(1) == pytest.approx(0.010)


def test_autok_prices_the_overhead_the_engine_reports():
    costs = CostModel((0.010, 0.016, 0.022))
    controller = AutoK(costs, 2)
    controller.observe(0, 0, 0.0, 0.010, overhead_s=0.03)
    assert controller.costs().step_overhead_seconds == pytest.approx(0.03)
    assert controller.step_cost(0) == pytest.approx(0.040)
    assert controller.costs().best_k(0.5, 2) > 0 == costs.best_k(0.5, 2)


# ---------------------------------------------------------------------------------------------- the hybrid
def test_the_hybrid_drafts_with_its_model_when_steps_carry_overhead():
    """With no suffix match the choice is the draft model or a plain step. A draft token as dear as a target pass
    (c = 1) never pays on the passes alone; with 10 s of the engine's own work per step it does."""
    costs = FakeCosts(draft_seconds_per_token=1.0)
    proposer = HybridProposer(SuffixProposer(), DraftModelProposer(BigramLM(peaked_table(8, 1)), 8), costs, max_k=4,
                              learn_costs=False)
    assert proposer.choose(SuffixDraft(), 4) == "suffix"  # an empty suffix draft: a plain step
    assert proposer.choose(SuffixDraft(), 4, step_seconds=lambda rows: costs.verify_cost(rows) + 10.0) == "draft_model"


class _PricedProposer(ScriptedProposer):
    """Records the pricing the engine hands over."""

    wants_pricing = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pricings = []

    def propose(self, context_ids, k, params, generator, *, pricing=None):
        self.pricings.append(pricing)
        return super().propose(context_ids, k, params, generator)


def test_a_one_request_engine_prices_steps_for_a_proposer_that_wants_it():
    target = _target()
    oracle = SpeculativeEngine(target).generate([1, 2, 3], GREEDY).token_ids
    proposer = _PricedProposer(3, oracle, 16)
    result = SpeculativeEngine(target, proposer, 2).generate([1, 2, 3], GREEDY)
    assert result.token_ids == oracle
    assert proposer.pricings and all(p is not None for p in proposer.pricings)  # measured at the engine's start
    assert proposer.pricings[-1].pass_seconds(3) > 0


def test_a_rejected_probe_is_charged_its_extra_time_beyond_a_plain_step():
    """A probe's measured time (draft + target) holds no engine overhead; its extra cost over a plain step is
    compared with the plain step's passes, or a large overhead would hide a slow probe (a draft catching up) and
    the re-probes would come as often as if it cost nothing."""
    controller = AutoK(CostModel((0.010, 0.011), 0.008), 1, probe_budget=0.02)
    assert controller.choose_k() == 1  # the first probe: a perfect draft would pay, the prior does not
    controller.observe(1, 0, 0.050, 0.011, overhead_s=0.06)  # rejected; 49 ms more than a plain step's passes
    assert controller.backoff.interval >= 0.049 / (0.02 * (0.010 + 0.06))  # 35 plain steps, not the doubled 32


def test_a_failed_pricing_measurement_leaves_steps_unpriced(monkeypatch, caplog):
    """The pass costs a pricing proposer wants are an optimisation: a backend that cannot be timed that way builds
    an engine whose steps go unpriced (the proposer falls back to its own costs), not a failure."""
    def broken(self):
        raise RuntimeError("cannot time this backend")

    monkeypatch.setattr(EngineCore, "calibrate", broken)
    target = _target()
    oracle = SpeculativeEngine(target).generate([1, 2, 3], GREEDY).token_ids
    proposer = _PricedProposer(3, oracle, 16)
    with caplog.at_level("WARNING"):
        engine = SpeculativeEngine(target, proposer, 2)
    assert "could not measure the pass costs" in caplog.text and engine.core.pass_costs is None
    assert engine.generate([1, 2, 3], GREEDY).token_ids == oracle
    assert proposer.pricings and all(p is None for p in proposer.pricings)


def test_keeping_a_finished_sequence_is_not_overhead(monkeypatch):
    """A finishing sequence's export to the prefix cache is paid once per request, not per step."""
    from draftwise.prefix_cache import PrefixCache

    keep = EngineCore._keep

    def slow_keep(self, sequence):
        time.sleep(0.1)
        keep(self, sequence)

    monkeypatch.setattr(EngineCore, "_keep", slow_keep)
    core = EngineCore(_target(), prefix_cache=PrefixCache(1 << 20))
    core.step_overhead = StepOverhead(window=1)  # the last step alone: the one that finished the request
    core.generate([[1, 2, 3]], GREEDY)
    assert core.step_overhead.seconds < 0.05
