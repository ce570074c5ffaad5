"""A draft that decodes on llama.cpp and catches up on the lean runtime (:mod:`draftwise.backends.catch_up`):
llama.cpp's sequence state read and written back, keys moved between the two rope layouts, continuation from
keys and values another runtime computed, and greedy speculative output still equal to plain. On the real
stories260K GGUF (all tensors F32, so both runtimes compute nearly the same numbers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.backends.catch_up import CatchUpDraft, interleave_rope_pairs, split_rope_pairs
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import load_model
from draftwise.proposers.draft_model import DraftModelProposer
from llama_cpp_gate import needs_llama_cpp

PROMPT = [1] + [(17 * i + 5) % 500 + 10 for i in range(90)]


@pytest.fixture(scope="module")
def decoder(stories_path):
    return load_model(str(stories_path), backend="llama.cpp", drafting=True, max_context=256)


@pytest.fixture(scope="module")
def prefiller(draftwise_home, stories_path):
    return load_model(str(stories_path), runtime="lean", max_context=256)


def test_rope_pair_layouts_are_inverse_and_pair_i_with_i_plus_half():
    keys = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8)
    interleaved = interleave_rope_pairs(keys)
    assert interleaved[0, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(split_rope_pairs(interleaved), keys)


@needs_llama_cpp
def test_llama_cpp_cache_reads_back_what_was_written(decoder):
    backend = decoder.backend
    backend.reset()
    backend.forward(PROMPT[:20], num_logits=1)
    layers = backend.read_cache()
    assert len(layers) > 0 and all(k.shape == v.shape == (20, layers[0][0].shape[1]) for k, v in layers)
    assert layers[0][0].shape[1] % backend.kv_heads == 0
    changed = [(k * 0.5, v + 1.0) for k, v in layers]
    backend.write_cache(changed)
    assert backend.num_cached == 20
    again = backend.read_cache()
    for (k, v), (k2, v2) in zip(changed, again):
        np.testing.assert_allclose(k2, k.astype(np.float16), rtol=0, atol=0)
        np.testing.assert_allclose(v2, v.astype(np.float16), rtol=0, atol=0)
    backend.write_cache(layers)  # what llama.cpp computed, back in place: the next token's logits as before
    after_write = backend.forward(PROMPT[20:21], num_logits=1).logits
    backend.reset()
    fresh = backend.forward(PROMPT[:21], num_logits=1).logits
    torch.testing.assert_close(after_write, fresh, rtol=0, atol=1e-4)
    backend.reset()


@needs_llama_cpp
def test_a_catch_up_on_the_lean_runtime_continues_like_llama_cpp(decoder, prefiller):
    draft = CatchUpDraft(decoder.backend, prefiller.backend, min_tokens=16)
    decoder.backend.reset()
    reference = decoder.backend.forward(PROMPT, num_logits=1).logits
    decoder.backend.reset()
    got = draft.forward(PROMPT, num_logits=1).logits
    assert draft.catch_ups == 1 and draft.tokens_caught_up == len(PROMPT) - 1
    assert draft.num_cached == len(PROMPT) == decoder.backend.num_cached
    # F32 weights on both: the same model (f16 cache rows); a wrong rope layout moves logits by ~6
    torch.testing.assert_close(got, reference, rtol=0, atol=2e-2)
    # a second catch-up on top of tokens the decoder ran itself (the prefiller imports them first)
    draft.rollback(40)
    draft.forward(PROMPT[40:45], num_logits=1)  # short: on the decoder
    assert draft.catch_ups == 1
    got = draft.forward(PROMPT[45:], num_logits=2).logits
    assert draft.catch_ups == 2 and got.shape[0] == 2
    torch.testing.assert_close(got[-1:], reference, rtol=0, atol=2e-2)
    draft.reset()


@needs_llama_cpp
def test_short_inputs_stay_on_the_decoder(decoder, prefiller):
    draft = CatchUpDraft(decoder.backend, prefiller.backend, min_tokens=64)
    draft.reset()
    draft.forward(PROMPT[:60], num_logits=1)
    assert draft.catch_ups == 0 and draft.num_cached == 60
    draft.reset()


@needs_llama_cpp
def test_mismatched_or_unfit_prefillers_are_refused(decoder, prefiller):
    from conftest import tiny_llama

    with pytest.raises(ValueError, match="not the same draft model"):
        CatchUpDraft(decoder.backend, tiny_llama(0))
    with pytest.raises(ValueError, match="min_tokens must be >= 1"):
        CatchUpDraft(decoder.backend, prefiller.backend, min_tokens=0)


@needs_llama_cpp
@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_with_a_catch_up_draft_equals_plain(stories, decoder, prefiller, k):
    target = stories.backend
    params = SamplingParams(max_tokens=40)
    plain = SpeculativeEngine(target).generate(PROMPT, params).token_ids
    draft = CatchUpDraft(decoder.backend, prefiller.backend, min_tokens=16)
    draft.reset()
    out = SpeculativeEngine(target, DraftModelProposer(draft, target.vocab_size), num_speculative_tokens=k).generate(PROMPT, params)
    assert out.token_ids == plain
    assert draft.catch_ups >= 1
    assert out.stats.num_accepted_tokens > 0
