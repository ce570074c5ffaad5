"""Statistics are exact on a scripted proposer."""

from __future__ import annotations

import pytest

from draftwise.commands.generate import format_stats
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.stats import SpeculativeStats, hybrid_steps_line, total_hybrid_steps
from fakes import BigramLM, ScriptedProposer, peaked_table


def test_stats_exact_for_scripted_proposer():
    """K=4, wrong at draft position 2, max_tokens=16.

    The prefill commits 1 token. Steps 1-4 draft 4, accept 2, commit 3 (2 accepted + correction): 13 tokens.
    Step 5 has 3 tokens left, so K is clamped to 2; both are right: 2 accepted + bonus = 16 tokens.
    """
    table = peaked_table(32, seed=11)
    target = BigramLM(table)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    oracle = SpeculativeEngine(target).generate([4, 5], params).token_ids
    proposer = ScriptedProposer(2, oracle, 32, wrong_at=2)
    target.num_forwards = 0
    result = SpeculativeEngine(target, proposer, 4).generate([4, 5], params)
    stats = result.stats
    assert result.token_ids == oracle
    assert stats.num_drafts == 5
    assert stats.num_draft_tokens == 18
    assert stats.num_accepted_tokens == 10
    assert stats.drafted_per_position == [5, 5, 4, 4]
    assert stats.accepted_per_position == [5, 5, 0, 0]
    assert stats.acceptance_by_position == [1.0, 1.0, 0.0, 0.0]
    assert stats.acceptance_rate == 10 / 18
    assert stats.num_target_passes == 5
    assert stats.mean_accepted_length == 3.0
    assert stats.num_generated_tokens == 16
    assert stats.k_history == [4, 4, 4, 4, 2]
    assert target.num_forwards == 6  # one prefill + one verification pass per step
    data = stats.to_dict()
    assert data["acceptance_rate"] == 10 / 18 and data["mean_accepted_length"] == 3.0


def test_plain_decoding_stats():
    target = BigramLM(peaked_table(16, seed=2))
    result = SpeculativeEngine(target).generate([1], SamplingParams(max_tokens=10, ignore_eos=True))
    stats = result.stats
    assert stats.num_drafts == 0 and stats.num_draft_tokens == 0
    assert stats.acceptance_rate is None and stats.token_acceptance is None  # nothing drafted: undefined
    assert stats.num_target_passes == 9 and stats.mean_accepted_length == 1.0
    assert stats.total_time_s >= stats.target_time_s > 0
    data = stats.to_dict()
    assert data["acceptance_rate"] is None and data["mean_accepted_length"] == 1.0


def test_plain_request_ending_on_eos_and_one_token_request_have_tau_one():
    """tau is 1.0 for plain decoding: also when the last pass produced only the stop token, and when the only
    token came from the prefill (no decode pass at all)."""
    table = peaked_table(16, seed=2)
    target = BigramLM(table)
    oracle = SpeculativeEngine(target).generate([1], SamplingParams(max_tokens=6, ignore_eos=True)).token_ids
    stop = SpeculativeEngine(target, eos_token_ids=[oracle[4]]).generate([1], SamplingParams(max_tokens=50)).stats
    assert stop.finish_reason == "stop" and stop.num_step_tokens < stop.num_target_passes
    assert stop.mean_accepted_length == 1.0 and stop.acceptance_rate is None
    one = SpeculativeEngine(target).generate([1], SamplingParams(max_tokens=1, ignore_eos=True)).stats
    assert one.num_target_passes == 0 and one.mean_accepted_length == 1.0 and one.acceptance_rate is None


def test_rejections_are_counted_where_they_happen():
    stats = SpeculativeStats()
    stats.record_step(4, 2, 3)
    stats.record_step(4, 4, 5)
    stats.record_step(2, 0, 1)
    stats.record_step(0, 0, 1)
    assert stats.drafted_per_position == [3, 3, 2, 2]
    assert stats.accepted_per_position == [2, 2, 1, 1]
    assert stats.rejected_per_position == [1, 0, 1, 0]
    assert stats.acceptance_rate == 6 / 10
    assert stats.token_acceptance == 6 / (6 + 2)  # 6 accepted, 2 rejections, 2 positions never judged
    assert stats.mean_accepted_length == 1 + 6 / 4
    with pytest.raises(ValueError):
        stats.record_step(2, 3, 1)


def test_hybrid_steps_by_side():
    stats = SpeculativeStats()
    assert stats.hybrid_steps is None and stats.to_dict()["hybrid_steps"] is None  # not a hybrid request
    stats.record_hybrid_step("suffix", 3)
    stats.record_hybrid_step("draft_model", 4)
    stats.record_hybrid_step("suffix", 0)  # an empty draft: a plain pass, whichever side was chosen
    stats.record_hybrid_step("draft_model", 2)
    assert stats.hybrid_steps == {"suffix": 1, "draft_model": 2, "plain": 1}
    with pytest.raises(ValueError):
        stats.record_hybrid_step("ngram", 2)
    assert total_hybrid_steps([None, {}, stats.hybrid_steps, {"suffix": 2, "draft_model": 0, "plain": 5}]) == {
        "suffix": 3, "draft_model": 2, "plain": 6}
    assert total_hybrid_steps([None, {}]) is None
    assert hybrid_steps_line(stats.hybrid_steps) == "hybrid steps: suffix 1, draft model 2, plain 1"
    assert "hybrid steps: suffix 1, draft model 2, plain 1" in format_stats("hybrid", stats).splitlines()
    assert "hybrid steps" not in format_stats("ngram", SpeculativeStats())  # only when the hybrid ran
