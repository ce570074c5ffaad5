"""Statistics are exact on a scripted proposer."""

from __future__ import annotations

from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
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
    assert stats.num_drafts == 0 and stats.num_draft_tokens == 0 and stats.acceptance_rate == 0.0
    assert stats.num_target_passes == 9 and stats.mean_accepted_length == 1.0
    assert stats.total_time_s >= stats.target_time_s > 0
