"""Greedy exactness: speculative output == plain decoding of the target, token for token."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer
from fakes import BigramLM, ScriptedProposer, peaked_table

KS = [1, 2, 4, 8]


def plain(target, prompt, params, eos=()):
    return SpeculativeEngine(target, eos_token_ids=eos).generate(prompt, params)


def speculative(target, draft, prompt, params, k, eos=()):
    proposer = DraftModelProposer(draft, target.vocab_size)
    return SpeculativeEngine(target, proposer, k, eos_token_ids=eos).generate(prompt, params)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_llama(seed=0), tiny_llama(seed=0), tiny_llama(seed=1)  # target, identical draft, unrelated draft


@pytest.mark.parametrize("k", KS)
def test_identical_draft_accepts_everything(tiny_pair, k):
    target, same, _ = tiny_pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [3, 17, 42, 5]
    oracle = plain(target, prompt, params)
    result = speculative(target, same, prompt, params, k)
    assert result.token_ids == oracle.token_ids
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.num_accepted_tokens == result.stats.num_draft_tokens > 0


@pytest.mark.parametrize("k", KS)
def test_unrelated_draft_is_still_exact(tiny_pair, k):
    target, _, other = tiny_pair
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [3, 17, 42, 5]
    oracle = plain(target, prompt, params)
    result = speculative(target, other, prompt, params, k)
    assert result.token_ids == oracle.token_ids
    assert result.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("wrong_at", [0, 1, 3, None])
def test_scripted_partial_acceptance_is_exact(tiny_pair, k, wrong_at):
    """A proposer wrong exactly at draft position j accepts exactly min(j, k) tokens per step."""
    target = tiny_pair[0]
    params = SamplingParams(max_tokens=33, ignore_eos=True)
    prompt = [9, 8, 7]
    oracle = plain(target, prompt, params).token_ids
    proposer = ScriptedProposer(len(prompt), oracle, target.vocab_size, wrong_at=wrong_at)
    result = SpeculativeEngine(target, proposer, k).generate(prompt, params)
    assert result.token_ids == oracle
    stats = result.stats
    expected = k if wrong_at is None else min(wrong_at, k)
    full_steps = [n for n in stats.k_history if n == k]
    # every full-length draft accepted exactly `expected` tokens (the last steps may be clamped shorter)
    assert stats.accepted_per_position[:expected] == stats.drafted_per_position[:expected]
    assert all(a == 0 for a in stats.accepted_per_position[expected:])
    assert len(full_steps) >= 1


@pytest.mark.parametrize("k", KS)
def test_stories260k_with_real_derived_draft(stories, stories_draft, k):
    params = SamplingParams(max_tokens=48)
    for text in ["Once upon a time", "Lily and Ben went to the park. They saw"]:
        prompt = stories.encode(text)
        oracle = plain(stories.backend, prompt, params, stories.eos_token_ids)
        result = speculative(stories.backend, stories_draft.backend, prompt, params, k, stories.eos_token_ids)
        assert result.token_ids == oracle.token_ids, (text, k)
        assert result.finish_reason == oracle.finish_reason
        assert 0.0 < result.stats.acceptance_rate < 1.0  # a real, imperfect draft


def eos_table(vocab: int, eos: int, path: list[int]) -> torch.Tensor:
    """Bigram logits whose greedy path from path[0] is path[1:], then EOS, then 5 forever."""
    table = torch.zeros(vocab, vocab)
    for a, b in zip(path, path[1:]):
        table[a, b] = 10.0
    table[path[-1], eos] = 10.0
    table[eos, 5] = 10.0
    for t in range(vocab):
        if table[t].max() == 0:
            table[t, 5] = 10.0
    return table


@pytest.mark.parametrize("k", KS)
def test_eos_inside_a_draft_stops_and_is_not_counted(k):
    vocab, eos = 16, 1
    table = eos_table(vocab, eos, [2, 7, 9, 11])
    target, draft = BigramLM(table), BigramLM(table)
    params = SamplingParams(max_tokens=50)
    oracle = plain(target, [3, 2], params, eos=[eos])
    assert oracle.token_ids == [7, 9, 11] and oracle.finish_reason == "stop"
    result = speculative(target, draft, [3, 2], params, k, eos=[eos])
    assert result.token_ids == oracle.token_ids
    assert result.finish_reason == "stop"
    stats = result.stats
    # After the prefill's 7, drafts run 9, 11, EOS, 5, 5...: a perfect draft. A step ends at the stop token,
    # so neither the drafted nor the accepted count goes past it, and the acceptance is 1.0 at every K.
    # k=1: [9]+bonus 11, [EOS] -> 2 of 2; k=2: [9, 11]+bonus EOS -> 2 of 2; k>=4: [9, 11, EOS | 5..] -> 3 of 3.
    expected = {1: 2, 2: 2, 4: 3, 8: 3}[k]
    assert stats.num_accepted_tokens == expected
    assert stats.num_draft_tokens == expected
    assert stats.acceptance_rate == 1.0 and stats.token_acceptance == 1.0
    assert sum(stats.drafted_per_position) == expected and sum(stats.rejected_per_position) == 0
    assert stats.num_generated_tokens == 3


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_draft_never_exceeds_remaining_max_tokens(k, max_tokens):
    table = peaked_table(20, seed=5)
    target = BigramLM(table)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    oracle = plain(target, [1, 2], params)
    proposer = ScriptedProposer(2, oracle.token_ids, 20, extend=[4] * 20)
    result = SpeculativeEngine(target, proposer, k).generate([1, 2], params)
    assert result.token_ids == oracle.token_ids
    assert len(result.token_ids) == max_tokens and result.finish_reason == "length"
    assert all(asked <= max_tokens - 1 for asked in proposer.calls)


def test_context_length_stops_generation():
    target = BigramLM(peaked_table(20, seed=6), max_context=12)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    oracle = plain(target, [1, 2, 3], params)
    assert len(oracle.token_ids) == 9 and oracle.finish_reason == "length"
    proposer = ScriptedProposer(3, oracle.token_ids, 20, extend=[0] * 20)
    result = SpeculativeEngine(target, proposer, 8).generate([1, 2, 3], params)
    assert result.token_ids == oracle.token_ids and result.finish_reason == "length"


def test_prompt_errors():
    from draftwise.backends.base import ContextOverflowError

    engine = SpeculativeEngine(BigramLM(peaked_table(10, seed=0), max_context=8))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([3, 99], SamplingParams())
    with pytest.raises(ContextOverflowError, match="context length"):
        engine.generate(list(range(8)), SamplingParams())


def test_target_token_outside_a_narrower_draft_vocabulary_stays_exact():
    """Padded vocabularies: the target (width 12) emits id 11, which the draft (width 10) cannot embed."""
    vocab_t, vocab_d = 12, 10
    table = torch.zeros(vocab_t, vocab_t)
    for a, b in [(1, 3), (3, 11), (11, 4), (4, 5), (5, 1)]:
        table[a, b] = 10.0
    target, draft = BigramLM(table), BigramLM(table[:vocab_d, :vocab_d].clone())
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    oracle = plain(target, [1], params)
    assert 11 in oracle.token_ids
    result = speculative(target, draft, [1], params, 3)
    assert result.token_ids == oracle.token_ids
