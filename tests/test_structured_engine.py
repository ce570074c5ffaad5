"""Grammars through the speculative engine: the output under a grammar is exactly what plain decoding under the
same grammar gives (greedy token for token, coupled sampling with a seed likewise, rejection sampling in
distribution), for every proposer, K, chains and trees; constrained output parses and validates; forced tokens
are drafted for free (jump-forward)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import tiny_llama
from draftwise.config import SamplingParams
from draftwise.engine import EngineCore, one_slot_core
from draftwise.processors.base import ProcessorChain
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer
from draftwise.proposers.suffix import SuffixProposer
from draftwise.structured.grammar import GrammarCompiler, TokenVocabulary
from draftwise.structured.spec import JsonSchema, Regex
from fakes import BigramLM

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
PROMPTS = ["Once upon a time", "Lily and Ben went to the park. They saw"]


def run(core: EngineCore, prompt: list[int], params: SamplingParams, processors=None):
    sequence = core.add(prompt, params, processors=processors)
    while not sequence.finish_reason:
        core.step()
    return sequence.result


@pytest.fixture(scope="module")
def grammars(stories):
    vocabulary = TokenVocabulary.from_huggingface(stories.tokenizer, stop_token_ids=stories.eos_token_ids,
                                                  vocab_size=stories.backend.vocab_size)
    return GrammarCompiler(vocabulary)


def person(grammars) -> ProcessorChain:
    return ProcessorChain([grammars.processor(JsonSchema(PERSON))])


def check_person(stories, result) -> None:
    if result.finish_reason == "stop":
        value = json.loads(stories.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        assert set(value) == {"name", "age", "pets"} and isinstance(value["age"], int), value


PROPOSERS = {
    "ngram": lambda stories, draft: NgramProposer(1, 3),
    "suffix": lambda stories, draft: SuffixProposer(),
    "draft_model": lambda stories, draft: DraftModelProposer(draft.backend, stories.backend.vocab_size),
}


@pytest.mark.parametrize("method, k", [(m, k) for m in PROPOSERS for k in (1, 4, 8)])
def test_greedy_output_under_a_grammar_is_plain_decodings(stories, stories_draft, grammars, method, k):
    params = SamplingParams(max_tokens=64)
    plain = one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids)
    spec = one_slot_core(stories.backend, PROPOSERS[method](stories, stories_draft), k, stories.eos_token_ids)
    for text in PROMPTS:
        prompt = stories.encode(text)
        oracle = run(plain, prompt, params, person(grammars))
        result = run(spec, prompt, params, person(grammars))
        assert result.token_ids == oracle.token_ids, (method, k, text)
        assert result.finish_reason == oracle.finish_reason
        check_person(stories, result)
        assert result.stats.num_jump_forward_tokens > 0  # the schema's fixed keys are forced
        assert result.stats.processor_time_s > 0


def test_the_grammar_changes_the_output_and_is_followed(stories, grammars):
    """The check above could pass with the grammar ignored by both engines: it is not."""
    params = SamplingParams(max_tokens=64)
    plain = one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids)
    prompt = stories.encode(PROMPTS[0])
    free = run(plain, prompt, params)
    constrained = run(plain, prompt, params, person(grammars))
    assert constrained.token_ids != free.token_ids
    assert stories.tokenizer.decode(constrained.token_ids, skip_special_tokens=True).startswith('{"name": "')


@pytest.mark.parametrize("k", [1, 4])
def test_coupled_sampling_with_a_seed_is_plain_decodings_text_under_a_grammar(stories, stories_draft, grammars, k):
    params = SamplingParams(max_tokens=48, temperature=0.9, seed=7, sampling="coupled")
    plain = one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids)
    spec = one_slot_core(stories.backend, DraftModelProposer(stories_draft.backend, stories.backend.vocab_size), k,
                         stories.eos_token_ids)
    for text in PROMPTS:
        prompt = stories.encode(text)
        assert run(spec, prompt, params, person(grammars)).token_ids == \
            run(plain, prompt, params, person(grammars)).token_ids


# ---------------------------------------------------------------------- trees, on a character vocabulary
CHARS = [b"</s>"] + [bytes([c]) for c in range(33, 128)]  # id 0 stops; ids 1..95 are '!'..'\x7f'


@pytest.mark.parametrize("width, k", [(2, 3), (3, 4)])
def test_draft_trees_under_a_grammar_are_exact(width, k):
    from draftwise.backends.lean import build_lean
    from draftwise.backends.quantization import int8_kernels_available

    mode = "int8" if int8_kernels_available() else "none"
    hf, weak = tiny_llama(3), tiny_llama(4)
    target = build_lean(hf.model, quantization=mode, name="tiny")
    draft = build_lean(weak.model, quantization=mode, name="weak")
    compiler = GrammarCompiler(TokenVocabulary.from_token_bytes(CHARS, stop_token_ids=[0]))
    spec = Regex(r"[a-f]{2,6}(,[a-f0-9]{1,4}){1,5};")
    params = SamplingParams(max_tokens=40)
    plain = one_slot_core(target, eos_token_ids=[0])
    tree = one_slot_core(target, DraftModelProposer(draft, 96, tree_width=width), k, [0])
    for prompt in ([5, 6, 7], [40, 41, 42, 43]):
        oracle = run(plain, prompt, params, ProcessorChain([compiler.processor(spec)]))
        result = run(tree, prompt, params, ProcessorChain([compiler.processor(spec)]))
        assert result.token_ids == oracle.token_ids, (width, k, prompt)
        text = bytes(b"".join(CHARS[t] for t in result.token_ids)).decode()
        assert result.finish_reason != "stop" or text.endswith(";"), text
        assert result.stats.num_tree_nodes > 0


# ---------------------------------------------------------------------- rejection sampling keeps the distribution
def test_rejection_sampling_keeps_the_masked_distribution():
    """Tokens 1..4 are 'a'..'d'; the grammar admits [ab][bcd][a-d]. The speculative engine's 3-token outputs,
    sampled with a different draft model (rejection sampling), follow the target's distribution masked by the
    grammar at each position."""
    vocab, draws = 5, 4000
    gen = torch.Generator().manual_seed(0)
    target_table, draft_table = torch.randn(vocab, vocab, generator=gen) * 1.5, torch.randn(vocab, vocab,
                                                                                          generator=gen) * 1.5
    compiler = GrammarCompiler(TokenVocabulary.from_token_bytes([b"</s>", b"a", b"b", b"c", b"d"],
                                                                stop_token_ids=[0]))
    spec = Regex("[ab][bcd][a-d]")
    allowed = [{1, 2}, {2, 3, 4}, {1, 2, 3, 4}]
    engine = one_slot_core(BigramLM(target_table), DraftModelProposer(BigramLM(draft_table), vocab), 2)
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(draws):
        params = SamplingParams(temperature=0.8, max_tokens=3, seed=seed, sampling="rejection", ignore_eos=True)
        result = run(engine, [1], params, ProcessorChain([compiler.processor(spec)]))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    expected = {}
    for seq in itertools.product(range(vocab), repeat=3):
        p, prev = 1.0, 1
        for position, token in enumerate(seq):
            logits = target_table[prev] / 0.8
            mask = torch.full((vocab,), float("-inf"))
            mask[list(allowed[position])] = 0.0
            p *= float(torch.softmax(logits + mask, dim=-1)[token])
            prev = token
        if p > 0:
            expected[seq] = p
    assert set(counts) <= set(expected)
    tv = 0.5 * sum(abs(counts.get(s, 0) / draws - p) for s, p in expected.items())
    assert tv < 0.05, tv
    assert 0 < accepted < drafted
