"""Penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` through the speculative engine: the output is exactly
plain decoding's under the same fields (greedy token for token and coupled sampling with a seed, for every
proposer, K, chains and trees, alone and in a batch), and rejection sampling keeps the processed distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import first_layer_copy, tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.quantization import int8_kernels_available
from draftwise.config import SamplingParams
from draftwise.engine import EngineCore, one_slot_core
from draftwise.proposers.base import PerSequenceProposers
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer
from draftwise.proposers.suffix import SuffixProposer
from fakes import BigramLM

MODE = "int8" if int8_kernels_available() else "none"
PROMPT = "Once upon a time"
PROPOSERS = {
    "ngram": lambda stories, draft: NgramProposer(1, 3),
    "suffix": lambda stories, draft: SuffixProposer(),
    "draft_model": lambda stories, draft: DraftModelProposer(draft.backend, stories.backend.vocab_size),
}


def run(core: EngineCore, prompt: list[int], params: SamplingParams, processors=None):
    sequence = core.add(prompt, params, processors=processors)
    while not sequence.finish_reason:
        core.step()
    return sequence.result


def every_field(stories, **overrides) -> SamplingParams:
    """Every field at once: '.' stops the story, but not before 20 tokens; ' the' is pushed up."""
    period, the = stories.encode(".")[-1], stories.encode(" the")[-1]
    fields = dict(max_tokens=40, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2,
                  logit_bias={the: 2.0}, min_tokens=20, stop_token_ids=(period,))
    return SamplingParams(**{**fields, **overrides})


@pytest.fixture(scope="module")
def oracle(stories):
    """Plain decoding of :data:`PROMPT` under :func:`every_field`."""
    plain = one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids)
    return run(plain, stories.encode(PROMPT), every_field(stories))


def test_each_field_changes_the_greedy_output(stories, oracle):
    """The exactness checks below could pass with the fields ignored by both engines: they are not."""
    plain = one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids)
    prompt = stories.encode(PROMPT)
    period = stories.encode(".")[-1]
    free = run(plain, prompt, SamplingParams(max_tokens=40, stop_token_ids=(period,)))
    assert len(free.token_ids) < 20 and free.finish_reason == "stop"  # the first sentence ends early
    assert len(oracle.token_ids) >= 20 and period not in oracle.token_ids[:20]
    base = run(plain, prompt, SamplingParams(max_tokens=30)).token_ids
    for change in (dict(presence_penalty=1.0), dict(frequency_penalty=1.0), dict(repetition_penalty=1.5),
                   dict(logit_bias={stories.encode(" cat")[-1]: 12.0})):
        assert run(plain, prompt, SamplingParams(max_tokens=30, **change)).token_ids != base, change


@pytest.mark.parametrize("method, k", [(m, k) for m in PROPOSERS for k in (1, 4, 8)])
def test_greedy_output_with_every_field_is_plain_decodings(stories, stories_draft, oracle, method, k):
    spec = one_slot_core(stories.backend, PROPOSERS[method](stories, stories_draft), k, stories.eos_token_ids)
    result = run(spec, stories.encode(PROMPT), every_field(stories))
    assert result.token_ids == oracle.token_ids, (method, k)
    assert result.finish_reason == oracle.finish_reason
    assert result.stats.num_draft_tokens > 0
    assert result.stats.processor_time_s > 0


@pytest.mark.parametrize("method, k", [("draft_model", 1), ("draft_model", 4), ("ngram", 4), ("suffix", 8)])
def test_coupled_sampling_with_a_seed_is_plain_decodings_text(stories, stories_draft, method, k):
    params = every_field(stories, temperature=0.9, seed=11, sampling="coupled", min_p=0.05)
    prompt = stories.encode(PROMPT)
    plain = run(one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids), prompt, params)
    spec = one_slot_core(stories.backend, PROPOSERS[method](stories, stories_draft), k, stories.eos_token_ids)
    result = run(spec, prompt, params)
    assert result.token_ids == plain.token_ids, (method, k)
    assert result.stats.num_draft_tokens > 0


# ---------------------------------------------------------------------- trees and batches, on tiny lean Llamas
TINY_FIELDS = dict(max_tokens=32, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4,
                   logit_bias={5: 3.0, 9: -2.0}, min_tokens=12, stop_token_ids=(40,))


@pytest.fixture(scope="module")
def tiny_pair():
    hf = tiny_llama(3).model
    return build_lean(hf, quantization=MODE, name="tiny"), build_lean(first_layer_copy(hf), quantization=MODE,
                                                                      name="weak")


@pytest.mark.parametrize("width, k", [(2, 3), (3, 4)])
def test_draft_trees_with_every_field_are_exact(tiny_pair, width, k):
    target, draft = tiny_pair
    plain = one_slot_core(target, eos_token_ids=[1])
    for proposer in (DraftModelProposer(draft, 96, tree_width=width), SuffixProposer(tree_width=width)):
        tree = one_slot_core(target, proposer, k, [1])
        for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43]):
            params = SamplingParams(**TINY_FIELDS)
            oracle = run(plain, prompt, params)
            result = run(tree, prompt, params)
            assert result.token_ids == oracle.token_ids, (type(proposer).__name__, width, k, prompt)
            assert len(oracle.token_ids) >= 12
        assert result.stats.num_draft_tokens > 0


def test_with_a_grammar_that_must_end_before_min_tokens_the_output_ends_and_stays_exact(tiny_pair):
    """The grammar's mask comes first; where it allows only the stop token, min_tokens yields (no empty row)."""
    from draftwise.processors.base import ProcessorChain
    from draftwise.structured.grammar import GrammarCompiler, TokenVocabulary
    from draftwise.structured.spec import Regex

    target, draft = tiny_pair
    chars = [bytes([c]) for c in range(33, 128)] + [b"</s>"]  # ids 0..94 are '!'..'\x7f'; id 95 stops (not the
    compiler = GrammarCompiler(TokenVocabulary.from_token_bytes(chars, stop_token_ids=[95]))  # argmax of -inf's)
    spec = Regex(r"[a-f]{2,6}(,[a-f0-9]{1,4}){1,5};")  # at most 32 characters
    params = SamplingParams(max_tokens=40, min_tokens=36, presence_penalty=0.5, repetition_penalty=1.3)
    plain = one_slot_core(target, eos_token_ids=[95])
    tree = one_slot_core(target, DraftModelProposer(draft, 96, tree_width=2), 4, [95])
    for prompt in ([5, 6, 7], [40, 41, 42, 43]):
        oracle = run(plain, prompt, params, ProcessorChain([compiler.processor(spec)]))
        result = run(tree, prompt, params, ProcessorChain([compiler.processor(spec)]))
        assert result.token_ids == oracle.token_ids, prompt
        text = bytes(b"".join(chars[t] for t in oracle.token_ids)).decode()
        assert oracle.finish_reason == "stop" and text.endswith(";") and len(text) < 36, text


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 4, "min_p": 0.1}])
def test_a_draft_model_drafts_from_the_processed_distribution(tiny_pair, sampling):
    """The target's own weights as the draft accept every draft token only if the draft's rows are processed
    with the same fields and paths as the target's."""
    target, _ = tiny_pair
    same = build_lean(tiny_llama(3).model, quantization=MODE, name="same")
    params = SamplingParams(**{**TINY_FIELDS, **sampling})
    spec = one_slot_core(target, DraftModelProposer(same, 96), 4, [1])
    result = run(spec, [5, 6, 7, 5, 6, 7, 5, 6], params)
    assert result.token_ids == run(one_slot_core(target, eos_token_ids=[1]), [5, 6, 7, 5, 6, 7, 5, 6],
                                   params).token_ids
    assert result.stats.num_accepted_tokens == result.stats.num_draft_tokens > 0


def test_requests_with_different_fields_in_one_batch_equal_each_alone(tiny_pair):
    target, _ = tiny_pair
    hf = tiny_llama(3).model
    multi = build_lean(hf, quantization=MODE, name="tiny-batch", num_slots=3)
    engine = EngineCore(multi, PerSequenceProposers(SuffixProposer, "suffix"), 4, eos_token_ids=[1])
    plain = one_slot_core(target, eos_token_ids=[1])
    prompts = [[5, 6, 7, 5, 6, 7], [40, 41, 42, 43], [9, 8, 9, 8, 9]]
    params = [SamplingParams(**TINY_FIELDS), SamplingParams(max_tokens=24, repetition_penalty=0.8),
              SamplingParams(max_tokens=24, frequency_penalty=-0.5, temperature=0.7, seed=3, min_p=0.1)]
    results = engine.generate(prompts, params)
    for prompt, param, result in zip(prompts, params, results):
        assert result.token_ids == run(plain, prompt, param).token_ids, param


# ---------------------------------------------------------------------- rejection sampling keeps the distribution
def processed_row(table: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                  stop: int) -> torch.Tensor:
    """The reference next-token distribution after ``prompt + output`` for a bigram target: logit_bias, then
    repetition, frequency and presence penalties, min_tokens, temperature, min_p (vLLM's definitions)."""
    row = table[(prompt + output)[-1]].clone()
    for token, bias in params.logit_bias:
        row[token] += bias
    for token in set(prompt) | set(output):
        row[token] = row[token] / params.repetition_penalty if row[token] > 0 else row[token] * \
            params.repetition_penalty
    for token, count in Counter(output).items():
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    if len(output) < params.min_tokens:
        row[stop] = float("-inf")
    probs = torch.softmax(row / params.temperature, dim=-1)
    probs[probs < params.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def outcome_distribution(table, prompt, params, stop) -> dict[tuple, float]:
    """Every (output, finish reason) of ``params.max_tokens`` steps with its probability."""
    expected: dict[tuple, float] = {}

    def walk(output: list[int], p: float) -> None:
        if len(output) == params.max_tokens:
            expected[(tuple(output), "length")] = p
            return
        probs = processed_row(table, prompt, output, params, stop)
        for token in range(len(probs)):
            q = float(probs[token])
            if q <= 0:
                continue
            if token == stop:
                expected[(tuple(output), "stop")] = p * q
            else:
                walk(output + [token], p * q)

    walk([], 1.0)
    return expected


def test_rejection_sampling_keeps_the_processed_distribution():
    """Token 0 stops. A speculative engine with a different draft model (rejection sampling) gives outputs
    distributed as the target's processed distribution at each position, the counts including the drafted path."""
    vocab, draws = 5, 4000
    gen = torch.Generator().manual_seed(0)
    target_table = torch.randn(vocab, vocab, generator=gen) * 1.5
    draft_table = torch.randn(vocab, vocab, generator=gen) * 1.5
    base = SamplingParams(temperature=0.8, max_tokens=4, presence_penalty=0.6, frequency_penalty=0.5,
                          repetition_penalty=1.5, logit_bias={2: 0.8}, min_tokens=2, min_p=0.05,
                          sampling="rejection")
    engine = one_slot_core(BigramLM(target_table), DraftModelProposer(BigramLM(draft_table), vocab), 3, [0])
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(draws):
        result = run(engine, [1], SamplingParams(**{**base.__dict__, "seed": seed}))
        counts[(tuple(result.token_ids), result.finish_reason)] += 1
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    expected = outcome_distribution(target_table, [1], base, stop=0)
    assert set(counts) <= set(expected)
    tv = 0.5 * sum(abs(counts[o] / draws - p) for o, p in expected.items())
    assert tv < 0.05, tv
    assert 0 < accepted < drafted
    unprocessed = outcome_distribution(target_table, [1], SamplingParams(temperature=0.8, max_tokens=4), stop=0)
    assert 0.5 * sum(abs(expected.get(o, 0) - unprocessed.get(o, 0)) for o in set(expected) | set(unprocessed)) > 0.2
