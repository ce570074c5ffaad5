"""The measured checks: prompt selection, the acceptance probe (identical, derived and padded-vocabulary
drafts), forward costs, predicted speed-up by K and the verdict."""

from __future__ import annotations

import pytest

from draftwise.benchmark import BenchPrompt, default_prompts_path
from draftwise.speculation.calibration import ForwardCosts, predicted_speedup
from draftwise.check.probe import (
    DEFAULT_PROBE_CATEGORIES,
    CostMeasurement,
    ProbePromptResult,
    ProbeResult,
    measure_costs,
    predict_speedups,
    run_acceptance_probe,
    select_probe_prompts,
)
from draftwise.check.verdict import break_even_alpha, speculation_verdict
from draftwise.commands.check import probe_prompts
from draftwise.config import SamplingParams
from draftwise.speculation.cost_model import expected_tokens_per_step
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import LoadedModel
from test_check_support import padded_copy, word_tokenizer

from conftest import tiny_llama

PROMPTS = [BenchPrompt("1", "coding", ("Once upon a time there was a dog.",)),
           BenchPrompt("2", "writing", ("The little girl saw a big tree.",))]


def test_select_probe_prompts_round_robin_preferred_first():
    prompts = [BenchPrompt(str(i), cat, ("x",)) for i, cat in enumerate(["rag", "rag", "qa", "coding", "coding"])]
    assert [p.id for p in select_probe_prompts(prompts, 4)] == ["3", "2", "0", "4"]
    assert [p.id for p in select_probe_prompts(prompts, 10)] == ["3", "2", "0", "4", "1"]
    with pytest.raises(ValueError):
        select_probe_prompts(prompts, 0)


def test_default_probe_prompts_span_categories():
    try:
        default_prompts_path()
    except FileNotFoundError:
        pytest.skip("Spec-Bench questions not found")
    chosen = probe_prompts(None, 5)
    assert [p.category for p in chosen] == list(DEFAULT_PROBE_CATEGORIES)


def _tiny(seed: int, name: str, layers: int = 2) -> LoadedModel:
    return LoadedModel(backend=tiny_llama(seed=seed, layers=layers), tokenizer=word_tokenizer(), name=name,
                       eos_token_ids=(1,))


WORD_PROMPTS = [BenchPrompt("a", "coding", ("w5 w9 w17 w33",)), BenchPrompt("b", "writing", ("w40 w41 w7",))]


def test_probe_with_an_identical_draft_accepts_everything():
    probe = run_acceptance_probe(_tiny(0, "t"), _tiny(0, "d"), WORD_PROMPTS, k=3, max_tokens=12, chat=False)
    assert probe.acceptance_rate == 1.0 and probe.draft_tokens > 0
    assert all(p.step_tokens == p.generated_tokens - 1 for p in probe.prompts)  # the first token is prefill's
    assert probe.mean_accepted_length > 3.0


def test_probe_with_an_unrelated_draft_accepts_little():
    probe = run_acceptance_probe(_tiny(0, "t"), _tiny(1, "d"), WORD_PROMPTS, k=3, max_tokens=12, chat=False)
    assert probe.acceptance_rate < 0.5


def test_probe_refuses_a_shared_backend():
    model = _tiny(0, "t")
    with pytest.raises(ValueError, match="share one backend"):
        run_acceptance_probe(model, model, WORD_PROMPTS, k=2, max_tokens=4)


def test_probe_with_a_derived_draft_counts_consistently(stories, stories_draft):
    probe = run_acceptance_probe(stories, stories_draft, PROMPTS[:2], k=3, max_tokens=8, chat=False)
    assert len(probe.prompts) == 2 and not probe.skipped
    for p in probe.prompts:
        assert 0 <= p.accepted_tokens <= p.draft_tokens
        assert p.generated_tokens <= 8 and p.step_tokens <= p.generated_tokens
    assert 0.0 <= probe.acceptance_rate <= 1.0
    assert probe.to_dict()["acceptance_rate"] == probe.acceptance_rate


def test_probe_skips_prompts_longer_than_the_context():
    long_prompt = BenchPrompt("long", "qa", ("w3 " * 300,))  # the tiny models hold 256 tokens
    probe = run_acceptance_probe(_tiny(0, "t"), _tiny(0, "d"), [long_prompt, WORD_PROMPTS[0]], k=2, max_tokens=4,
                                 chat=False)
    assert probe.skipped == ["long"] and len(probe.prompts) == 1


def test_padded_vocabulary_pair_speculates_exactly():
    """Target = draft with its vocabulary padded from 96 to 128 rows: the proposer pads the draft's logits,
    every draft token is accepted, and the output equals the target's plain greedy output."""
    draft = _tiny(3, "draft")
    draft_backend = draft.backend
    target_backend = type(draft_backend)(padded_copy(draft_backend.model, 128), name="padded")
    target = LoadedModel(backend=target_backend, tokenizer=word_tokenizer(), name="padded", eos_token_ids=(1,))
    probe = run_acceptance_probe(target, draft, WORD_PROMPTS[:1], k=4, max_tokens=24, chat=False)
    assert probe.draft_tokens > 0 and probe.acceptance_rate == 1.0
    params = SamplingParams(max_tokens=24)
    ids = target.encode(WORD_PROMPTS[0].text)
    plain = SpeculativeEngine(target_backend, eos_token_ids=(1,)).generate(ids, params).token_ids
    from draftwise.proposers.draft_model import DraftModelProposer

    speculative = SpeculativeEngine(target_backend, DraftModelProposer(draft_backend, 128), 4,
                                    eos_token_ids=(1,)).generate(ids, params).token_ids
    assert speculative == plain and max(plain) < 96


def test_measure_costs_times_every_k():
    target, draft = _tiny(0, "t"), _tiny(1, "d", layers=1)
    costs = measure_costs(target, draft, 3, repeats=2)
    assert sorted(costs.target.seconds) == [1, 2, 3, 4] and costs.draft_1_token_s > 0
    assert costs.cost_ratio == costs.draft_1_token_s / costs.target.seconds[1]
    assert target.backend.num_cached == 0 and draft.backend.num_cached == 0
    with pytest.raises(ValueError, match="max_k"):
        measure_costs(target, draft, 0)


def _costs(relative: dict[int, float], c: float) -> CostMeasurement:
    return CostMeasurement(ForwardCosts({k: 0.1 * v for k, v in relative.items()}, context_len=200), 0.1 * c)


def test_predictions_use_the_leviathan_formula_and_clamp_noise():
    costs = _costs({1: 1.0, 2: 1.2, 3: 0.8, 4: 1.5}, c=0.2)
    predictions = predict_speedups(0.8, costs, max_k=5)
    assert [p.k for p in predictions] == [1, 2, 3]  # K = 4, 5 need v5, v6, which were not timed
    assert predictions[0].speedup == pytest.approx(predicted_speedup(0.8, 1, 0.2, 1.2))
    assert predictions[1].verify_cost == 1.2  # v3 = 0.8 measured: noise; the curve reads non-decreasing (v2)
    assert predictions[2].tokens_per_step == pytest.approx((1 - 0.8**4) / 0.2)
    assert "v3=0.80 below 1" in costs.warnings()[0]
    assert costs.to_dict()["warnings"] == costs.warnings()


def test_break_even_alpha_gives_speedup_one():
    alpha = break_even_alpha(3, 0.3, 1.5)
    assert 0 < alpha < 1 and predicted_speedup(alpha, 3, 0.3, 1.5) == pytest.approx(1.0, abs=1e-9)
    assert break_even_alpha(2, 0.0, 1.0) == 0.0
    assert break_even_alpha(1, 1.5, 1.0) is None  # 2 tokens per step at best, a step costs 2.5


def test_verdict_helps():
    verdict = speculation_verdict(0.8, predict_speedups(0.8, _costs({1: 1, 2: 1.05, 3: 1.1, 4: 1.2}, 0.1), 3))
    assert verdict.status == "helps" and verdict.helps and verdict.best_k == 3
    assert verdict.text == f"helps: ~{verdict.predicted_speedup:.2f}x at K=3"
    assert "per-token acceptance 80%" in verdict.reason


def test_verdict_does_not_help_because_of_costs():
    verdict = speculation_verdict(0.9, predict_speedups(0.9, _costs({1: 1, 2: 2, 3: 3}, 0.9), 2))
    assert verdict.status == "does_not_help" and verdict.helps is False
    assert verdict.text.startswith("does not help here: speculation would slow decoding; try n-gram")
    assert verdict.reason.startswith("even if every draft token were accepted")


def test_verdict_does_not_help_because_of_acceptance():
    verdict = speculation_verdict(0.05, predict_speedups(0.05, _costs({1: 1, 2: 1.1, 3: 1.2}, 0.2), 2))
    assert verdict.status == "does_not_help"
    assert verdict.reason.startswith("the per-token acceptance is only 5%; breaking even needs at least")


def test_verdict_marginal_and_unknown():
    costs = _costs({1: 1, 2: 1.3}, 0.05)
    alpha = 0.0
    while predict_speedups(alpha, costs, 1)[0].speedup < 1.02:
        alpha += 0.01
    assert speculation_verdict(alpha, predict_speedups(alpha, costs, 1)).status == "marginal"
    unknown = speculation_verdict(None, [])
    assert unknown.status == "unknown" and unknown.helps is None


# ---------------------------------------------------------------------------------------------- acceptance model
def _geometric_probe(a: float, k: int, drafts: int = 1000) -> ProbeResult:
    """A probe whose counts are exactly what a proposer right with probability ``a`` per token yields at K:
    position i is reached by ``drafts * a^i`` drafts, accepted by ``a`` of them, rejected by the rest."""
    accepted = tuple(round(drafts * a ** (i + 1)) for i in range(k))
    rejected = tuple(round(drafts * a**i * (1 - a)) for i in range(k))
    total_accepted = sum(accepted)
    passes = drafts
    prompt = ProbePromptResult(prompt_id="1", category="coding", prompt_tokens=10, generated_tokens=0,
                               draft_tokens=drafts * k, accepted_tokens=total_accepted, target_passes=passes,
                               step_tokens=total_accepted + passes, decode_time_s=1.0,
                               accepted_per_position=accepted, rejected_per_position=rejected)
    return ProbeResult(k=k, max_tokens=64, prompts=[prompt])


def test_a_proposer_right_90_percent_predicts_six_tokens_per_step_at_k8():
    """Issue 15: accepted / drafted (0.64 here) in Leviathan's formula predicted 2.78 tokens per step where
    6.1 were measured; the per-token acceptance predicts 6.1."""
    probe = _geometric_probe(0.9, 8)
    assert probe.acceptance_rate == pytest.approx(0.641, abs=1e-3)  # what the statistics report
    assert probe.token_acceptance == pytest.approx(0.9, abs=1e-3)
    costs = _costs({k: 1.0 for k in range(1, 10)}, c=0.0)  # free drafts, flat verify: speed-up = tokens/step
    (k8,) = [p for p in predict_speedups(probe.token_acceptance, costs, 8) if p.k == 8]
    assert k8.tokens_per_step == pytest.approx((1 - 0.9**9) / 0.1, abs=0.01) and 6.0 < k8.tokens_per_step < 6.2
    assert expected_tokens_per_step(probe.acceptance_rate, 8) < 2.9  # the old, wrong prediction


def test_check_recommends_the_k_the_per_token_acceptance_pays_for():
    """Verify costs rising 25% per token, draft c = 0.05: at a = 0.9 the best K is 5, which accepted / drafted
    (0.64 at the probe's K = 8) would have put at 2."""
    costs = _costs({k: 1 + 0.25 * (k - 1) for k in range(1, 10)}, c=0.05)
    probe = _geometric_probe(0.9, 8)
    best_right = max(predict_speedups(probe.token_acceptance, costs, 8), key=lambda p: p.speedup)
    best_wrong = max(predict_speedups(probe.acceptance_rate, costs, 8), key=lambda p: p.speedup)
    model = costs.cost_model()
    assert best_right.k == model.best_k(0.9, 8) == 5
    assert best_wrong.k == 2
    verdict = speculation_verdict(probe.token_acceptance, predict_speedups(probe.token_acceptance, costs, 8))
    assert verdict.best_k == 5 and verdict.status == "helps"


def test_probe_reports_per_token_acceptance_from_the_engine_counts():
    probe = run_acceptance_probe(_tiny(0, "t"), _tiny(1, "d"), WORD_PROMPTS, k=3, max_tokens=12, chat=False)
    accepted = sum(n for p in probe.prompts for n in p.accepted_per_position)
    rejected = sum(n for p in probe.prompts for n in p.rejected_per_position)
    assert accepted == probe.accepted_tokens and probe.token_acceptance == accepted / (accepted + rejected)
    assert probe.token_acceptance >= probe.acceptance_rate  # positions after a rejection are not judged
    assert probe.to_dict()["token_acceptance"] == probe.token_acceptance


def test_prompts_are_found_in_the_shared_folder_named_by_draftwise_shared(tmp_path, monkeypatch):
    questions = tmp_path / "data" / "spec_bench" / "question.jsonl"
    questions.parent.mkdir(parents=True)
    questions.write_text('{"question_id": 1, "category": "coding", "turns": ["hi"]}\n')
    monkeypatch.delenv("DRAFTWISE_PROMPTS", raising=False)
    monkeypatch.setenv("DRAFTWISE_SHARED", str(tmp_path))
    assert default_prompts_path() == questions
    explicit = tmp_path / "mine.jsonl"
    explicit.write_text('{"prompt": "x"}\n')
    monkeypatch.setenv("DRAFTWISE_PROMPTS", str(explicit))  # the file itself still comes first
    assert default_prompts_path() == explicit
