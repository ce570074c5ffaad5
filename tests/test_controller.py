"""The cost-model K controller: scripted costs and scripted acceptance, no timing."""

from __future__ import annotations

import pytest

from draftwise.calibration import CostModel
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.controller import (
    SPECULATION_DISABLED_NOTE,
    SPECULATION_UNPROFITABLE_NOTE,
    AcceptanceEstimator,
    AutoK,
    FixedK,
    expected_tokens,
    k_controller_factory,
    leviathan_expected_tokens,
)
from draftwise.engine import SpeculativeEngine
from fakes import BigramLM, ScriptedProposer, peaked_table

# A GPU-like curve: verifying k tokens costs little more than one; drafting is cheap.
CHEAP_VERIFY = CostModel(verify_seconds=tuple(1.0 + 0.05 * j for j in range(9)), draft_seconds_per_token=0.02)
# The 2-core CPU with llama.cpp (../shared/MODELS.md): k tokens cost 1.5x (k=2) .. 3x (k=5); draft = 0.5 step.
CPU_LLAMA = CostModel(verify_seconds=(0.083, 0.13, 0.17, 0.2, 0.25, 0.3), draft_seconds_per_token=0.041)


def run_scripted(controller: AutoK, steps: int, accepted) -> list[int]:
    """Drive a controller: ``accepted(step, k)`` says how many of k drafted tokens the target accepts."""
    for step in range(steps):
        k = controller.choose_k()
        controller.observe(k, accepted(step, k), 0.0, 0.0)
    return controller.history


def test_expected_tokens_is_leviathans_formula_for_a_constant_rate():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in range(6):
            assert expected_tokens([alpha] * k) == pytest.approx(leviathan_expected_tokens(alpha, k))
    assert expected_tokens([1.0, 0.5, 0.0]) == pytest.approx(1 + 1 + 0.5)


def test_estimator_learns_per_position_rates_and_forgets():
    estimator = AcceptanceEstimator(4, decay=0.98)
    for _ in range(200):
        estimator.observe(4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never looked at
    a1, a2, a3, a4 = estimator.rates(4)
    assert a1 > 0.95 and a2 > 0.95 and a3 < 0.06
    assert 0.6 < a4 < 0.7  # no evidence: the pooled rate (2 of 3 looked-at positions accepted)
    estimator = AcceptanceEstimator(4, decay=0.9)
    for _ in range(60):
        estimator.observe(4, 4)
    for _ in range(60):
        estimator.observe(4, 0)
    assert estimator.rates(1)[0] < 0.05  # old successes forgotten
    with pytest.raises(ValueError):
        estimator.observe(2, 3)


@pytest.mark.parametrize("costs", [CHEAP_VERIFY, CostModel((1.0, 1.2, 1.25, 1.3, 1.35, 1.4, 1.5, 1.6, 1.7), 0.0)])
def test_always_wrong_proposer_turns_speculation_off(costs):
    controller = AutoK(costs, 8, learn_costs=False)
    history = run_scripted(controller, 200, lambda step, k: 0)
    assert history[0] > 0  # starts optimistic
    first_off = history.index(0)
    assert first_off < 40
    tail = history[first_off:]
    assert sum(1 for k in tail if k > 0) <= 6  # only rare, small probes afterwards
    assert max(tail) == 1
    assert controller.notes() == [SPECULATION_DISABLED_NOTE]


@pytest.mark.parametrize("costs", [CHEAP_VERIFY, CPU_LLAMA])
def test_always_right_proposer_speculates(costs):
    max_k = costs.max_k
    controller = AutoK(costs, max_k, learn_costs=False)
    history = run_scripted(controller, 100, lambda step, k: k)
    assert all(k > 0 for k in history)
    if costs is CHEAP_VERIFY:
        assert history[-1] == max_k  # verification is nearly free: speculate as far as allowed
    assert controller.notes() == []


def test_cpu_costs_need_high_acceptance():
    """With the CPU curve, a draft must be right about 98% of the time to pay ."""
    controller = AutoK(CPU_LLAMA, 5, learn_costs=False)
    assert 0.97 < controller.break_even_acceptance() < 0.99
    assert controller.best_k([0.95] * 5) == 0
    assert controller.best_k([0.99] * 5) > 0


def test_break_even_matches_the_closed_form():
    # v(j) = 1 + 0.5 (j - 1), free drafts: K = 1 pays when (1 + a) / 1.5 > 1, i.e. a > 0.5 (larger K need more).
    costs = CostModel(tuple(1.0 + 0.5 * j for j in range(5)), 0.0)
    assert AutoK(costs, 4, learn_costs=False).break_even_acceptance() == pytest.approx(0.5, abs=1e-6)


def test_probes_back_off_and_resume_when_the_draft_recovers():
    controller = AutoK(CHEAP_VERIFY, 8, learn_costs=False, probe_interval=8, max_probe_interval=32)
    recover_at = 300
    history = run_scripted(controller, 400, lambda step, k: k if step >= recover_at else 0)
    off = history.index(0)
    probes = [i for i in range(off, recover_at) if history[i] > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 5
    assert gaps == sorted(gaps) and gaps[-1] == 32 + 1  # the interval doubles up to its cap
    # after the draft recovers, a successful probe is followed by larger ones and speculation resumes
    resumed = history[recover_at + 40 :]
    assert all(k > 0 for k in resumed) and resumed[-1] == 8


def test_expensive_failed_probes_are_spaced_by_the_budget():
    """A failed probe that costs 5 plain steps more (a draft model catching up) must wait >= 5 / 0.1 steps."""
    controller = AutoK(CHEAP_VERIFY, 8, learn_costs=False, probe_budget=0.1, probe_interval=4)
    for _ in range(300):
        k = controller.choose_k()
        controller.observe(k, 0, 5.0 if k else 0.0, CHEAP_VERIFY.verify_cost(k + 1))
    history = controller.history
    off = history.index(0)
    probes = [i for i in range(off, len(history)) if history[i] > 0]
    assert probes[0] - off == 4  # the first re-probe comes after probe_interval plain steps
    assert all(b - a >= 5.05 / 0.1 for a, b in zip(probes, probes[1:]))


def test_empty_probe_stays_pending():
    controller = AutoK(CHEAP_VERIFY, 4, learn_costs=False, probe_interval=4)
    run_scripted(controller, 100, lambda step, k: 0)
    # an n-gram proposer without a match drafts nothing: the probe is retried at the next step
    while controller.choose_k() == 0:
        controller.observe(0, 0, 0.0, 0.0)
    controller.observe(0, 0, 0.0, 0.0)
    assert controller.choose_k() > 0


def test_costs_that_cannot_pay_disable_speculation_without_probes():
    costs = CostModel((1.0, 2.0, 3.0, 4.0), draft_seconds_per_token=0.5)  # even a perfect draft loses
    controller = AutoK(costs, 3, learn_costs=False)
    assert not controller.can_pay() and controller.break_even_acceptance() == 1.0
    history = run_scripted(controller, 100, lambda step, k: k)
    assert history == [0] * 100
    assert controller.notes() == [SPECULATION_UNPROFITABLE_NOTE]


def test_learned_costs_follow_the_measured_times():
    """Calibration said drafting is free; the engine reports 1 s per draft token and 0.1 s per pass."""
    costs = CostModel(tuple(0.1 for _ in range(5)), draft_seconds_per_token=0.0)
    controller = AutoK(costs, 4, cost_smoothing=0.5)
    for _ in range(20):
        k = controller.choose_k()
        controller.observe(k, k, 1.0 * k, 0.2)
    assert controller.verify_scale == pytest.approx(2.0, rel=0.01)
    assert controller.draft_seconds_per_token >= 0.5  # learned from the drafting steps before K went to 0
    assert controller.history[0] == 4 and controller.history[-1] == 0
    assert SPECULATION_UNPROFITABLE_NOTE in controller.notes()


def test_invalid_arguments():
    with pytest.raises(ValueError):
        AutoK(CHEAP_VERIFY, 0)
    with pytest.raises(ValueError):
        AutoK(CHEAP_VERIFY, 4, probe_k=5)
    with pytest.raises(ValueError):
        AcceptanceEstimator(4, prior_mean=1.0)
    with pytest.raises(ValueError):
        CostModel(())
    with pytest.raises(ValueError):
        SpeculativeConfig(method="ngram", k_policy="sometimes")
    with pytest.raises(ValueError):
        k_controller_factory("auto", 4)
    assert isinstance(k_controller_factory("fixed", 3)(), FixedK)
    assert SpeculativeConfig(method="ngram").k_policy == "fixed"


# ---------------------------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def bigram_case():
    target = BigramLM(peaked_table(32, seed=11))
    prompt, params = [4, 5], SamplingParams(max_tokens=150, ignore_eos=True)
    oracle = SpeculativeEngine(target).generate(prompt, params).token_ids
    return target, prompt, params, oracle


def auto_engine(target, proposer, max_k=4, costs=CHEAP_VERIFY, **options):
    controllers: list[AutoK] = []

    def factory():
        controllers.append(AutoK(costs, max_k, learn_costs=False, **options))
        return controllers[-1]

    return SpeculativeEngine(target, proposer, max_k, controller_factory=factory), controllers


def test_engine_with_always_wrong_proposer_is_exact_and_mostly_plain(bigram_case):
    target, prompt, params, oracle = bigram_case
    engine, controllers = auto_engine(target, ScriptedProposer(len(prompt), oracle, 32, wrong_at=0))
    result = engine.generate(prompt, params)
    assert result.token_ids == oracle
    stats = result.stats
    assert stats.num_accepted_tokens == 0
    assert stats.k_history[-40:].count(0) >= 36
    assert stats.warnings == [SPECULATION_DISABLED_NOTE]
    assert controllers[0].history[: len(stats.k_history)][:1] == stats.k_history[:1]


def test_engine_with_always_right_proposer_speculates_fully(bigram_case):
    target, prompt, params, oracle = bigram_case
    engine, _ = auto_engine(target, ScriptedProposer(len(prompt), oracle, 32, extend=[0] * 10))
    result = engine.generate(prompt, params)
    assert result.token_ids == oracle
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.k_history.count(4) >= len(result.stats.k_history) - 2  # only the last steps are clamped
    assert result.stats.warnings == []


def test_engine_with_cpu_costs_and_a_mediocre_draft_stays_plain(bigram_case):
    """Wrong at position 2 (acceptance 2/3 on K >= 3): on the CPU curve that loses, so K goes to 0."""
    target, prompt, params, oracle = bigram_case
    engine, controllers = auto_engine(target, ScriptedProposer(len(prompt), oracle, 32, wrong_at=2), max_k=5,
                                      costs=CPU_LLAMA)
    result = engine.generate(prompt, params)
    assert result.token_ids == oracle
    second_half = result.stats.k_history[len(result.stats.k_history) // 2 :]
    assert second_half.count(0) >= 0.8 * len(second_half)
    assert SPECULATION_DISABLED_NOTE in result.stats.warnings
