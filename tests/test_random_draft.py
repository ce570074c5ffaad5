"""``random:SPEC`` drafts: same architecture and vocabulary, random weights (the mismatched-draft benchmark)."""

from __future__ import annotations

import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer


@pytest.fixture(scope="module")
def random_stories(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    return load_model(f"random:{stories_path}", device="cpu")


def test_random_weights_keep_the_tokenizer_and_shapes_but_not_the_weights(stories, random_stories):
    real, rand = stories.backend.model, random_stories.backend.model
    assert random_stories.tokenizer.get_vocab() == stories.tokenizer.get_vocab()
    real_params, rand_params = dict(real.named_parameters()), dict(rand.named_parameters())
    assert real_params.keys() == rand_params.keys()
    for name, param in rand_params.items():
        assert param.shape == real_params[name].shape
        if param.dim() >= 2:
            assert not torch.equal(param, real_params[name]), name
            assert abs(float(param.detach().std()) - 0.02) < 0.005, name


def test_random_weights_are_deterministic(draftwise_home, stories_path, random_stories):
    from draftwise.models.loading import load_model

    again = load_model(f"random:{stories_path}", device="cpu").backend.model
    for (name, a), (_, b) in zip(random_stories.backend.model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def test_random_draft_is_rejected_but_output_stays_exact(stories, random_stories):
    prompt = stories.encode("Once upon a time")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    oracle = SpeculativeEngine(stories.backend).generate(prompt, params)
    proposer = DraftModelProposer(random_stories.backend, stories.backend.vocab_size)
    result = SpeculativeEngine(stories.backend, proposer, 4).generate(prompt, params)
    assert result.token_ids == oracle.token_ids
    assert result.stats.acceptance_rate < 0.2


def test_random_prefix_refuses_llama_cpp(stories_path):
    from draftwise.models.loading import load_model

    with pytest.raises(ValueError, match="PyTorch backend"):
        load_model(f"random:{stories_path}", backend="llama.cpp")
