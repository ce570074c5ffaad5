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


def test_random_weights_need_only_the_config_and_tokenizer(tmp_path):
    """``random:DIR`` for a directory without weight files builds the architecture from ``config.json``: a model
    with a real architecture's shapes from a few MB (e.g. carried to a lent GPU machine; docs/gpu.md)."""
    from draftwise.models.loading import load_model
    from test_check_support import tiny_pair_dirs

    target, _ = tiny_pair_dirs(tmp_path)
    for weights in [*target.glob("*.safetensors"), *target.glob("*.bin")]:
        weights.unlink()
    with pytest.raises(Exception, match="model.safetensors|pytorch_model.bin"):
        load_model(str(target), device="cpu")  # a real model still needs its weights
    loaded = load_model(f"random:{target}", device="cpu", quantization="none", runtime="transformers")
    assert loaded.backend.vocab_size == 96 and loaded.encode("the") != []
    again = load_model(f"random:{target}", device="cpu", quantization="none", runtime="transformers")
    ids = [1, 2, 3]
    assert torch.equal(loaded.backend.forward(ids).logits, again.backend.forward(ids).logits)  # seeded weights
