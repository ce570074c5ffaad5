"""Greedy verification and the rejection sampler on hand-built distributions (chains; trees: test_tree.py)."""

from __future__ import annotations

import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.tree import chain_parents
from draftwise.verification import verify_greedy, verify_rejection
from draftwise.verification.rejection import residual_distribution


def verify_sampling(draft, draft_probs, target_probs, generator):
    """The unified rejection verifier on a chain, with hand-built target probabilities (temperature 1)."""
    return verify_rejection(draft, chain_parents(len(draft)), draft_probs, target_probs.log(),
                            SamplingParams(temperature=1.0), generator)


def one_hot_logits(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return logits


@pytest.mark.parametrize(
    "draft, target, accepted, next_token",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted: bonus token
        ([1, 2, 3], [5, 2, 3, 4], 0, 5),  # first rejected: correction at 0
        ([1, 2, 3], [1, 2, 7, 4], 2, 7),  # partial
        ([], [6], 0, 6),  # empty draft = plain step
    ],
)
def test_greedy_accepts_longest_matching_prefix(draft, target, accepted, next_token):
    result = verify_greedy(draft, chain_parents(len(draft)), one_hot_logits(target))
    assert result.num_accepted == accepted
    assert result.next_token_id == next_token
    assert result.token_ids == tuple(draft[:accepted]) + (next_token,)
    assert result.bonus == (accepted == len(draft))


def test_greedy_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"\[n \+ 1, vocab\]"):
        verify_greedy([1, 2], chain_parents(2), one_hot_logits([1, 2]))


def test_identical_distributions_accept_everything():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 16, generator=gen), dim=-1)
    for trial in range(50):
        draft = [int(torch.multinomial(probs[i], 1, generator=gen)) for i in range(3)]
        result = verify_sampling(draft, probs[:3], probs, gen)
        assert result.num_accepted == 3


def test_disjoint_supports_reject_and_resample_from_target():
    gen = torch.Generator().manual_seed(1)
    target = torch.zeros(2, 8)
    target[:, :4] = 0.25
    draft = torch.zeros(1, 8)
    draft[0, 4:] = 0.25
    for _ in range(50):
        result = verify_sampling([5], draft, target, gen)
        assert result.num_accepted == 0
        assert result.next_token_id < 4  # residual = target's own support


def test_one_hot_draft_on_target_support():
    gen = torch.Generator().manual_seed(2)
    target = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    accepted = sum(verify_sampling([1], None, target, gen).num_accepted for _ in range(100))
    assert accepted == 100  # p(x) = 1 for the one-hot draft token: always accepted
    target = torch.tensor([[0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])
    results = [verify_sampling([1], None, target, gen) for _ in range(100)]
    assert all(r.num_accepted == 0 and r.next_token_id in (0, 2) for r in results)


def test_residual_is_positive_part_and_falls_back_when_empty():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.3, 0.0, 0.0]))
    assert torch.equal(residual_distribution(p, p), p)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_output_distribution_equals_target(one_hot_draft):
    """Emitted first token ~ target_probs[0]; acceptance rate ~ sum(min(p, q)) (Leviathan et al., Thm 1)."""
    from scipy.stats import chisquare

    vocab, draws = 6, 40_000
    gen = torch.Generator().manual_seed(3)
    target = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.07, 0.03], [1 / 6] * 6])
    draft_dist = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    counts = torch.zeros(vocab)
    accepted = 0
    for _ in range(draws):
        if one_hot_draft:  # a deterministic proposer always offering token 4
            token, draft_probs = 4, None
        else:
            token = int(torch.multinomial(draft_dist, 1, generator=gen))
            draft_probs = draft_dist.unsqueeze(0)
        result = verify_sampling([token], draft_probs, target, gen)
        counts[result.token_ids[0]] += 1
        accepted += result.num_accepted
    expected_accept = float(target[0, 4]) if one_hot_draft else float(torch.minimum(target[0], draft_dist).sum())
    assert abs(accepted / draws - expected_accept) < 0.01
    assert total_variation(counts, target[0]) < 0.01
    assert chisquare(counts.numpy(), (target[0] * draws).numpy()).pvalue > 1e-3


def test_distribution_distance_shrinks_with_more_draws():
    gen = torch.Generator().manual_seed(4)
    target = torch.softmax(torch.randn(2, 10, generator=gen) * 2, dim=-1)
    draft = torch.softmax(torch.randn(1, 10, generator=gen) * 2, dim=-1)

    def tv_after(draws: int) -> float:
        counts = torch.zeros(10)
        for _ in range(draws):
            token = int(torch.multinomial(draft[0], 1, generator=gen))
            counts[verify_sampling([token], draft, target, gen).token_ids[0]] += 1
        return total_variation(counts, target[0])

    assert tv_after(20_000) < tv_after(500)
    assert tv_after(20_000) < 0.02


def test_seeded_sampling_is_reproducible():
    probs = torch.softmax(torch.randn(5, 32), dim=-1)
    draft = torch.softmax(torch.randn(4, 32), dim=-1)

    def run(seed):
        gen = torch.Generator().manual_seed(seed)
        return [verify_sampling([1, 2, 3, 4], draft, probs, gen).token_ids for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)
