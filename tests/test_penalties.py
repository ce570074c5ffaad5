"""Penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` as per-request processing: each processor's row with a
draft path equals a straightforward reference over the committed tokens plus that path (chains and DFS-ordered
trees), only committed tokens move the state, the chain is built from :class:`SamplingParams` in vLLM's order,
and the new fields are range-checked."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.processors.base import ProcessorChain
from draftwise.processors.logit_bias import LogitBiasProcessor
from draftwise.processors.min_tokens import MinTokensProcessor
from draftwise.processors.penalties import PenaltyProcessor
from draftwise.processors.request import request_processors
from draftwise.sampling import processed_scores

VOCAB = 50


def reference_penalties(row: torch.Tensor, prompt, output, presence, frequency, repetition) -> torch.Tensor:
    """vLLM's / transformers' definitions, one token at a time over a dense row."""
    row = row.clone()
    for token in set(prompt) | set(output):
        value = float(row[token])
        row[token] = value / repetition if value > 0 else value * repetition
    for token, count in Counter(output).items():
        row[token] -= frequency * count + presence
    return row


def chain_paths(drafts):
    return [tuple(drafts[:i]) for i in range(len(drafts) + 1)]


def tree_paths(rng: random.Random, nodes: int):
    """A random tree's rows in DFS order: the root row, then each node's ancestor path (itself included)."""
    paths = [()]
    stack = [()]
    while len(paths) < nodes + 1:
        parent = rng.choice(stack)
        child = parent + (rng.randrange(VOCAB),)
        paths.append(child)
        stack.append(child)
    return paths


def random_logits(rows: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB + 3, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 7] = float("-inf")  # a masked token (a grammar's) stays masked
    return logits


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("presence, frequency, repetition", [(0.7, 0.0, 1.0), (0.0, 0.4, 1.0), (0.0, 0.0, 1.6),
                                                             (-0.5, 1.3, 0.7), (1.5, -0.3, 1.2)])
def test_penalty_rows_equal_the_reference_over_committed_tokens_plus_the_path(shape, presence, frequency, repetition):
    rng = random.Random(hash((shape, presence, frequency, repetition)) % 1000)
    prompt = [rng.randrange(VOCAB) for _ in range(12)]
    processor = PenaltyProcessor(presence, frequency, repetition, prompt)
    committed: list[int] = []
    for step in range(4):
        paths = chain_paths([rng.randrange(VOCAB) for _ in range(5)]) if shape == "chain" else tree_paths(rng, 9)
        logits = random_logits(len(paths), step)
        expected = torch.stack([reference_penalties(logits[i], prompt, committed + list(path), presence, frequency,
                                                    repetition) for i, path in enumerate(paths)])
        processor.apply(logits, paths)
        torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
        chunk = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))]  # not the drafts: they leave no trace
        processor.accept(chunk)
        committed += chunk
    assert processor.num_committed == len(committed)


def test_penalties_count_the_output_only_and_repetition_also_the_prompt():
    logits = torch.full((1, VOCAB), 2.0)
    PenaltyProcessor(presence_penalty=1.0, frequency_penalty=0.5, prompt_ids=[3]).apply(logits, [(4, 4)])
    assert float(logits[0, 3]) == 2.0  # the prompt: no presence / frequency penalty
    assert float(logits[0, 4]) == 2.0 - 1.0 - 2 * 0.5
    logits = torch.tensor([[2.0, -2.0, 2.0, 0.5]])
    PenaltyProcessor(repetition_penalty=2.0, prompt_ids=[0, 1]).apply(logits, [(3,)])
    assert logits.tolist() == [[1.0, -4.0, 2.0, 0.25]]


def test_an_applied_path_leaves_no_trace():
    processor = PenaltyProcessor(0.5, 0.5, 1.3, [1, 2])
    fresh = PenaltyProcessor(0.5, 0.5, 1.3, [1, 2])
    processor.accept([5, 6])
    fresh.accept([5, 6])
    processor.apply(torch.randn(4, VOCAB), chain_paths([9, 10, 11]))
    logits = torch.randn(1, VOCAB)
    expected = logits.clone()
    processor.apply(logits, [()])
    fresh.apply(expected, [()])
    assert torch.equal(logits, expected)


def test_many_seen_tokens_grow_the_tables():
    processor = PenaltyProcessor(frequency_penalty=0.25, repetition_penalty=1.1, prompt_ids=range(100))
    processor.accept(list(range(90, 300)) + [299])
    logits = torch.ones(1, 400)
    processor.apply(logits, [(350,)])
    assert float(logits[0, 10]) == pytest.approx(1 / 1.1)
    assert float(logits[0, 299]) == pytest.approx(1 / 1.1 - 0.5)
    assert float(logits[0, 350]) == pytest.approx(1 / 1.1 - 0.25)
    assert float(logits[0, 399]) == 1.0


def test_logit_bias_adds_the_same_bias_to_every_row_and_checks_ids():
    processor = LogitBiasProcessor([(3, 5.0), (9, -100.0)], VOCAB)
    logits = torch.zeros(3, VOCAB + 2)
    processor.apply(logits, chain_paths([1, 2]))
    assert logits[:, 3].tolist() == [5.0] * 3 and logits[:, 9].tolist() == [-100.0] * 3
    assert float(logits.abs().sum()) == 3 * 105.0
    processor.accept([3])  # no state
    with pytest.raises(ValueError, match="outside the vocabulary"):
        LogitBiasProcessor([(VOCAB, 1.0)], VOCAB)
    with pytest.raises(ValueError, match="fewer than"):
        processor.apply(torch.zeros(1, 5), [()])


def test_min_tokens_forbids_stops_below_the_minimum_per_row():
    stops = (0, 2)
    processor = MinTokensProcessor(3, stops)
    processor.accept([5])  # one output token
    paths = chain_paths([6, 7, 8])  # rows at output positions 1, 2, 3, 4
    logits = torch.zeros(len(paths), VOCAB)
    processor.apply(logits, paths)
    forbidden = torch.isneginf(logits)
    assert forbidden[:, list(stops)].tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert int(forbidden.sum()) == 4
    # a path through a refused stop token is processed as its admitted prefix
    logits = torch.zeros(2, VOCAB)
    processor.apply(logits, [(0,), (0, 9)])
    assert torch.isneginf(logits[:, 0]).all()
    assert processor.valid_prefix([5, 0, 6]) == 1
    assert processor.valid_prefix([5, 6, 0]) == 3  # the stop at output position 3 is allowed
    processor.accept([6, 7])
    logits = torch.zeros(1, VOCAB)
    processor.apply(logits, [()])
    assert not torch.isneginf(logits).any()


def test_min_tokens_keeps_stops_where_nothing_else_is_allowed():
    """A grammar that must end allows only the stop tokens: they stay (the output ends early), no row is empty."""
    processor = ProcessorChain([MinTokensProcessor(5, [0])])
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[0, 0] = 1.0  # only the stop token
    logits[1, [0, 4]] = 1.0
    processor.apply(logits, [(), (3,)])
    assert float(logits[0, 0]) == 1.0
    assert torch.isneginf(logits[1, 0]) and float(logits[1, 4]) == 1.0


def test_request_processors_follow_the_given_ones_in_vllms_order():
    given = ProcessorChain([LogitBiasProcessor([(1, 1.0)], VOCAB)])
    assert request_processors(SamplingParams(), [1], [0], VOCAB) is None
    assert request_processors(SamplingParams(), [1], [0], VOCAB, given) is given
    assert request_processors(SamplingParams(min_tokens=3, ignore_eos=True), [1], [], VOCAB) is None
    params = SamplingParams(presence_penalty=0.1, logit_bias={4: 1.0}, min_tokens=2, max_tokens=4)
    chain = request_processors(params, [1], [0], VOCAB, given)
    assert [type(p) for p in chain.processors] == [LogitBiasProcessor, MinTokensProcessor, LogitBiasProcessor,
                                                   PenaltyProcessor]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        request_processors(SamplingParams(logit_bias={VOCAB: 1.0}), [1], [0], VOCAB)


def test_bias_then_repetition_penalty_as_vllm():
    """vLLM applies logit_bias before the penalties: the repetition penalty divides the biased logit."""
    chain = request_processors(SamplingParams(logit_bias={3: 2.0}, repetition_penalty=2.0), [3], [0], VOCAB)
    logits = torch.ones(1, VOCAB)
    chain.apply(logits, [()])
    assert float(logits[0, 3]) == 1.5


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.7, min_p=min_p)
    scores = processed_scores(logits, params)
    probs = torch.softmax(logits / 0.7, dim=-1)
    expected = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    assert torch.equal(torch.isfinite(scores), expected)
    kept = torch.isfinite(scores)
    torch.testing.assert_close(scores[kept], (logits / 0.7)[kept])


def test_min_p_acts_before_top_k():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0]])
    scores = processed_scores(logits, SamplingParams(temperature=1.0, min_p=0.5, top_k=3))
    assert torch.isfinite(scores).tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"), ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
])
def test_bad_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_logit_bias_is_stored_as_sorted_pairs():
    params = SamplingParams(logit_bias={9: -1, 2: 100})
    assert params.logit_bias == ((2, 100.0), (9, -1.0))
    assert hash(params) == hash(SamplingParams(logit_bias=((9, -1.0), (2, 100.0))))
