"""Lossless sampling through the whole engine: speculative output ~ the target's distribution."""

from __future__ import annotations

import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer
from fakes import BigramLM, sequence_distribution


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_speculative_sampling_matches_target_sequence_distribution(sampling):
    vocab, length, draws = 4, 3, 6000
    gen = torch.Generator().manual_seed(0)
    target_table = torch.randn(vocab, vocab, generator=gen) * 1.5
    draft_table = torch.randn(vocab, vocab, generator=gen) * 1.5  # a different, imperfect draft
    target, draft = BigramLM(target_table), BigramLM(draft_table)
    params = SamplingParams(temperature=0.8, max_tokens=length, ignore_eos=True, seed=0, sampling=sampling)
    engine = SpeculativeEngine(target, DraftModelProposer(draft, vocab), 2)
    counts: dict[tuple, int] = {}
    accepted = drafted = 0
    for seed in range(draws):
        result = engine.generate([0], SamplingParams(**{**params.__dict__, "seed": seed}))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        accepted += result.stats.num_accepted_tokens
        drafted += result.stats.num_draft_tokens
    expected = sequence_distribution(target_table, 0, length, 0.8)
    tv = 0.5 * sum(abs(counts.get(s, 0) / draws - p) for s, p in expected.items())
    assert tv < 0.04, tv
    assert 0 < accepted < drafted


def test_seeded_requests_are_reproducible_and_seed_sensitive():
    gen = torch.Generator().manual_seed(1)
    target = BigramLM(torch.randn(50, 50, generator=gen))
    draft = BigramLM(torch.randn(50, 50, generator=gen))
    engine = SpeculativeEngine(target, DraftModelProposer(draft, 50), 3)

    def run(seed):
        return engine.generate([1, 2], SamplingParams(temperature=1.0, max_tokens=30, seed=seed, ignore_eos=True)).token_ids

    assert run(42) == run(42)
    assert run(42) != run(43)
