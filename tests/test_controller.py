"""The cost-model K controller: scripted costs and scripted acceptance, no timing."""

from __future__ import annotations

import random

import pytest

from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.speculation.controller import (
    CATCH_UP_NOTE,
    SPECULATION_DISABLED_NOTE,
    SPECULATION_UNPROFITABLE_NOTE,
    AcceptanceEstimator,
    AutoK,
    AutoKMemory,
    FixedK,
    KController,
    expected_tokens,
    k_controller_factory,
    leviathan_expected_tokens,
)
from draftwise.speculation.cost_model import CostModel
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
    estimator = AcceptanceEstimator(4, decay=0.98, position_strength=4.0)
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
    # learned from the drafting steps (all K = 4) before K went to 0: 4 s per step, which with one K cannot be
    # split into per-token and per-step parts (fit_draft_cost keeps the calibrated 0 s per token)
    assert controller.costs().draft_cost(4) >= 2.0
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


# ---------------------------------------------------------------------------------------------- simulated requests
# A deterministic simulator: the draft is right or wrong on each output token (a fixed sequence, so every
# policy faces the same text), a step's time is the cost model's, and a draft model pays the catch-up
# prefill of every context token it has not seen. No clock is read.
def right_tokens(n: int, alpha: float | None = None, runs: tuple[int, int] | None = None, seed: int = 0) -> list[bool]:
    """Whether the draft's guess is right at each output position: i.i.d. with probability ``alpha``, or in
    runs of ``runs[0]`` right (97%) then ``runs[1]`` wrong tokens (copied text for n-gram lookup)."""
    rng = random.Random(seed)
    if runs is not None:
        return [j % sum(runs) < runs[0] and rng.random() < 0.97 for j in range(n)]
    return [rng.random() < alpha for _ in range(n)]


def simulate(controller: KController, costs: CostModel, right: list[bool], prompt_tokens: int,
             max_tokens: int, answer_tokens: int | None = None) -> float:
    """Simulated seconds of one request (prefill excluded, as it is the same for every policy); the answer ends
    after ``answer_tokens`` (its EOS, unknown to the controller) or ``max_tokens``."""
    controller.start(prompt_tokens, max_tokens)
    generated, seconds, behind, context = 1, 0.0, prompt_tokens + 1, prompt_tokens + 1
    while generated < min(max_tokens, answer_tokens or max_tokens):
        k = max(0, min(controller.choose_k(), max_tokens - generated - 1))  # the engine's clamp
        accepted = 0
        while accepted < k and right[generated + accepted]:
            accepted += 1
        draft_s = costs.catch_up_cost(behind - 1, context) + costs.draft_cost(k, context) if k else 0.0
        target_s = costs.verify_cost(k + 1, context)
        seconds += draft_s + target_s
        behind = 1 if k else behind + accepted + 1
        generated += accepted + 1
        context += accepted + 1
        controller.observe(k, accepted, draft_s, target_s)
    return seconds


CPU_NGRAM = CostModel(CPU_LLAMA.verify_seconds, draft_seconds_per_token=1e-5)
# A 0.5B draft for a 1.5B target on the CPU: the draft's prefill costs 7 ms a token, and passes slow down as
# the context grows (10% per 1,000 tokens for the target, 20% for the draft).
CPU_DRAFT = CostModel(CPU_LLAMA.verify_seconds, draft_seconds_per_token=0.02, draft_prefill_seconds_per_token=0.007,
                      context_len=200, target_context_growth=1e-4, draft_context_growth=2e-4)

SCENARIOS = {  # name: (costs, draft right at each output token, max K, prompt tokens, max_tokens)
    "gpu, good draft": (CHEAP_VERIFY, right_tokens(500, 0.9), 8, 50, 400),
    "gpu, mediocre draft": (CHEAP_VERIFY, right_tokens(500, 0.5), 8, 50, 400),
    "gpu, wrong draft": (CHEAP_VERIFY, [False] * 500, 8, 50, 400),
    "cpu, draft right 90%": (CPU_LLAMA, right_tokens(500, 0.9), 5, 50, 400),
    "cpu, draft right 98%": (CPU_LLAMA, right_tokens(500, 0.98), 5, 50, 400),
    "cpu, n-gram right 80%": (CPU_NGRAM, right_tokens(500, 0.8), 5, 50, 400),
    "cpu, n-gram in copied runs": (CPU_NGRAM, right_tokens(500, runs=(30, 20)), 5, 50, 400),
    "cpu, long prompt, 96 tokens": (CPU_DRAFT, right_tokens(500, 0.9), 4, 3100, 96),
    "cpu, long prompt, 2000 tokens": (CPU_DRAFT, right_tokens(2100, 0.98), 4, 3100, 2000),
    "cpu, short prompt, good draft": (CPU_DRAFT, right_tokens(500, 0.98), 4, 50, 400),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_auto_is_never_slower_than_the_best_fixed_choice(name):
    """Issue 15's goal, on simulated prompt classes: auto >= 0.97 x max(plain, best fixed K), for the first
    request on a fresh engine and for the later ones that start from what the engine learned."""
    costs, right, max_k, prompt_tokens, max_tokens = SCENARIOS[name]
    fixed = {k: simulate(FixedK(k), costs, right, prompt_tokens, max_tokens) for k in range(max_k + 1)}
    factory = k_controller_factory("auto", max_k, costs)
    for request in range(3):
        auto = simulate(factory(), costs, right, prompt_tokens, max_tokens)
        # at 98% on the CPU curve plain, K=3 and K=4 are within 1.3% of each other: the first request's probes
        # and the optimism of the acceptance bounds (a few steps at a worse K) cost up to 3.5% there
        floor = 0.965 if name == "cpu, draft right 98%" else 0.97
        assert min(fixed.values()) / auto >= floor, (request, auto, fixed)


def right_by_depth(n: int, rates: list[float], seed: int) -> list[bool]:
    """Whether the draft's guess is right at each output position, with probability ``rates[d]`` at depth d of
    the current run of right guesses (the last rate beyond): a draft whose conditional acceptance varies with
    the position in its draft, as measured per Spec-Bench category."""
    rng, out, depth = random.Random(seed), [], 0
    for _ in range(n):
        out.append(rng.random() < rates[min(depth, len(rates) - 1)])
        depth = depth + 1 if out[-1] else 0
    return out


# The bench's pair on this CPU (Qwen2.5-Coder 1.5B int8 target, 0.5B llama.cpp draft): target 78.5 ms a token,
# draft 13.4 ms a token + 7 ms a step, catch-up 3.5 ms a token.
CPU_QWEN = CostModel(tuple(0.0785 * r for r in (1.0, 1.04, 1.04, 1.05, 1.11)), draft_seconds_per_token=0.0134,
                     draft_prefill_seconds_per_token=0.0035, draft_step_seconds=0.007)


def test_a_few_unlucky_first_drafts_do_not_switch_a_good_draft_off_for_good():
    """Roleplay's measured conditional acceptance by position (0.62, 0.52, 0.57, 0.77; K=2 is 1.36x plain):
    with the plain estimate, 6 of 100 fresh engines whose first drafts were rejected decoded every later
    request plainly (a re-probe's catch-up never fit the probe budget, and the engine's memory kept the low
    estimate). With upper confidence bounds none does, and every engine stays within 10% of the best fixed K."""
    rates = [0.62, 0.52, 0.57, 0.77]
    for seed in range(30):
        factory = k_controller_factory("auto", 4, CPU_QWEN, prior_strength=4.0)
        auto = best = 0.0
        for request in range(3):
            right = right_by_depth(400, rates, seed * 10 + request)
            controller = factory()
            auto += simulate(controller, CPU_QWEN, right, 60, 128)
            best += min(simulate(FixedK(k), CPU_QWEN, right, 60, 128) for k in range(5))
        assert sum(controller.history) > 0, seed
        assert best / auto >= 0.9, (seed, best / auto)


def test_long_prompt_with_few_new_tokens_never_pays_the_catch_up():
    """Two 3,100-token prompts with 96 new tokens lost to plain with the draft at fixed K=4 (0.77x): the
    catch-up prefill (22 s here) cannot be earned back over 96 tokens, so auto decodes plainly."""
    costs, right, _, prompt_tokens, max_tokens = SCENARIOS["cpu, long prompt, 96 tokens"]
    plain = simulate(FixedK(0), costs, right, prompt_tokens, max_tokens)
    assert simulate(FixedK(4), costs, right, prompt_tokens, max_tokens) > 2 * plain
    memory = AutoKMemory.fresh(4)
    for _ in range(2):  # also once the engine knows the draft is good
        controller = AutoK(costs, 4, memory=memory)
        assert simulate(controller, costs, right_tokens(500, 1.0), prompt_tokens, max_tokens) == pytest.approx(plain)
        assert set(controller.history) == {0} and CATCH_UP_NOTE in controller.notes()
    # the same draft on a short prompt, or with enough new tokens to earn the catch-up back, is switched on at once
    # when the catch-up is priced against the remaining max_tokens (eager)
    for prompt, new_tokens in ((50, max_tokens), (prompt_tokens, 2000)):
        eager = AutoK(costs, 4, memory=memory, catch_up="eager")
        simulate(eager, costs, right_tokens(3000, 1.0), prompt, new_tokens)
        assert eager.history[0] > 0
    # the default (deferred, ski rental) drafts on the short prompt once the tokens generated so far would have
    # repaid its catch-up; the 2,000 tokens after 3,100 would repay it only after 1,350, when fewer remain: plain
    # throughout, at most one catch-up (21.7 s) behind eager
    deferred = AutoK(costs, 4, memory=memory)
    simulate(deferred, costs, right_tokens(3000, 1.0), 50, max_tokens)
    assert deferred.history[0] == 0 and max(deferred.history) > 0
    eager_s = simulate(AutoK(costs, 4, memory=memory, catch_up="eager"), costs, right_tokens(3000, 1.0),
                       prompt_tokens, 2000)
    deferred_s = simulate(AutoK(costs, 4, memory=memory), costs, right_tokens(3000, 1.0), prompt_tokens, 2000)
    assert eager_s < deferred_s <= eager_s + costs.catch_up_cost(prompt_tokens, prompt_tokens + 1)


def test_catch_up_is_learned_from_the_measured_draft_times():
    """Calibration says catch-up costs 1 ms a token; the first drafting step after a 100-token prompt takes 1 s
    more than drafting: the controller learns 10 ms per caught-up token and prices the next catch-up with it."""
    costs = CostModel(CHEAP_VERIFY.verify_seconds, draft_seconds_per_token=0.02, draft_prefill_seconds_per_token=0.001)
    memory = AutoKMemory.fresh(4)
    first = AutoK(costs, 4, memory=memory, catch_up_smoothing=1.0)
    first.start(100, 200)  # the draft has 101 tokens to read: 100 of catch-up, one fed in any drafting step
    k = first.choose_k()
    assert k > 0
    first.observe(k, k, 1.0 + 0.02 * k, costs.verify_cost(k + 1))
    assert first.catch_up_seconds_per_token == pytest.approx(0.01)
    second = AutoK(costs, 4, memory=memory)
    second.start(1000, 200)
    assert second.catch_up_cost() == pytest.approx(10.0)


def test_stale_costs_are_re_probed_with_backoff():
    """Calibration (stale: the draft was timed on a busy machine) says even a perfect draft loses; with learning
    on, the controller still probes, learns the real costs and speculates."""
    stale = CostModel((1.0, 1.05, 1.1, 1.15), draft_seconds_per_token=2.0)
    real = CostModel((1.0, 1.05, 1.1, 1.15), draft_seconds_per_token=0.01)
    controller = AutoK(stale, 3, probe_interval=4, max_probe_interval=64)
    assert not controller.can_pay()
    history = []
    for _ in range(200):
        k = controller.choose_k()
        history.append(k)
        controller.observe(k, k, real.draft_cost(k), real.verify_cost(k + 1))
    probes = [i for i, k in enumerate(history) if k > 0]
    # plain first; the first re-probe waits until the probe's predicted extra cost (2.05 plain steps with the
    # stale costs) is within the 2% probe budget: 103 plain steps
    assert history[:103] == [0] * 103 and probes[0] == 103
    assert history[-1] == 3 and controller.can_pay()
    assert SPECULATION_UNPROFITABLE_NOTE in controller.notes()


def test_probes_on_the_unprofitable_path_back_off():
    """Costs that really cannot pay: the probes that re-check them thin out (doubling intervals)."""
    costs = CostModel((1.0, 2.0, 3.0, 4.0), draft_seconds_per_token=0.5)
    controller = AutoK(costs, 3, probe_interval=4, max_probe_interval=64)
    for _ in range(400):
        k = controller.choose_k()
        controller.observe(k, k, costs.draft_cost(k), costs.verify_cost(k + 1))
    probes = [i for i, k in enumerate(controller.history) if k > 0]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert 3 <= len(probes) <= 12 and gaps == sorted(gaps) and max(gaps) >= 64


def test_the_engine_memory_carries_acceptance_across_requests():
    """A draft that is always right: the first request starts from the weak prior, the second at once at the
    K the first one learned (the factory hands every controller the same memory; nothing is global)."""
    factory = k_controller_factory("auto", 5, CPU_NGRAM)
    right = [True] * 500
    first = factory()
    simulate(first, CPU_NGRAM, right, 20, 100)
    second = factory()
    simulate(second, CPU_NGRAM, right, 20, 100)
    assert first.memory is second.memory and first.memory.num_requests == 2
    best = CPU_NGRAM.best_k(1.0, 5)
    assert second.history[0] == best
    fresh = AutoK(CPU_NGRAM, 5)
    assert all(s > f for s, f in zip(AutoK(CPU_NGRAM, 5, memory=first.memory).acceptance(5), fresh.acceptance(5)))
    other_engine = k_controller_factory("auto", 5, CPU_NGRAM)()
    assert other_engine.memory is not first.memory and other_engine.history == []


def test_engine_calls_start_with_the_request():
    target = BigramLM(peaked_table(32, seed=11))
    controllers: list[AutoK] = []

    def factory():
        controllers.append(AutoK(CHEAP_VERIFY, 4, learn_costs=False))
        return controllers[-1]

    engine = SpeculativeEngine(target, ScriptedProposer(3, [], 32, wrong_at=0), 4, controller_factory=factory)
    engine.generate([4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    controller = controllers[0]
    # a wrong draft: one token per step; the engine does not report the last step (it ends the request)
    assert controller._context_len == 3 + 20 - 1 and controller._remaining == 1


def test_a_draft_model_prior_survives_rejected_first_drafts():
    """Measured: a Qwen2.5-Coder 0.5B draft (acceptance 0.86 at fixed K) lost its first probe (the answer's
    opening token) and, with a prior worth one draft, decoded every later request plainly. The draft-model
    prior keeps speculating through more rejected first drafts than the weak prior, which still stops soon."""
    from draftwise.speculation.controller import MODEL_PRIOR_STRENGTH, k_controller_factory

    costs = CostModel((0.08, 0.085, 0.09, 0.095, 0.1), draft_seconds_per_token=0.025,
                      draft_prefill_seconds_per_token=0.001)
    rejections_survived = {}
    for strength in (1.0, MODEL_PRIOR_STRENGTH):
        controller = k_controller_factory("auto", 4, costs, prior_strength=strength, learn_costs=False)()
        controller.start(50, 200)
        ks = []
        for _ in range(6):
            ks.append(controller.choose_k())
            controller.observe(ks[-1], 0, 0.075, 0.085)  # rejected at its first token
        assert ks[0] > 0 and ks[-1] == 0, ks
        rejections_survived[strength] = ks.index(0)
    assert rejections_survived[MODEL_PRIOR_STRENGTH] >= 3 > rejections_survived[1.0]


def test_draft_cost_fit_separates_a_step_overhead_from_the_cost_per_token():
    from draftwise.speculation.controller import fit_draft_cost

    def moments(steps):
        n = len(steps)
        return [sum(k for k, _ in steps) / n, sum(t for _, t in steps) / n, sum(k * k for k, _ in steps) / n,
                sum(k * t for k, t in steps) / n]

    # a 2-token catch-up pass costs 1.8 one-token passes of 25 ms: t = 20 ms + 25 ms x K
    steps = [(k, 0.020 + 0.025 * k) for k in (1, 2, 3, 4, 3, 2)]
    b, a = fit_draft_cost(moments(steps), 0.026)
    assert b == pytest.approx(0.025) and a == pytest.approx(0.020)
    # K = 1 only: the calibrated per-token time stays, the rest is the step's overhead
    b, a = fit_draft_cost(moments([(1, 0.045)] * 5), 0.026)
    assert b == pytest.approx(0.026) and a == pytest.approx(0.019)
    # a stale (too slow) calibration gives way to the measurement
    b, a = fit_draft_cost(moments([(1, 0.01)] * 5), 2.0)
    assert b == pytest.approx(0.01) and a == 0.0



def test_a_deferred_catch_up_never_pays_for_a_short_answer_and_bounds_the_loss_on_a_long_one():
    """Ski rental (catch_up="deferred"): a rag-like 741-token prompt whose answer ends after 16 tokens (of 128
    allowed) lost the draft's 2.6 s catch-up with the eager horizon; deferred decodes it plainly. On a 128-token
    answer deferred loses at most about one catch-up to eager, and on a short prompt (a cheap catch-up) it is
    eager's equal."""
    right = right_by_depth(400, [0.85], seed=1)
    prompt, catch_up = 741, CPU_QWEN.catch_up_cost(741, 742)

    def run(mode: str, prompt_tokens: int, answer: int) -> float:
        return simulate(AutoK(CPU_QWEN, 4, catch_up=mode), CPU_QWEN, right, prompt_tokens, 128, answer)

    plain_short = simulate(FixedK(0), CPU_QWEN, right, prompt, 128, 16)
    assert run("eager", prompt, 16) > 2 * plain_short  # eager paid the catch-up for 16 tokens (3.04 s vs 1.18 s)
    assert run("deferred", prompt, 16) == pytest.approx(plain_short)
    eager_long, deferred_long = run("eager", prompt, 128), run("deferred", prompt, 128)
    assert eager_long < simulate(FixedK(0), CPU_QWEN, right, prompt, 128)  # where eager is right to pay
    assert deferred_long <= eager_long + 1.2 * catch_up
    assert run("deferred", 55, 128) <= 1.01 * run("eager", 55, 128)
    with pytest.raises(ValueError, match="catch_up must be one of"):
        AutoK(CPU_QWEN, 4, catch_up="lazy")


def test_hybrid_suffix_steps_leave_the_draft_model_behind_and_teach_nothing_of_its_costs():
    """``hybrid``: a step its suffix side drafted (``model_drafted=False``) leaves the draft model behind by the
    committed tokens, so the draft model's next step is read as a catch-up, not as a dear draft token (read so, a
    catch-up of the turn's context once passed for the cost of a few draft tokens: "even a perfect draft would be
    slower than plain", and the engine's memory kept hybrid plain on the later turns of an agent session); nor is
    the suffix side's near-free drafting read as the draft model's cost per token."""
    costs = CostModel(verify_seconds=(1.0, 1.1, 1.2, 1.3, 1.4), draft_seconds_per_token=0.1,
                      draft_prefill_seconds_per_token=0.02)
    controller = AutoK(costs, 4)
    controller.start(prompt_tokens=10, max_tokens=1000)
    controller.observe(4, 4, 0.4 + 10 * 0.02, 1.4)  # the draft model catches up on the prompt, then drafts
    for _ in range(20):
        controller.observe(4, 4, 0.001, 1.4, model_drafted=False)  # suffix steps: 100 tokens committed
    assert controller.catch_up_cost() == pytest.approx(100 * 0.02, rel=0.05)
    controller.observe(4, 4, 0.4 + 100 * 0.01, 1.4)  # the draft model's catch-up of them, faster than priced
    assert controller.draft_seconds_per_token == pytest.approx(0.1)
    assert controller.catch_up_seconds_per_token < 0.02
    assert controller.choose_k() > 0
