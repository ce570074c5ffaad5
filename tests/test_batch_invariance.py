"""Batch invariance: position i's logits from a k-token pass equal one-token decoding, k = 1..16.

int8 (``--quantization int8``: int8 linears + row-wise attention) must be bit for bit. fp32 (MKL GEMMs) is
not: its rows differ in the last bits once a pass has 2 or more tokens, so for fp32 only the argmax and a
small tolerance are asserted (docs/cpu_int8.md). Then the engine: greedy speculative == plain under int8.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.backends.quantization import int8_kernels_available, quantize_model
from test_quantization import tiny_qwen2

pytestmark = pytest.mark.skipif(not int8_kernels_available(), reason="torch build without fbgemm int8 kernels")

MAX_K = 16
PREFIX = 24
FP32_TOLERANCE = 1e-4  # absolute, on logits of magnitude ~1-10 (measured differences: ~1e-5)


def _sequence(vocab: int) -> list[int]:
    return [(7 + 31 * i) % vocab for i in range(PREFIX + MAX_K)]


def _one_token_logits(backend, tokens: list[int]) -> torch.Tensor:
    """``[MAX_K, vocab]``: the logits of positions PREFIX.. decoded one token at a time."""
    backend.reset()
    backend.forward(tokens[:PREFIX])
    return torch.cat([backend.forward([t]).logits for t in tokens[PREFIX:]])


def _k_token_logits(backend, tokens: list[int], k: int) -> torch.Tensor:
    """``[k, vocab]``: the same positions computed in one k-token pass (as a verification does)."""
    backend.reset()
    backend.forward(tokens[:PREFIX])
    return backend.forward(tokens[PREFIX:PREFIX + k]).logits


def _backend(name: str, request):
    if name == "tiny-llama":
        return tiny_llama(seed=11)
    if name == "tiny-qwen2":
        return tiny_qwen2(seed=12)
    from draftwise.models.loading import load_model

    return load_model(str(request.getfixturevalue("stories_path")), device="cpu").backend  # a private copy


MODELS = ["tiny-llama", "tiny-qwen2", "stories260K"]


@pytest.mark.parametrize("model", MODELS)
def test_int8_is_bit_exact_batch_invariant(model, request):
    backend = _backend(model, request)
    quantize_model(backend.model, "int8")
    tokens = _sequence(backend.vocab_size)
    reference = _one_token_logits(backend, tokens)
    for k in range(1, MAX_K + 1):
        assert torch.equal(_k_token_logits(backend, tokens, k), reference[:k]), f"{model}: k={k}"


@pytest.mark.parametrize("model", MODELS)
def test_fp32_agrees_within_tolerance_but_not_bit_for_bit(model, request):
    """What holds for fp32: same argmax, differences far below the logit scale; not guaranteed identical."""
    backend = _backend(model, request)
    tokens = _sequence(backend.vocab_size)
    reference = _one_token_logits(backend, tokens)
    for k in range(1, MAX_K + 1):
        logits = _k_token_logits(backend, tokens, k)
        assert torch.equal(logits.argmax(-1), reference[:k].argmax(-1)), f"{model}: k={k}"
        torch.testing.assert_close(logits, reference[:k], rtol=0, atol=FP32_TOLERANCE)
    assert torch.equal(_k_token_logits(backend, tokens, 1), reference[:1])  # k = 1 is the same computation


@pytest.fixture(scope="module")
def stories_int8_pair(draftwise_home, stories_path):
    """stories260K int8 and an int8 self-draft of its first 2 layers (derived after quantization)."""
    from draftwise.models.loading import derive_layer_draft, load_model

    target = load_model(str(stories_path), device="cpu", quantization="int8")
    return target, derive_layer_draft(target, num_layers=2)


@pytest.mark.parametrize("k", [2, 5])
def test_int8_greedy_speculation_equals_plain(stories_int8_pair, k):
    target, draft = stories_int8_pair
    params = SamplingParams(max_tokens=40)
    eos = target.eos_token_ids
    for text in ["Once upon a time", "Lily and Ben went to the park. They saw"]:
        prompt = target.encode(text)
        oracle = SpeculativeEngine(target.backend, eos_token_ids=eos).generate(prompt, params)
        proposer = DraftModelProposer(draft.backend, target.backend.vocab_size)
        result = SpeculativeEngine(target.backend, proposer, k, eos_token_ids=eos).generate(prompt, params)
        assert result.token_ids == oracle.token_ids, (text, k)
        assert result.finish_reason == oracle.finish_reason
        assert 0.0 < result.stats.acceptance_rate < 1.0  # a real, imperfect draft
