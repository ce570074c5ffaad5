"""KV cache rollback: after rolling back, the next logits equal a fresh prefill of the same tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama


@pytest.fixture(params=["tiny", "stories"])
def backend(request):
    if request.param == "tiny":
        return tiny_llama(seed=3)
    return request.getfixturevalue("stories").backend


def test_rollback_then_refeed_equals_fresh_prefill(backend):
    tokens = [1, 17, 33, 8, 21, 40, 12, 5, 9, 30]
    backend.reset()
    fresh = backend.forward(tokens).logits  # [10, vocab]
    backend.reset()
    backend.forward(tokens[:4])
    backend.forward([44, 45, 46, 47])  # speculative tokens that get rejected
    assert backend.num_cached == 8
    backend.rollback(4)
    assert backend.num_cached == 4
    again = backend.forward(tokens[4:]).logits  # [6, vocab]
    torch.testing.assert_close(again, fresh[4:], rtol=1e-4, atol=1e-4)
    assert torch.equal(again.argmax(-1), fresh[4:].argmax(-1))


def test_rollback_bounds(backend):
    backend.reset()
    backend.forward([1, 2, 3])
    with pytest.raises(ValueError):
        backend.rollback(4)
    with pytest.raises(ValueError):
        backend.rollback(-1)
    backend.rollback(0)
    assert backend.num_cached == 0


def test_hidden_states_and_num_logits(backend):
    backend.reset()
    out = backend.forward([1, 2, 3, 4], num_logits=2, return_hidden=True)
    assert out.logits.shape == (2, backend.vocab_size)
    assert out.hidden is not None and out.hidden.shape[0] == 2
