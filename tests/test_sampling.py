"""Logits processing: temperature, top-k, top-p, and parameter validation."""

from __future__ import annotations

import pytest
import torch

from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.sampling import logits_to_probs


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_keeps_k_most_likely():
    probs = logits_to_probs(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0, [0, 3]] == 0).all()
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    assert torch.allclose(probs[0, 1] / probs[0, 2], torch.exp(torch.tensor(1.0)))


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert probs[0, 2] > 0 and probs[0, 3] == 0


def test_greedy_params_have_no_distribution():
    with pytest.raises(ValueError, match="temperature > 0"):
        logits_to_probs(torch.zeros(1, 3), SamplingParams())


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(max_tokens=0), dict(seed=-3)]
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_speculative_config_validation():
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig(method="magic")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(model="x", num_speculative_tokens=0)
    assert SpeculativeConfig(model="x", num_speculative_tokens=3).num_speculative_tokens == 3


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 5e-324, 9.9e-6])
def test_underflowing_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(1, 4), params)
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-9])
def test_degenerate_top_p_keeps_the_most_likely_token(top_p):
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0], [2.0, 2.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1].sum().item() == pytest.approx(1.0) and probs[1].max().item() == 1.0
