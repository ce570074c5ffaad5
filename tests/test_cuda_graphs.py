"""The static-cache backend (``GraphedCausalLM``, a GPU draft's runtime): on the CPU its passes run eagerly, so
these tests check what a captured graph replays there too: the static cache, the mask over it, rollback by
length and growth by refill give the logits of transformers' dynamic cache, and a draft model on it leaves the
output exactly the target's. The capture itself needs CUDA (``scripts/bench/cuda_graph_check.py``)."""

from __future__ import annotations

import pytest
import torch

from conftest import first_layer_copy, tiny_llama
from draftwise.backends.base import ContextOverflowError
from draftwise.backends.cuda_graphs import GraphedCausalLM, graph_obstacles
from draftwise.backends.torch_backend import TorchCausalLM
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
PROMPTS = [[3, 17, 42, 5], [9, 8, 7, 6, 5, 4, 3, 2] * 5, list(range(2, 90))]


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(0).model


def _pair(hf, capacity=64):
    """The same weights as a dynamic-cache backend (the reference) and a static-cache one."""
    return TorchCausalLM(hf, name="dynamic"), GraphedCausalLM(hf, name="static", capacity=capacity)


def _same(a, b):
    torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=1e-5)


def test_passes_rollbacks_and_growth_match_the_dynamic_cache(hf):
    reference, static = _pair(hf)
    assert static.capacity == 64
    static._pool = "a pool whose graphs a growth frees"  # a stale pool cannot take a new capture (PyTorch 2.11)
    steps = [("forward", list(range(5, 30))), ("forward", [7]), ("forward", [8, 9, 10]), ("rollback", 26),
             ("forward", [11, 12]), ("forward", [13]), ("rollback", 10), ("forward", list(range(20, 80))),
             ("forward", [4]), ("rollback", 0), ("forward", [6, 7, 8])]
    for kind, arg in steps:
        if kind == "rollback":
            reference.rollback(arg)
            static.rollback(arg)
        else:
            _same(reference.forward(arg), static.forward(arg))
            _same(reference.forward([arg[-1]], num_logits=1), static.forward([arg[-1]], num_logits=1))
        assert static.num_cached == reference.num_cached
    assert static.capacity == 128  # the 71st token outgrew 64 positions; the refill kept the first 10
    assert static._pool is None and static.num_graphs == 0


def test_num_logits_keeps_the_last_rows(hf):
    reference, static = _pair(hf)
    out = static.forward([3, 4, 5, 6], num_logits=2)
    assert out.logits.shape == (2, static.vocab_size) and out.logits.dtype == torch.float32
    _same(reference.forward([3, 4, 5, 6], num_logits=2), out)


def test_bad_calls_are_refused(hf):
    static = GraphedCausalLM(hf, name="static", max_context=40, capacity=16)
    with pytest.raises(ValueError, match="hidden states"):
        static.forward([3], return_hidden=True)
    with pytest.raises(NotImplementedError, match="chains only"):
        static.forward_tree([3, 4], [-1])
    static.forward([3, 4, 5])
    with pytest.raises(NotImplementedError, match="tree verification"):
        static.compact(0, [0, 2])  # not a prefix: a tree's path
    static.compact(0, [0, 1])  # a prefix: a rollback
    assert static.num_cached == 2
    static.reset()
    with pytest.raises(ContextOverflowError):
        static.forward(list(range(41)))
    with pytest.raises(ValueError, match="out of range"):
        static.forward([static.vocab_size])
    static.forward(list(range(2, 40)))  # grows to the context length, not past it
    assert static.capacity == 64 and static.num_cached == 38
    with pytest.raises(ValueError, match="rollback length"):
        static.rollback(39)
    assert not static.supports_tree and not static.supports_cache_export and not static.use_graphs


def test_a_sliding_window_model_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                           max_position_embeddings=128)
    model = MistralForCausalLM(config).eval()
    assert graph_obstacles(model)[0] == "a sliding attention window"
    with pytest.raises(ValueError, match="sliding attention window"):
        GraphedCausalLM(model)


@pytest.mark.parametrize("k", [1, 4])
def test_a_static_cache_draft_leaves_greedy_output_exact(hf, k):
    target = TorchCausalLM(hf, name="target")
    draft = GraphedCausalLM(first_layer_copy(hf), name="draft", capacity=64)
    for prompt in PROMPTS:
        plain = SpeculativeEngine(target).generate(prompt, GREEDY)
        spec = SpeculativeEngine(target, DraftModelProposer(draft, target.vocab_size), k).generate(prompt, GREEDY)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.num_draft_tokens > 0 and spec.stats.num_accepted_tokens > 0


def test_the_runtime_needs_cuda(stories_path):
    from draftwise.models.loading import load_model

    with pytest.raises(ValueError, match="needs a CUDA device"):
        load_model(str(stories_path), device="cpu", runtime="cuda-graphs")
    draft = load_model(str(stories_path), device="cpu", drafting=True)  # auto on the CPU: no graphs
    assert not isinstance(draft.backend, GraphedCausalLM)


def test_a_changed_cache_drops_its_owner_marker(hf):
    """The engine keeps a draft's sequence in a backend that cannot export its cache by marking it
    (``OneSlot.mark``); any pass or rollback by another user must clear the mark."""
    from draftwise.backends.slots import OneSlot

    static = GraphedCausalLM(hf, name="static", capacity=64)
    slot = OneSlot(static)
    static.forward([3, 4, 5])
    marker = slot.mark(0)
    assert slot.holds(0, marker, 3)
    static.rollback(3)  # to the same length: nothing changed
    assert slot.holds(0, marker, 3)
    static.forward([6])
    assert not slot.holds(0, marker, 4)
    marker = slot.mark(0)
    static.rollback(2)
    assert not slot.holds(0, marker, 2)
