"""N-gram (prompt lookup) proposer: greedy exactness, lossless sampling, and the index against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_llama
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.ngram import NgramIndex, NgramProposer, common_prefix_length
from fakes import BigramLM, peaked_table, sequence_distribution

KS = [1, 2, 4, 8]
GREEDY = SamplingParams()


def plain(target, prompt, params, eos=()):
    return SpeculativeEngine(target, eos_token_ids=eos).generate(prompt, params)


def with_ngram(target, prompt, params, k, eos=(), lookup=(1, 4)):
    return SpeculativeEngine(target, NgramProposer(*lookup), k, eos_token_ids=eos).generate(prompt, params)


# ---------------------------------------------------------------------------------------------- reference
def reference_draft(context: list[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Brute force: longest suffix n-gram with an earlier occurrence, latest such occurrence, overlapping copy."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n :]
        for start in range(length - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                ext = list(context)
                for i in range(k):
                    ext.append(ext[start + n + i])
                return tuple(ext[length:])
    return ()


def reference_index(tokens: list[int], min_n: int, max_n: int) -> dict[tuple[int, ...], int]:
    latest = {}
    for n in range(min_n, max_n + 1):
        for start in range(len(tokens) - n + 1):
            latest[tuple(tokens[start : start + n])] = start
    return latest


# ---------------------------------------------------------------------------------------------- unit
def test_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(1, 3)
    propose = lambda ctx, k: proposer.propose(ctx, k, GREEDY, torch.Generator()).token_ids  # noqa: E731
    # "1 2" occurred at 0 (-> 3) and at 4 (-> 9): the latest wins; the 3-gram "7 1 2" wins over both.
    assert propose([1, 2, 3, 5, 1, 2, 9, 6, 1, 2], 2) == (9, 6)
    assert propose([7, 1, 2, 3, 5, 1, 2, 9, 6, 7, 1, 2], 2) == (3, 5)
    assert propose([1, 2, 3], 4) == ()  # no earlier occurrence of any suffix
    assert propose([4, 4], 3) == (4, 4, 4)  # overlapping copy continues a run
    assert propose([1, 2, 3, 1, 2, 3, 1], 5) == (2, 3, 1, 2, 3)  # ... and a period
    assert proposer.propose([5], 3, GREEDY, torch.Generator()).token_ids == ()


def test_min_length_is_respected():
    proposer = NgramProposer(2, 3)
    assert proposer.propose([1, 2, 3, 2], 2, GREEDY, torch.Generator()).token_ids == ()  # only "2" repeats
    assert proposer.propose([1, 2, 3, 1, 2], 2, GREEDY, torch.Generator()).token_ids == (3, 1)


def test_invalid_lengths():
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([9], [1]) == 0
    for a, b in itertools.product(itertools.product(range(2), repeat=4), repeat=2):
        expected = next((i for i in range(4) if a[i] != b[i]), 4)
        assert common_prefix_length(a, b) == expected


def test_each_token_is_indexed_once_during_a_request(monkeypatch):
    """The lookup is incremental: over a whole generation, every context token is indexed exactly once."""
    calls = []
    original = NgramIndex.extend
    monkeypatch.setattr(NgramIndex, "extend", lambda self, ids: (calls.append(len(ids)), original(self, ids))[1])
    target = BigramLM(peaked_table(12, seed=3))
    prompt = [1, 2, 3, 4, 5, 6] * 5
    result = with_ngram(target, prompt, SamplingParams(max_tokens=60, ignore_eos=True), 4)
    context_len = len(prompt) + len(result.token_ids)
    assert sum(calls) <= context_len - 1
    assert result.stats.num_target_passes > 1


# ---------------------------------------------------------------------------------------------- index vs brute force
contexts = st.lists(st.integers(0, 2), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(0, 2), max_size=12)), min_size=1, max_size=12),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(1, 6),
)
def test_proposals_match_brute_force_through_growth_and_rollback(steps, min_n, extra, k):
    """Each step keeps a random prefix of the previous context (a rollback or a new request) and appends
    random tokens; the proposal must equal the brute-force lookup, and the index a fresh one."""
    max_n = min_n + extra
    proposer = NgramProposer(min_n, max_n)
    context: list[int] = []
    for keep, new in steps:
        context = context[: min(keep, len(context))] + new
        got = proposer.propose(context, k, GREEDY, torch.Generator()).token_ids
        assert got == (reference_draft(context, k, min_n, max_n) if len(context) >= 2 else ())
        if len(context) >= 2:
            indexed = proposer.index.tokens
            assert indexed == context[:-1]
            expected = reference_index(indexed, min_n, max_n)
            for ngram, start in expected.items():
                assert proposer.index.last_occurrence(ngram) == start
            assert sum(len(t) for t in proposer.index._last.values()) == len(expected)


@settings(max_examples=100, deadline=None)
@given(tokens=contexts, cut=st.integers(0, 40), more=contexts)
def test_truncate_then_extend_equals_fresh_index(tokens, cut, more):
    index = NgramIndex(1, 3)
    index.extend(tokens)
    index.truncate(cut)
    index.extend(more)
    fresh = NgramIndex(1, 3)
    fresh.extend(tokens[:cut] + more)
    assert index.tokens == fresh.tokens
    assert index._last == fresh._last and index._prev == fresh._prev


# ---------------------------------------------------------------------------------------------- greedy exactness
REPETITIVE_PROMPTS = [
    [3, 4, 5, 6, 7] * 8,  # one period, many long matches
    [1, 1, 1, 1, 1, 1, 2, 1, 1, 1],  # a run: every 1..4-gram matches
    [2, 9, 2, 9, 4, 2, 9, 2, 9, 4, 2, 9],
    [5, 8],  # nothing to match at first
]


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("prompt", REPETITIVE_PROMPTS)
def test_bigram_exactness(k, prompt):
    target = BigramLM(peaked_table(12, seed=7))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    oracle = plain(target, prompt, params)
    result = with_ngram(target, prompt, params, k)
    assert result.token_ids == oracle.token_ids
    # greedy bigram output falls into a cycle, which n-gram lookup then predicts
    assert result.stats.num_accepted_tokens > 0
    assert result.stats.num_target_passes < len(oracle.token_ids)


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("lookup", [(1, 4), (2, 2), (3, 5)])
def test_tiny_llama_exactness(tiny_target, k, lookup):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in ([3, 17, 42, 5] * 6, [9, 9, 9, 9, 9, 9, 9, 9], [11, 12, 13, 14, 15, 16, 11, 12, 13]):
        oracle = plain(tiny_target, prompt, params)
        result = with_ngram(tiny_target, prompt, params, k, lookup=lookup)
        assert result.token_ids == oracle.token_ids, (prompt, k, lookup)


@pytest.mark.parametrize("k", KS)
def test_stories260k_exactness(stories, k):
    params = SamplingParams(max_tokens=48)
    texts = [
        "Once upon a time",
        "Lily said: the cat is on the mat. Ben said: the cat is on the mat. Lily said: the cat is on the mat. Ben said:",
        "One two three. One two three. One two three. One two three. One two",
    ]
    accepted = 0
    for text in texts:
        prompt = stories.encode(text)
        oracle = plain(stories.backend, prompt, params, stories.eos_token_ids)
        result = with_ngram(stories.backend, prompt, params, k, stories.eos_token_ids)
        assert result.token_ids == oracle.token_ids, (text, k)
        assert result.finish_reason == oracle.finish_reason
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_one_proposer_serves_consecutive_requests(tiny_target):
    """The index is re-synced across requests (shared prefix kept, the rest rolled back)."""
    proposer = NgramProposer(1, 3)
    engine = SpeculativeEngine(tiny_target, proposer, 4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for prompt in ([3, 17, 42, 5] * 4, [3, 17, 42, 5] * 2 + [8, 8], [50, 51] * 6, [3, 17, 42, 5] * 4):
        assert engine.generate(prompt, params).token_ids == plain(tiny_target, prompt, params).token_ids


# ---------------------------------------------------------------------------------------------- lossless sampling
def test_one_hot_ngram_draft_keeps_sampling_lossless():
    """Bigram target at temperature 0.9 with a prompt whose n-grams always match: the n-gram draft is verified
    as a one-hot q; the sequence distribution must equal the target's (total variation on 5000 draws)."""
    length, draws = 3, 5000
    table = torch.tensor([[2.0, 0.5, -1.0], [0.0, 2.0, 0.3], [1.5, -0.5, 0.8]])
    target = BigramLM(table)
    prompt = [0, 1, 2, 0, 0, 1, 1, 2, 2, 0]  # every bigram occurs, so every step drafts
    engine = SpeculativeEngine(target, NgramProposer(1, 2), 3)
    counts: dict[tuple, int] = {}
    accepted = drafted = 0
    for seed in range(draws):
        result = engine.generate(prompt, SamplingParams(temperature=0.9, max_tokens=length, ignore_eos=True, seed=seed))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        accepted += result.stats.num_accepted_tokens
        drafted += result.stats.num_draft_tokens
    expected = sequence_distribution(table, prompt[-1], length, 0.9)
    tv = 0.5 * sum(abs(counts.get(s, 0) / draws - p) for s, p in expected.items())
    assert tv < 0.04, tv
    assert 0.1 * drafted < accepted < 0.9 * drafted


def test_speculative_config_builds_ngram_proposer():
    from draftwise.builder import build_proposer

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=5)
    proposer, draft = build_proposer(config, target=None, device="cpu", dtype=None)  # the target is not needed
    assert isinstance(proposer, NgramProposer) and draft is None
    assert (proposer.prompt_lookup_min, proposer.prompt_lookup_max) == (2, 5)
