"""Prefix (KV) cache reuse across requests: warm and cold caches give identical tokens, scopes never share,
the budget evicts, an early divergence reuses only the shared prefix; and the engine refuses a second
request while one is in flight."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from draftwise.config import SamplingParams
from draftwise.engine import EngineBusyError, SpeculativeEngine
from draftwise.prefix_cache import PrefixCache, PrefixEntry
from draftwise.units import parse_bytes
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer
from fakes import BigramLM, peaked_table
from llama_cpp_gate import needs_llama_cpp

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


# ----------------------------------------------------------------------------------------- the store
def entry(scope: str, tokens, nbytes: int = 10) -> PrefixEntry:
    return PrefixEntry(scope, tuple(tokens), target_state=None, proposer_state=None, target_nbytes=nbytes)


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 1024**3
    assert parse_bytes("512MB") == 512 * 1000**2
    assert parse_bytes("0") == 0
    assert parse_bytes(" 1.5 KiB ") == 1536
    for bad in ("", "-1GiB", "4 parsecs", "nan", "GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_lookup_finds_longest_prefix_within_scope():
    cache = PrefixCache(capacity_bytes=1000)
    cache.insert(entry("a", [1, 2, 3, 4]))
    cache.insert(entry("a", [1, 2, 9, 9, 9, 9]))
    cache.insert(entry("b", [1, 2, 3, 4, 5, 6, 7]))
    match = cache.lookup("a", [1, 2, 3, 4, 5, 6, 7, 8])
    assert match.length == 4 and match.entry.tokens == (1, 2, 3, 4)
    assert cache.lookup("c", [1, 2, 3]).entry is None  # another scope never matches
    assert cache.lookup("a", [7, 7]).length == 0


def test_insert_drops_covered_prefixes_and_evicts_lru():
    cache = PrefixCache(capacity_bytes=30)
    cache.insert(entry("a", [1, 2]))
    cache.insert(entry("a", [1, 2, 3]))  # covers [1, 2]
    assert len(cache) == 1
    cache.insert(entry("a", [5, 6]))
    cache.insert(entry("b", [1, 2]))
    assert len(cache) == 3 and cache.nbytes == 30
    cache.lookup("a", [1, 2, 3])  # [1, 2, 3] is now the most recently used
    cache.insert(entry("a", [8]))  # over budget: the least recently used ([5, 6]) goes
    assert cache.lookup("a", [5, 6]).entry is None
    assert cache.lookup("a", [1, 2, 3]).length == 3
    assert cache.evictions == 1
    cache.insert(entry("a", [4], nbytes=31))  # larger than the whole budget: not kept
    assert cache.lookup("a", [4]).entry is None


# ----------------------------------------------------------------------------------------- the engine
def turns(engine: SpeculativeEngine, first_prompt: list[int], follow_ups: list[list[int]], scope: str = ""):
    """An agent loop: each turn sends the whole conversation so far plus a new user part."""
    conversation, results = list(first_prompt), []
    for extra in [[]] + follow_ups:
        conversation += extra
        result = engine.generate(conversation, GREEDY) if not scope else _generate(engine, conversation, scope)
        results.append(result)
        conversation += result.token_ids
    return results


def _generate(engine, prompt, scope):
    generation = engine.stream(prompt, GREEDY, scope=scope)
    for _ in generation:
        pass
    return generation.result


def cold(target, prompt, proposer=None, k=4):
    return SpeculativeEngine(target, proposer, k).generate(prompt, GREEDY)


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_llama(seed=0), tiny_llama(seed=1)


@pytest.mark.parametrize("method", ["plain", "draft", "ngram"])
def test_warm_turns_equal_cold_prefill_and_reuse_the_conversation(tiny_pair, method):
    target, draft_backend = tiny_pair
    proposer = {"plain": None, "draft": DraftModelProposer(draft_backend, target.vocab_size),
                "ngram": NgramProposer(1, 3)}[method]
    engine = SpeculativeEngine(target, proposer, 4, prefix_cache=PrefixCache(1 << 30))
    results = turns(engine, [3, 17, 42, 5, 9], [[11, 12, 13], [20, 21]])
    conversation = [3, 17, 42, 5, 9]
    for i, (result, extra) in enumerate(zip(results, [[], [11, 12, 13], [20, 21]])):
        conversation += extra
        fresh_proposer = None if proposer is None else (
            DraftModelProposer(draft_backend, target.vocab_size) if method == "draft" else NgramProposer(1, 3))
        assert result.token_ids == cold(target, conversation, fresh_proposer).token_ids, f"turn {i}"
        # turn 1 reuses turn 0's prompt and all of its output but the last token (never fed to the cache)
        expected = 0 if i == 0 else len(conversation) - len(extra) - 1
        assert result.stats.num_cached_prompt_tokens == expected
        conversation += result.token_ids
    cache = engine.prefix_cache
    assert cache.queries == sum(r.stats.num_prompt_tokens for r in results)
    assert cache.hits == sum(r.stats.num_cached_prompt_tokens for r in results) > 0


def test_prefill_logits_after_import_are_bit_identical_on_int8(stories_path, draftwise_home):
    from draftwise.models.loading import load_model
    from draftwise.backends.quantization import int8_kernels_available

    if not int8_kernels_available():
        pytest.skip("torch build without fbgemm int8 kernels")
    backend = load_model(str(stories_path), device="cpu", quantization="int8").backend
    tokens = [1, 403, 261, 30, 13, 87, 290, 11, 56, 77, 9, 301]
    backend.reset()
    fresh = backend.forward(tokens).logits  # [12, vocab]
    kept = backend.export_cache()
    backend.reset()
    backend.forward([5, 6, 7])  # something else in between
    backend.import_cache(kept, 7)
    again = backend.forward(tokens[7:]).logits  # [5, vocab]
    assert torch.equal(again, fresh[7:])


def test_stories_warm_equals_cold(stories):
    target = stories.backend
    engine = SpeculativeEngine(target, NgramProposer(1, 3), 4, prefix_cache=PrefixCache(1 << 30))
    prompt = stories.encode("Once upon a time, there was a little girl named Lily.")
    results = turns(engine, prompt, [stories.encode(" She liked to play.")])
    conversation = prompt + results[0].token_ids + stories.encode(" She liked to play.")
    assert results[1].stats.num_cached_prompt_tokens > len(prompt)
    assert results[1].token_ids == cold(target, conversation).token_ids


def test_early_divergence_reuses_only_the_shared_prefix(tiny_pair):
    target, _ = tiny_pair
    engine = SpeculativeEngine(target, prefix_cache=PrefixCache(1 << 30))
    engine.generate([3, 17, 42, 5, 9, 10, 11], GREEDY)
    result = engine.generate([3, 17, 50, 51], GREEDY)
    assert result.stats.num_cached_prompt_tokens == 2
    assert result.token_ids == cold(target, [3, 17, 50, 51]).token_ids


def test_identical_prompt_feeds_its_last_token_again(tiny_pair):
    target, _ = tiny_pair
    engine = SpeculativeEngine(target, prefix_cache=PrefixCache(1 << 30))
    first = engine.generate([3, 17, 42, 5], GREEDY)
    second = engine.generate([3, 17, 42, 5], GREEDY)
    assert second.stats.num_cached_prompt_tokens == 3
    assert second.token_ids == first.token_ids


def test_scopes_never_share_cached_state(tiny_pair):
    target, _ = tiny_pair
    engine = SpeculativeEngine(target, prefix_cache=PrefixCache(1 << 30))
    prompt = [3, 17, 42, 5, 9]
    _generate(engine, prompt, "key-a")
    other = _generate(engine, prompt + [1, 2], "key-b")
    assert other.stats.num_cached_prompt_tokens == 0
    same = _generate(engine, prompt + [1, 2], "key-a")
    assert same.stats.num_cached_prompt_tokens == len(prompt)
    assert other.token_ids == same.token_ids


def test_tiny_budget_evicts_and_stays_exact(tiny_pair):
    target, _ = tiny_pair
    per_token = 2 * 2 * 2 * 12 * 4  # layers * (k, v) * kv_heads * head_dim * fp32 bytes
    engine = SpeculativeEngine(target, prefix_cache=PrefixCache(capacity_bytes=per_token * 40))
    engine.generate([3, 17, 42, 5], GREEDY)  # kept: 4 + 23 = 27 tokens
    engine.generate([60, 61, 62, 63], GREEDY)  # kept too: over the budget, the first one is evicted
    assert len(engine.prefix_cache) == 1 and engine.prefix_cache.evictions == 1
    result = engine.generate([3, 17, 42, 5, 7], GREEDY)
    assert result.stats.num_cached_prompt_tokens == 0
    assert result.token_ids == cold(target, [3, 17, 42, 5, 7]).token_ids


def test_disabled_cache_reuses_nothing(tiny_pair):
    target, _ = tiny_pair
    engine = SpeculativeEngine(target, prefix_cache=PrefixCache(0))
    engine.generate([3, 17, 42, 5], GREEDY)
    assert engine.generate([3, 17, 42, 5, 6], GREEDY).stats.num_cached_prompt_tokens == 0


def test_backend_without_export_reuses_its_live_sequence_only():
    target = BigramLM(peaked_table(32, seed=4))
    assert not target.supports_cache_export
    engine = SpeculativeEngine(target, NgramProposer(1, 2), 3, prefix_cache=PrefixCache(1 << 20))
    first = engine.generate([3, 4, 5], GREEDY)
    conversation = [3, 4, 5] + first.token_ids + [7]
    second = engine.generate(conversation, GREEDY)
    assert second.stats.num_cached_prompt_tokens == len(conversation) - 2
    assert second.token_ids == SpeculativeEngine(target).generate(conversation, GREEDY).token_ids
    # another engine used the backend in between: its cache is no longer this engine's sequence
    conversation += second.token_ids + [9]
    SpeculativeEngine(target).generate([1, 2], GREEDY)
    third = engine.generate(conversation, GREEDY)
    assert third.stats.num_cached_prompt_tokens == 0
    assert third.token_ids == SpeculativeEngine(target).generate(conversation, GREEDY).token_ids


def test_cancelled_request_keeps_only_committed_tokens(tiny_pair):
    target, draft = tiny_pair
    engine = SpeculativeEngine(target, DraftModelProposer(draft, target.vocab_size), 4,
                               prefix_cache=PrefixCache(1 << 30))
    generation = engine.stream([3, 17, 42, 5], GREEDY)
    chunks = iter(generation)
    received = next(chunks) + next(chunks)
    generation.close()
    conversation = [3, 17, 42, 5] + received + [8]
    result = engine.generate(conversation, GREEDY)
    assert 0 < result.stats.num_cached_prompt_tokens <= len(conversation) - 1
    assert result.token_ids == cold(target, conversation).token_ids


# ----------------------------------------------------------------------------------------- one request at a time
def test_second_generation_in_flight_is_refused(tiny_pair):
    target, _ = tiny_pair
    engine = SpeculativeEngine(target)
    first = engine.stream([3, 4, 5], GREEDY)
    chunks = iter(first)
    next(chunks)
    with pytest.raises(EngineBusyError, match="already generating"):
        engine.stream([6, 7], GREEDY)
    first.close()
    assert engine.generate([6, 7], GREEDY).token_ids  # free again once the first is closed


def test_dropped_generation_frees_the_engine(tiny_pair):
    target, _ = tiny_pair
    engine = SpeculativeEngine(target)
    engine.stream([3, 4, 5], GREEDY)  # never iterated, never kept
    assert engine.generate([6, 7], GREEDY).token_ids


# ----------------------------------------------------------------------------------------- per-request K
def test_request_may_turn_speculation_off_or_lower_k(tiny_pair):
    target, draft = tiny_pair
    engine = SpeculativeEngine(target, DraftModelProposer(draft, target.vocab_size), 4)
    oracle = cold(target, [3, 17, 42, 5])
    off = engine.stream([3, 17, 42, 5], GREEDY, num_speculative_tokens=0)
    assert list(t for chunk in off for t in chunk) == oracle.token_ids
    assert off.result.stats.num_draft_tokens == 0 and set(off.result.stats.k_history) == {0}
    two = engine.stream([3, 17, 42, 5], GREEDY, num_speculative_tokens=2)
    assert list(t for chunk in two for t in chunk) == oracle.token_ids
    assert max(two.result.stats.k_history) == 2
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            engine.stream([3, 4], GREEDY, num_speculative_tokens=bad)


# ----------------------------------------------------------------------------------------- llama.cpp


@needs_llama_cpp
def test_llama_cpp_warm_turn_equals_cold(stories_path, draftwise_home):
    """llama.cpp cannot export its cache: the engine reuses the sequence still in it (same scope only)."""
    from draftwise.models.loading import load_model

    model = load_model(str(stories_path), backend="llama.cpp", threads=1)
    target = model.backend
    assert not target.supports_cache_export
    engine = SpeculativeEngine(target, NgramProposer(1, 3), 3, prefix_cache=PrefixCache(1 << 30))
    prompt = model.encode("Once upon a time, there was a little dog.")
    first = engine.generate(prompt, GREEDY)
    conversation = prompt + first.token_ids + model.encode(" The dog ran.")
    warm = _generate(engine, conversation, "")
    assert warm.stats.num_cached_prompt_tokens == len(prompt) + len(first.token_ids) - 1
    assert warm.token_ids == SpeculativeEngine(target).generate(conversation, GREEDY).token_ids
    other_scope = _generate(engine, conversation, "someone-else")
    assert other_scope.stats.num_cached_prompt_tokens == 0
    assert other_scope.token_ids == warm.token_ids



def test_hybrid_warm_turn_reuses_its_draft_state_and_stays_exact(tiny_pair):
    from draftwise.proposers.hybrid import HybridProposer
    from draftwise.proposers.suffix import SuffixProposer
    from test_hybrid import FakeCosts

    target, draft = tiny_pair
    hybrid = HybridProposer(SuffixProposer(), DraftModelProposer(draft, target.vocab_size), FakeCosts(), max_k=4,
                            priced_by_engine=False)
    engine = SpeculativeEngine(target, hybrid, 4, prefix_cache=PrefixCache(1 << 30))
    first = engine.generate([3, 17, 42, 5], GREEDY)
    kept = engine.prefix_cache.lookup("", [3, 17, 42, 5]).entry
    assert kept.proposer_state is not None and kept.proposer_state.kv is not None  # the draft's KV is kept
    conversation = [3, 17, 42, 5] + first.token_ids + [8, 9]
    warm = engine.generate(conversation, GREEDY)
    assert warm.stats.num_cached_prompt_tokens == len(conversation) - 3
    assert warm.token_ids == cold(target, conversation).token_ids
