"""Suffix decoding: the index against brute force, drafting rules, greedy exactness, lossless sampling,
incremental update cost, scope isolation and the cross-request cache's bounds."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_llama
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.suffix import (
    SUFFIX_NODE_BYTES,
    SuffixCache,
    SuffixIndex,
    SuffixProposer,
    best_draft,
    speculate,
)
from fakes import BigramLM, peaked_table, sequence_distribution

GREEDY = SamplingParams()
KS = [1, 2, 4, 8]


def plain(target, prompt, params, eos=()):
    return SpeculativeEngine(target, eos_token_ids=eos).generate(prompt, params)


def with_suffix(target, prompt, params, k, eos=(), **options):
    return SpeculativeEngine(target, SuffixProposer(**options), k, eos_token_ids=eos).generate(prompt, params)


def propose(proposer, context, k):
    return proposer.propose(context, k, GREEDY, torch.Generator())


# ---------------------------------------------------------------------------------------------- index vs brute force
def brute_force(sequences, depth):
    """Occurrences of every substring of at most ``depth`` tokens, and of those followed by a token (within
    the depth bound)."""
    count, cont = Counter(), Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for length in range(1, min(depth, len(seq) - i) + 1):
                path = tuple(seq[i : i + length])
                count[path] += 1
                if length < depth and i + length < len(seq):
                    cont[path] += 1
    return count, cont


def trie_contents(index):
    """path -> (count, cont) for every node, checking each node's invariants on the way."""
    out = {}
    stack = [((), index.root)]
    while stack:
        path, node = stack.pop()
        children = node.children or {}
        assert node.cont == sum(child.count for child in children.values())
        if path:
            out[path] = (node.count, node.cont)
            assert node.depth == len(path) and node.token == path[-1]
            link = index.find(path[1:])
            assert node.link is link
        for token, child in children.items():
            assert child.parent is node
            stack.append((path + (token,), child))
    return out


def assert_matches_brute_force(index, sequences):
    count, cont = brute_force(sequences, index.max_depth)
    assert trie_contents(index) == {path: (n, cont[path]) for path, n in count.items()}
    assert index.num_tokens == sum(len(s) for s in sequences)


ops = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30), st.lists(st.integers(0, 3), max_size=10)),
               min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(steps=ops, depth=st.integers(2, 6))
def test_index_equals_brute_force_through_appends_truncations_and_removals(steps, depth):
    """Three sequences share one trie; each step truncates one of them (or removes and re-adds it) and appends
    tokens: counts, continuation counts and suffix links must equal a brute-force count of the sequences."""
    index = SuffixIndex(depth)
    ids = [index.add_sequence() for _ in range(3)]
    for which, keep, new in steps:
        if keep == 30:  # remove the sequence entirely and start a new one in its place
            index.remove_sequence(ids[which])
            ids[which] = index.add_sequence()
        else:
            index.truncate(ids[which], keep)
        index.extend(ids[which], new)
        assert_matches_brute_force(index, [index.sequence(i) for i in ids])


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2), max_size=40), cut=st.integers(0, 40), more=st.lists(st.integers(0, 2), max_size=10))
def test_single_sequence_truncate_rebuild_equals_fresh_index(tokens, cut, more):
    index = SuffixIndex(4)
    seq = index.add_sequence()
    index.extend(seq, tokens)
    index.truncate(seq, cut)
    index.extend(seq, more)
    assert index.sequence(seq) == tokens[:cut] + more
    assert_matches_brute_force(index, [tokens[:cut] + more])


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), window=st.lists(st.integers(0, 4), max_size=6))
def test_match_finds_the_longest_occurring_suffix(tokens, window):
    index = SuffixIndex(7)
    index.extend(index.add_sequence(), tokens)
    node = index.match(window)
    count, _ = brute_force([tokens], 7)
    expected = next((n for n in range(len(window), 0, -1) if tuple(window[len(window) - n :]) in count), 0)
    assert node.depth == expected
    assert node is index.find(window[len(window) - expected :])


# ---------------------------------------------------------------------------------------------- drafting rules
def test_speculate_follows_frequencies_and_stops_below_the_threshold():
    index = SuffixIndex(8)
    index.extend(index.add_sequence(), [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    node = index.find([1, 2])  # 4 occurrences, 3 continued: 3 twice, 4 once
    assert (node.count, node.cont) == (4, 3)
    chain = speculate(node, 5, min_prob=0.5)
    # 3 (2/3), then "1 2 3" -> 1 (2/2), -> 2 (2/2), then "1 2 3 1 2" -> 3 or 4 at 1/2 each: 1/3 < 0.5 stops
    assert chain.token_ids == (3, 1, 2)
    assert chain.probs == pytest.approx((2 / 3, 2 / 3, 2 / 3))
    assert chain.score == pytest.approx(2.0) and chain.is_chain
    assert speculate(node, 2, min_prob=0.5).token_ids == (3, 1)  # depth cap
    assert speculate(node, 5, min_prob=0.7).token_ids == ()  # even the first token is below the threshold
    tree = speculate(node, 5, min_prob=0.3, width=2)
    assert not tree.is_chain
    assert set(zip(tree.token_ids, tree.parents)) >= {(3, -1), (4, -1)}
    assert all(parent < i for i, parent in enumerate(tree.parents))  # topological
    assert list(tree.probs) == sorted(tree.probs, reverse=True)
    assert tree.score == pytest.approx(sum(tree.probs))


def test_draft_length_follows_the_match_length_and_k():
    index = SuffixIndex(24)
    index.extend(index.add_sequence(), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    # a 1-token match may draft floor(1.0 * 1) = 1 token, a 3-token match 3 tokens
    assert best_draft(index, [5, 9], 8, 1.0, 0.1).token_ids == (10,)
    assert best_draft(index, [7, 8, 9], 8, 1.0, 0.1).token_ids == (10, 11, 12)
    assert best_draft(index, [7, 8, 9], 8, 2.0, 0.1).token_ids == (10, 11, 12, 13, 14, 15)
    assert best_draft(index, [7, 8, 9], 2, 2.0, 0.1).token_ids == (10, 11)  # K caps it
    assert best_draft(index, [99], 8, 1.0, 0.1).token_ids == ()


def test_proposer_drafts_the_period_and_nothing_without_a_match():
    proposer = SuffixProposer(max_tree_depth=24)
    assert propose(proposer, [3, 4, 5, 6, 7] * 4 + [3, 4], 5).token_ids == (5, 6, 7, 3, 4)
    assert propose(proposer, [1, 2, 3], 4).token_ids == ()
    assert propose(proposer, [5], 3).token_ids == ()
    assert proposer.local.sequence(0) == [5]  # rolled back to the new context


def test_ambiguous_continuations_give_shorter_drafts_or_trees():
    context = [8, 7, 1, 2, 3, 8, 7, 1, 2, 4, 8, 7, 1, 2]  # every matched suffix went on with 3 once and 4 once
    chain = propose(SuffixProposer(min_token_prob=0.6), context, 4)
    assert chain.token_ids == ()  # each 1/2 < 0.6
    tree = propose(SuffixProposer(min_token_prob=0.3, tree_width=2), context, 4)
    assert tree.is_tree and {tree.token_ids[i] for i, p in enumerate(tree.parents) if p == -1} == {3, 4}
    assert tree.depth <= 4


# ---------------------------------------------------------------------------------------------- greedy exactness
REPETITIVE_PROMPTS = [
    [3, 4, 5, 6, 7] * 8,
    [1, 1, 1, 1, 1, 1, 2, 1, 1, 1],
    [2, 9, 2, 9, 4, 2, 9, 2, 9, 4, 2, 9],
    [5, 8],
]


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("prompt", REPETITIVE_PROMPTS)
def test_bigram_exactness(k, width, prompt):
    target = BigramLM(peaked_table(12, seed=7))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    oracle = plain(target, prompt, params)
    result = with_suffix(target, prompt, params, k, tree_width=width, min_token_prob=0.05)
    assert result.token_ids == oracle.token_ids
    assert result.stats.num_accepted_tokens > 0  # the greedy bigram output cycles, which the index predicts
    assert result.stats.num_target_passes < len(oracle.token_ids)


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_llama(seed=0)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("options", [{}, {"max_tree_depth": 3}, {"min_token_prob": 0.0, "max_spec_factor": 4.0},
                                     {"tree_width": 2, "min_token_prob": 0.2}])
def test_tiny_llama_exactness(tiny_target, k, options):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in ([3, 17, 42, 5] * 6, [9, 9, 9, 9, 9, 9, 9, 9], [11, 12, 13, 14, 15, 16, 11, 12, 13]):
        oracle = plain(tiny_target, prompt, params)
        result = with_suffix(tiny_target, prompt, params, k, **options)
        assert result.token_ids == oracle.token_ids, (prompt, k, options)


STORY_TEXTS = [
    "Once upon a time",
    "Lily said: the cat is on the mat. Ben said: the cat is on the mat. Lily said: the cat is on the mat. Ben said:",
    "One two three. One two three. One two three. One two three. One two",
]


@pytest.mark.parametrize("k,width", [(1, 1), (2, 1), (4, 1), (8, 1), (4, 3)])
def test_stories260k_exactness(stories, k, width):
    params = SamplingParams(max_tokens=48)
    accepted = 0
    for text in STORY_TEXTS:
        prompt = stories.encode(text)
        oracle = plain(stories.backend, prompt, params, stories.eos_token_ids)
        result = with_suffix(stories.backend, prompt, params, k, stories.eos_token_ids, tree_width=width)
        assert result.token_ids == oracle.token_ids, (text, k)
        assert result.finish_reason == oracle.finish_reason
        accepted += result.stats.num_accepted_tokens
    assert accepted > 0


def test_one_proposer_serves_an_agent_loop_exactly_and_learns_from_earlier_turns(tiny_target):
    """Each turn's prompt is the previous prompt + output + a new message (an agent loop); later turns and a
    repeated request draft from the request index and the earlier outputs, and stay exact."""
    proposer = SuffixProposer()
    engine = SpeculativeEngine(tiny_target, proposer, 4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = [3, 17, 42, 5, 60, 61]
    drafted = []
    for turn in range(4):
        result = engine.generate(prompt, params)
        assert result.token_ids == plain(tiny_target, prompt, params).token_ids, turn
        drafted.append(result.stats.num_accepted_tokens)
        prompt = prompt + result.token_ids + [70 + turn, 71]
    first = [3, 17, 42, 5, 60, 61]
    again = engine.generate(first, params)
    assert again.token_ids == plain(tiny_target, first, params).token_ids
    assert proposer.cache.num_requests == 5  # every request is archived when it ends (finish)
    assert again.stats.num_accepted_tokens >= drafted[0]


# ---------------------------------------------------------------------------------------------- lossless sampling
@pytest.mark.parametrize("width", [1, 2])
def test_suffix_drafts_keep_sampling_lossless(width):
    """Bigram target at temperature 0.9, a prompt in which every bigram occurs (so every step drafts): the
    sequence distribution must equal the target's (total variation on 4000 draws), for chains and trees.
    Earlier samples feed the cross-request index, so later drafts depend on them (but not on the request's
    own randomness)."""
    length, draws = 3, 4000
    table = torch.tensor([[2.0, 0.5, -1.0], [0.0, 2.0, 0.3], [1.5, -0.5, 0.8]])
    target = BigramLM(table)
    prompt = [0, 1, 2, 0, 0, 1, 1, 2, 2, 0]
    proposer = SuffixProposer(min_token_prob=0.1, tree_width=width, max_cached_requests=50)
    engine = SpeculativeEngine(target, proposer, 3)
    counts: Counter = Counter()
    accepted = drafted = tree_steps = 0
    for seed in range(draws):
        result = engine.generate(prompt, SamplingParams(temperature=0.9, max_tokens=length, ignore_eos=True, seed=seed))
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.num_accepted_tokens
        drafted += result.stats.num_draft_tokens
        tree_steps += result.stats.num_tree_nodes > 0
    expected = sequence_distribution(table, prompt[-1], length, 0.9)
    tv = 0.5 * sum(abs(counts[s] / draws - p) for s, p in expected.items())
    assert tv < 0.04, tv
    assert 0.1 * drafted < accepted < 0.95 * drafted
    assert (tree_steps > 0) == (width > 1)


def test_seeded_sampling_is_reproducible_whatever_ran_before():
    """A seeded sampling request drafts from its own context only (earlier outputs would change how its random
    numbers are consumed), so the same request gives the same text after other requests."""
    table = peaked_table(12, seed=3, scale=1.0)
    proposer = SuffixProposer()
    engine = SpeculativeEngine(BigramLM(table), proposer, 4)
    seeded = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=11)
    prompt = [1, 2, 3, 1, 2, 3]
    first = engine.generate(prompt, seeded).token_ids
    for seed in range(4):
        engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=100 + seed))
    assert proposer.cache.num_requests == 5  # each one is archived when it ends
    assert engine.generate(prompt, seeded).token_ids == first
    assert proposer.best_draft(prompt, 4, use_earlier=True).token_ids != ()  # the earlier outputs are there


# ---------------------------------------------------------------------------------------------- incremental cost
def _text(n, seed=0):
    """Code-like text: repeated lines with small edits (many shared paths, some fresh ones)."""
    rng = random.Random(seed)
    lines = [[rng.randrange(200) for _ in range(12)] for _ in range(20)]
    out = []
    while len(out) < n:
        line = list(rng.choice(lines))
        line[rng.randrange(12)] = rng.randrange(200)
        out.extend(line)
    return out[:n]


@pytest.mark.parametrize("depth", [4, 24])
def test_update_work_per_token_is_independent_of_context_length(depth):
    """Appending one token touches exactly D nodes and removing it at most D, at 100 or 20,000 indexed tokens."""
    work = {}
    for n in (100, 20_000):
        index = SuffixIndex(depth)
        seq = index.add_sequence()
        tokens = _text(n + 1)
        index.extend(seq, tokens[:n])
        before = index.update_work
        index.append(seq, tokens[n])
        appended = index.update_work - before
        index.pop(seq)
        work[n] = (appended, index.update_work - before - appended)
    assert work[100] == work[20_000]
    assert work[100][0] == depth and work[100][1] <= depth


def test_proposer_step_work_is_independent_of_context_length():
    """Through the proposer: per step (one new committed token) the request index does D node updates and
    each index's match at most 2 (D - 1) steps, whether the context holds 200 or 20,000 tokens."""
    depth = 16
    per_step = {}
    for n in (200, 20_000):
        proposer = SuffixProposer(max_tree_depth=depth)
        tokens = _text(n + 20, seed=1)
        proposer.start(tokens[: n // 2], scope="s")
        proposer.best_draft(tokens[:n], 4)
        proposer.start(tokens[:n], scope="s")  # the first half's continuation is now an earlier output
        proposer.best_draft(tokens[:n], 4)
        earlier = proposer.cache.index("s")
        assert earlier is not None
        steps = []
        for end in range(n + 1, n + 20):
            before = (proposer.local.update_work, proposer.local.match_work, earlier.match_work)
            proposer.best_draft(tokens[:end], 4)
            after = (proposer.local.update_work, proposer.local.match_work, earlier.match_work)
            steps.append(tuple(b - a for a, b in zip(before, after)))
        per_step[n] = steps
        assert all(update == depth for update, _, _ in steps)
        assert all(local <= 2 * (depth - 1) and cached <= 2 * (depth - 1) for _, local, cached in steps)
    assert [s[0] for s in per_step[200]] == [s[0] for s in per_step[20_000]]


# ---------------------------------------------------------------------------------------------- scopes and bounds
def test_earlier_outputs_are_used_only_within_their_scope():
    secret = [90, 91, 92, 93, 94, 95]
    proposer = SuffixProposer()
    proposer.start([1, 2], scope="alice")
    proposer.best_draft([1, 2] + secret, 4)  # alice's request committed the secret
    proposer.start([1, 2, 90, 91], scope="bob")  # bob's prompt starts like alice's output...
    assert propose(proposer, [1, 2, 90, 91], 4).token_ids == ()  # ...but bob sees nothing of it
    assert proposer.local.sequence(0) == [1, 2, 90, 91]  # the request index holds bob's own tokens only
    assert proposer.cache.index("bob") is None
    proposer.start([7, 90, 91], scope="alice")
    assert propose(proposer, [7, 90, 91], 4).token_ids == (92, 93)  # alice's next request uses it
    assert proposer.cache.scopes == ("alice",)  # bob committed no output (his context ended at his prompt)


def test_no_start_means_no_archive():
    """A context proposed without start() (a calibration run) is never kept for later requests."""
    proposer = SuffixProposer()
    proposer.best_draft([5, 6, 7, 8, 9], 2)
    proposer.start([1], scope="")
    assert proposer.cache.num_requests == 0


def test_cache_evicts_the_oldest_outputs_beyond_the_request_bound():
    cache = SuffixCache(max_depth=5, max_requests=3, max_tokens=1000)
    outputs = [("a", [10 + i, 20 + i, 30 + i, 40 + i]) for i in range(3)] + [("b", [1, 2, 3]), ("a", [4, 5, 6])]
    for scope, tokens in outputs:
        cache.add(scope, tokens)
        assert cache.num_requests <= 3
    assert cache.num_requests == 3 and cache.num_tokens == 4 + 3 + 3
    kept_a = [[12, 22, 32, 42], [4, 5, 6]]
    assert_matches_brute_force(cache.index("a"), kept_a)
    assert_matches_brute_force(cache.index("b"), [[1, 2, 3]])
    assert cache.index("a").find([10, 20]) is None  # evicted


def test_cache_token_bound_and_long_outputs():
    cache = SuffixCache(max_depth=4, max_requests=100, max_tokens=10)
    for i in range(5):
        cache.add("s", [i] * 4)
        assert cache.num_tokens <= 10
    assert cache.num_requests == 2
    assert_matches_brute_force(cache.index("s"), [[3] * 4, [4] * 4])
    cache.add("t", list(range(25)))  # longer than the bound: its last 10 tokens are kept, everything else evicted
    assert cache.num_requests == 1 and cache.num_tokens == 10 and cache.scopes == ("t",)
    assert_matches_brute_force(cache.index("t"), [list(range(15, 25))])
    disabled = SuffixCache(max_depth=4, max_requests=0, max_tokens=10)
    disabled.add("s", [1, 2])
    assert disabled.num_requests == 0


def test_proposer_cache_bounds_hold_over_many_requests():
    proposer = SuffixProposer(max_cached_requests=4, max_cached_tokens=50)
    for i in range(30):
        prompt = [i % 7, 100 + i]
        proposer.start(prompt, scope=f"user{i % 3}")
        proposer.best_draft(prompt + list(range(i, i + 20)), 3)
        assert proposer.cache.num_requests <= 4 and proposer.cache.num_tokens <= 50
    total = sum(proposer.cache.index(s).num_tokens for s in proposer.cache.scopes)
    assert total == proposer.cache.num_tokens


# ---------------------------------------------------------------------------------------------- config
def test_speculative_config_builds_the_suffix_proposer():
    from draftwise.builder import build_proposer

    config = SpeculativeConfig(method="suffix", num_speculative_tokens=6, suffix_decoding_max_tree_depth=12,
                               suffix_decoding_min_token_prob=0.3, suffix_decoding_max_spec_factor=2.0,
                               suffix_decoding_max_cached_requests=5, suffix_decoding_max_cached_tokens=99,
                               suffix_decoding_tree_width=2)
    proposer, draft = build_proposer(config, target=None, device="cpu", dtype=None)  # no model needed
    assert isinstance(proposer, SuffixProposer) and draft is None
    assert (proposer.max_tree_depth, proposer.min_token_prob, proposer.max_spec_factor) == (12, 0.3, 2.0)
    assert (proposer.cache.max_requests, proposer.cache.max_tokens) == (5, 99)
    assert proposer.tree_width == 1  # no target that verifies trees: chains


def test_suffix_tree_width_is_kept_for_a_tree_capable_target(stories):
    from draftwise.builder import build_proposer

    config = SpeculativeConfig(method="suffix", suffix_decoding_tree_width=3)
    proposer, _ = build_proposer(config, stories, device="cpu", dtype=None)
    assert proposer.tree_width == 3


@pytest.mark.parametrize("fields, message", [
    ({"suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
    ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"suffix_decoding_max_spec_factor": 0.0}, "suffix_decoding_max_spec_factor"),
    ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"suffix_decoding_tree_width": 0}, "suffix_decoding_tree_width"),
    ({"tree_width": 2}, "not used by method 'suffix'"),
    ({"prompt_lookup_max": 6}, "not used by method 'suffix'"),
])
def test_suffix_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(method="suffix", **fields)


def _count_nodes(node) -> int:
    children = list((node.children or {}).values())
    return len(children) + sum(_count_nodes(child) for child in children)


def test_num_nodes_follows_appends_pops_and_rebuilds():
    rng = random.Random(3)
    index = SuffixIndex(6)
    seq = index.add_sequence()
    index.extend(seq, [rng.randrange(5) for _ in range(60)])
    assert index.num_nodes == _count_nodes(index.root) > 0
    index.truncate(seq, 50)  # pops
    assert index.num_nodes == _count_nodes(index.root)
    index.truncate(seq, 10)  # rebuilt (fewer kept than removed)
    assert index.num_nodes == _count_nodes(index.root)


def test_export_hands_the_request_index_over_and_archives_the_output():
    """The prefix cache keeps a request's index with its KV state: export archives the output under the scope and
    leaves the proposer a fresh index (one owner); an adopter takes it, and the entry then holds nothing."""
    proposer = SuffixProposer()
    prompt, output = [1, 2, 3, 4, 5, 1, 2, 3], [6, 7, 8]
    proposer.start(prompt, scope="s")
    proposer.best_draft(prompt + output, 3)  # indexes what the request has so far
    kept = proposer.export_state()
    assert kept.index.sequence(kept.seq) == prompt + output
    assert kept.nbytes == kept.index.num_nodes * SUFFIX_NODE_BYTES > 0
    assert proposer.local is not kept.index and proposer.local.num_tokens == 0
    assert proposer.cache.index("s").num_tokens == len(output)  # archived before the index left
    adopter = SuffixProposer()
    adopter.start(prompt + output + [9], scope="s")
    index = kept.index
    adopter.import_state(kept)
    assert adopter.local is index and kept.index is None and kept.nbytes == 0
    work = index.update_work
    adopter.best_draft(prompt + output + [9], 3)
    assert index.update_work - work <= index.max_depth  # only the new token was indexed
    other = SuffixProposer()
    other.import_state(kept)  # already taken: keeps its own empty index
    assert other.local is not index
