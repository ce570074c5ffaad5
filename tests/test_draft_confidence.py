"""The draft confidence stop (``draft_confidence_threshold``): a draft chain stops growing once the draft's
probability of its path falls below the threshold. The chain is shorter exactly where the draft is unsure, the
output stays the target's own (greedy and coupled sampling, alone and batched), and the threshold is validated
wherever it can be set."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import first_layer_copy, tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.quantization import int8_kernels_available
from draftwise.commands.bench import CliError, draft_confidences, method_label
from draftwise.config import DEFAULT_DRAFT_CONFIDENCE, SamplingParams, SpeculativeConfig
from draftwise.engine import EngineCore, SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer, DraftRequest, DraftSlots
from draftwise.sampling import Sampler

MODE = "int8" if int8_kernels_available() else "none"
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
PROMPTS = [[3, 17, 42, 5], [9, 8, 7, 6, 5, 4, 3, 2] * 3, list(range(2, 50))]


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(0).model


@pytest.fixture(scope="module")
def weak_hf(hf):
    return first_layer_copy(hf)


@pytest.fixture(scope="module")
def target(hf):
    return build_lean(hf, quantization=MODE, name="tiny")


@pytest.fixture(scope="module")
def draft(weak_hf):
    return build_lean(weak_hf, quantization=MODE, name="weak")


@pytest.fixture(scope="module")
def oracle(target):
    return [SpeculativeEngine(target).generate(p, GREEDY).token_ids for p in PROMPTS]


def _path_probabilities(draft, context, k):
    """The draft's greedy chain ``k`` deep after ``context`` and each prefix's path probability, computed
    directly from the draft's one-row passes (the reference the stop rule is checked against)."""
    draft.reset()
    logits = draft.forward(list(context), num_logits=1).logits[-1]
    tokens, paths, path = [], [], 1.0
    for _ in range(k):
        probs = torch.softmax(logits.float(), dim=-1)
        token = int(torch.argmax(probs))
        path *= float(probs[token])
        tokens.append(token)
        paths.append(path)
        logits = draft.forward([token], num_logits=1).logits[-1]
    draft.reset()
    return tokens, paths


@pytest.mark.parametrize("threshold", [0.0005, 0.05, 0.3, 0.6])
def test_the_chain_stops_after_the_token_whose_path_falls_below_the_threshold(draft, threshold):
    k = 8
    for context in PROMPTS:
        tokens, paths = _path_probabilities(draft, context, k)
        expected = next((i + 1 for i, p in enumerate(paths) if p < threshold), k)
        slots = DraftSlots(draft, 96, confidence_threshold=threshold)
        proposal = slots.draft([DraftRequest(0, 0, context, Sampler(GREEDY), k)])[0]
        assert list(proposal.token_ids) == tokens[:expected], (threshold, paths)
    # an unreachable threshold keeps one token (the first draft token is always proposed); 0 never stops
    assert len(DraftSlots(draft, 96, confidence_threshold=0.999).draft(
        [DraftRequest(0, 0, PROMPTS[0], Sampler(GREEDY), k)])[0].token_ids) == 1
    assert len(DraftSlots(draft, 96, confidence_threshold=0.0).draft(
        [DraftRequest(0, 0, PROMPTS[0], Sampler(GREEDY), k)])[0].token_ids) == k


def test_the_stop_saves_draft_passes(draft):
    """Tokens not drafted are passes not run: the whole point of the stop."""
    passes = {}
    for threshold in (0.0, 0.5):
        slots = DraftSlots(draft, 96, confidence_threshold=threshold)
        forward, count = slots.backend.forward, []
        slots.backend.forward = lambda pieces, forward=forward, count=count: count.append(1) or forward(pieces)
        for context in PROMPTS:
            slots.draft([DraftRequest(0, 0, context, Sampler(GREEDY), 8)])
        passes[threshold] = len(count)
    assert passes[0.0] == 3 * 8 and passes[0.5] < passes[0.0]


def test_per_depth_thresholds_stop_the_chain_at_the_first_depth_whose_threshold_its_path_misses(draft):
    """``thresholds[j - 1]`` applies after j proposed tokens (deeper ones take the last); a threshold of 1 or
    more stops the chain there; all zeros never stop it."""
    k = 8
    for context in PROMPTS:
        tokens, paths = _path_probabilities(draft, context, k)
        for thresholds in ((0.0, 0.0, 1.0), (paths[0] / 2, paths[1] * 2), (0.0,) * 3, (paths[0] * 2,)):
            expected = next((j for j in range(1, k) if paths[j - 1] < thresholds[min(j, len(thresholds)) - 1]), k)
            slots = DraftSlots(draft, 96, confidence_threshold=thresholds)
            proposal = slots.draft([DraftRequest(0, 0, context, Sampler(GREEDY), k)])[0]
            assert list(proposal.token_ids) == tokens[:expected], (thresholds, paths)
    one = DraftSlots(draft, 96, confidence_threshold=(0.0, 0.0, 1.0))
    assert len(one.draft([DraftRequest(0, 0, PROMPTS[0], Sampler(GREEDY), k)])[0].token_ids) == 3


def test_auto_thresholds_follow_the_costs():
    """``draft_stop_thresholds``: 1.5 x (c + the next verify row's relative cost) per depth, so a dearer draft or a
    steeper verify curve stops chains earlier."""
    from draftwise.speculation.cost_model import DRAFT_STOP_VALUE, CostModel, draft_stop_thresholds

    flat = CostModel((0.05, 0.051, 0.052, 0.053, 0.054), 0.01)
    steep = CostModel((0.05, 0.051, 0.06, 0.075, 0.095), 0.01)
    dear = CostModel((0.05, 0.051, 0.052, 0.053, 0.054), 0.03)
    assert draft_stop_thresholds(flat, 4) == pytest.approx([DRAFT_STOP_VALUE * (0.2 + 0.02)] * 3)
    assert draft_stop_thresholds(steep, 4) == pytest.approx([1.5 * (0.2 + 0.18), 1.5 * (0.2 + 0.3),
                                                             1.5 * (0.2 + 0.4)])
    assert all(d > f for d, f in zip(draft_stop_thresholds(dear, 4), draft_stop_thresholds(flat, 4)))
    assert draft_stop_thresholds(flat, 1) == ()
    assert len(draft_stop_thresholds(flat, 8)) == 7  # the curve is extended past its measured points
    with pytest.raises(ValueError):
        draft_stop_thresholds(flat, 0)


def test_the_builder_turns_auto_into_per_depth_thresholds_from_the_calibrated_costs(target, draft, oracle,
                                                                                     monkeypatch):
    from draftwise.builder import draft_confidence
    from draftwise.speculation import calibration
    from draftwise.speculation.cost_model import draft_stop_thresholds

    # the costs the builder calibrated, as it got them (a second calibration may measure again when the first
    # was too noisy to cache, and then differ: compare with what the builder used, not with a new measurement)
    calibrated = []
    measure = calibration.calibrate_cost_model
    monkeypatch.setattr(calibration, "calibrate_cost_model",
                        lambda *a, **k: calibrated.append(measure(*a, **k)) or calibrated[-1])
    thresholds = draft_confidence("auto", target, draft, 6)
    assert len(calibrated) == 1
    assert thresholds == draft_stop_thresholds(calibrated[0], 6)
    assert draft_confidence(0.25, target, draft, 6) == 0.25
    assert draft_confidence("auto", target, draft, 6, tree_width=2) == draft_confidence("auto", target, draft, 1)
    engine = SpeculativeEngine(target, DraftModelProposer(draft, 96, confidence_threshold=thresholds), 6)
    assert [engine.generate(p, GREEDY).token_ids for p in PROMPTS] == oracle


def test_auto_warns_when_the_costs_stop_every_chain_short_of_k(target, caplog, monkeypatch):
    """A draft as dear as the target (self-draft) cannot pay past its first token: ``"auto"`` says so, since K
    then looks ignored."""
    import logging

    from draftwise.speculation import calibration
    from draftwise.builder import draft_confidence
    from draftwise.speculation.cost_model import CostModel

    dear = CostModel((0.01, 0.0102, 0.0104, 0.0106, 0.0108), 0.01)
    cheap = CostModel((0.01, 0.0102, 0.0104, 0.0106, 0.0108), 0.001)
    for costs, warned in ((dear, True), (cheap, False)):
        monkeypatch.setattr(calibration, "calibrate_cost_model", lambda *a, costs=costs, **k: costs)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="draftwise.builder"):
            thresholds = draft_confidence("auto", target, target, 4)
        assert (min(thresholds) >= 1.0) == warned
        assert any("no draft token past the first 1" in r.getMessage() for r in caplog.records) == warned


@pytest.mark.parametrize("threshold", [0.2, 0.5])
def test_greedy_output_is_the_targets_alone_and_batched(target, hf, weak_hf, draft, oracle, threshold):
    alone = [SpeculativeEngine(target, DraftModelProposer(draft, 96, confidence_threshold=threshold), 6)
             .generate(p, GREEDY) for p in PROMPTS]
    assert [r.token_ids for r in alone] == oracle
    full = [SpeculativeEngine(target, DraftModelProposer(draft, 96, confidence_threshold=0.0), 6)
            .generate(p, GREEDY) for p in PROMPTS]
    assert sum(r.stats.num_draft_tokens for r in alone) < sum(r.stats.num_draft_tokens for r in full)
    multi = build_lean(hf, quantization=MODE, name="tiny-batch", num_slots=2)
    batched_draft = build_lean(weak_hf, quantization=MODE, name="weak-batch", num_slots=2)
    engine = EngineCore(multi, DraftModelProposer(batched_draft, 96, confidence_threshold=threshold, slot_per_sequence=True), 6)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == oracle  # 3 requests through 2 slots


def test_coupled_and_rejection_sampling_keep_the_plain_text_or_distribution(target, draft):
    for seed in (1, 2):
        params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        for prompt in PROMPTS[1:]:
            plain = SpeculativeEngine(target).generate(prompt, params).token_ids
            stopped = SpeculativeEngine(target, DraftModelProposer(draft, 96, confidence_threshold=0.3), 5)
            assert stopped.generate(prompt, params).token_ids == plain


def test_the_confidence_is_the_processed_distributions(draft):
    """Under rejection sampling the stop reads the distribution the token was drawn from (``Sampler.logprob``
    with the probabilities ``choose`` returned), the same value recomputing it gives."""
    logits = torch.randn(96)
    for params in (GREEDY, SamplingParams(temperature=0.7, top_k=20, seed=3, sampling="rejection"),
                   SamplingParams(temperature=0.7, top_p=0.9, seed=3)):
        sampler = Sampler(params)
        token, probs = sampler.choose(logits, 5)
        recomputed = sampler.logprob(logits, token)
        assert math.isfinite(recomputed) and recomputed <= 0.0
        if probs is not None:
            assert sampler.logprob(logits, token, probs) == pytest.approx(recomputed, abs=1e-5)
    greedy = Sampler(GREEDY)
    assert greedy.logprob(logits, int(torch.argmax(logits))) == pytest.approx(
        float(torch.log_softmax(logits, -1).max()), abs=1e-6)


def test_the_threshold_is_validated_everywhere(draft):
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="draft_confidence_threshold"):
            SpeculativeConfig(method="draft_model", model="d", draft_confidence_threshold=bad)
        with pytest.raises(ValueError, match="draft_confidence_threshold"):
            DraftSlots(draft, 96, confidence_threshold=bad)
    with pytest.raises(ValueError, match="draft_confidence_threshold"):
        SpeculativeConfig(method="ngram", draft_confidence_threshold=0.25)  # a field ngram does not read
    hybrid = SpeculativeConfig(method="hybrid", model="d", draft_confidence_threshold=0.25)
    assert hybrid.draft_confidence_threshold == 0.25
    assert draft_confidences(None) == [DEFAULT_DRAFT_CONFIDENCE]
    assert draft_confidences("0, 0.3,0.3") == [0.0, 0.3]
    for bad in ("1", "-0.2", "x", ","):
        with pytest.raises(CliError, match="--draft-confidence"):
            draft_confidences(bad)
    assert method_label("draft", 8, confidence=0.4) == "draft K=8 conf=0.4"
    assert method_label("draft", 4, confidence=0.1234567) != method_label("draft", 4, confidence=0.1234568)
    assert method_label("draft", 4, confidence=0.3000001) == "draft K=4 conf=0.3000001"
    for bad in ("0.3", None, True, [], [0.3, -1.0], ["0.3"], "auto"):  # "auto" needs costs: the builder's
        with pytest.raises(ValueError, match="draft_confidence_threshold"):
            DraftSlots(draft, 96, confidence_threshold=bad)
    for bad in ("0.3", "bogus", [0.3], None):
        with pytest.raises(ValueError, match="draft_confidence_threshold"):
            SpeculativeConfig(method="draft_model", model="d", draft_confidence_threshold=bad)
    assert SpeculativeConfig(method="draft_model", model="d").draft_confidence_threshold == "auto"
    assert draft_confidences("auto,0.3,auto") == ["auto", 0.3]


def test_a_threshold_beside_a_draft_tree_is_refused_and_bench_keeps_trees_at_the_default():
    from draftwise.commands.bench import agent_method_plan

    with pytest.raises(ValueError, match="tree_width > 1"):
        SpeculativeConfig(method="draft_model", model="d", tree_width=2, draft_confidence_threshold=0.5)
    assert SpeculativeConfig(method="draft_model", model="d", tree_width=2).tree_width == 2  # the default is fine
    off = SpeculativeConfig(method="draft_model", model="d", tree_width=2, draft_confidence_threshold=0)
    assert off.tree_width == 2  # 0 (the stop off) is what a tree does anyway
    plan = agent_method_plan(["draft"], [4], ["fixed"], [1, 2], {}, "d", confidences=[0.0, "auto", 0.3])
    labels = [label for label, *_ in plan]
    assert labels == ["plain", "draft K=4 conf=0.0", "draft K=4", "draft K=4 conf=0.3", "draft K=4 w=2"]
    assert method_label("draft", 4, confidence=DEFAULT_DRAFT_CONFIDENCE) == "draft K=4"


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_sampled_sequences_keep_the_targets_distribution_when_chains_stop_early(sampling):
    """The stop depends only on the draft's own tokens, so each position is still either verified against the
    target or drawn from it: the sequence distribution is the target's (chi-square goodness of fit over the
    4^4 sequences, bins of expected count < 5 pooled), while fewer tokens are drafted than without the stop."""
    from scipy.stats import chisquare

    from fakes import BigramLM, sequence_distribution

    vocab, length, draws, k = 4, 4, 6000, 3
    gen = torch.Generator().manual_seed(0)
    target_table = torch.randn(vocab, vocab, generator=gen) * 1.5
    draft_table = torch.randn(vocab, vocab, generator=gen) * 1.5  # a different, imperfect draft
    drafted = {}
    for threshold in (0.0, 0.5):
        engine = SpeculativeEngine(BigramLM(target_table), DraftModelProposer(BigramLM(draft_table), vocab,
                                                                              confidence_threshold=threshold), k)
        counts: dict[tuple, int] = {}
        drafted[threshold] = 0
        for seed in range(draws):
            params = SamplingParams(temperature=0.8, max_tokens=length, ignore_eos=True, seed=seed, sampling=sampling)
            result = engine.generate([0], params)
            counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
            drafted[threshold] += result.stats.num_draft_tokens
    expected = sequence_distribution(target_table, 0, length, 0.8)
    observed, wanted, pooled = [], [], [0.0, 0.0]
    for sequence, p in expected.items():
        if p * draws >= 5:
            observed.append(counts.get(sequence, 0))
            wanted.append(p * draws)
        else:
            pooled[0] += counts.get(sequence, 0)
            pooled[1] += p * draws
    observed.append(pooled[0])
    wanted.append(pooled[1])
    assert sum(counts.values()) == draws and sum(observed) == draws
    wanted = [w * draws / sum(wanted) for w in wanted]  # the exact distribution sums to 1 up to rounding
    assert chisquare(observed, wanted).pvalue > 1e-3
    assert drafted[0.5] < drafted[0.0]
