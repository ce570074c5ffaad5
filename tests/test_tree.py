"""Draft trees: mask and positions, verification (greedy and lossless sampling), tree passes with KV
compaction on real transformer layers, and the engine's tree path (exactness, acceptance counts)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.base import DraftProposal
from draftwise.tree import TreeTemplate, chain_parents, node_depths, path_to, tree_attention_mask, tree_position_ids
from draftwise.verification import verify_greedy, verify_rejection
from fakes import BigramLM, ScriptedTreeProposer, peaked_table, sequence_distribution

# root -> a(0), b(1); a -> c(2); c -> d(3); b -> e(4)
PARENTS = (-1, -1, 0, 2, 1)


def test_mask_and_positions_for_a_hand_built_tree():
    mask = tree_attention_mask(PARENTS, num_cached=2)
    #                 cache  root  a  b  c  d  e
    expected = [[1, 1, 1, 0, 0, 0, 0, 0],  # root
                [1, 1, 1, 1, 0, 0, 0, 0],  # a
                [1, 1, 1, 0, 1, 0, 0, 0],  # b
                [1, 1, 1, 1, 0, 1, 0, 0],  # c
                [1, 1, 1, 1, 0, 1, 1, 0],  # d
                [1, 1, 1, 0, 1, 0, 0, 1]]  # e
    assert mask.tolist() == [[bool(v) for v in row] for row in expected]
    assert tree_position_ids(PARENTS, 2).tolist() == [2, 3, 3, 4, 5, 4]
    assert node_depths(PARENTS) == [1, 1, 2, 3, 2]
    assert path_to(PARENTS, 3) == [0, 2, 3] and path_to(PARENTS, -1) == []


def test_chain_mask_is_causal():
    mask = tree_attention_mask(chain_parents(4), num_cached=3)
    assert torch.equal(mask, torch.ones(5, 8, dtype=torch.bool).tril(diagonal=3))


def test_template_parents_ranks_and_validation():
    template = TreeTemplate(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    assert template.parents == (-1, -1, 0, 0, 1, 2)
    assert template.depth == 3 and template.max_rank(1) == 2 and template.max_rank(3) == 1
    assert template.truncate(2).paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert TreeTemplate.chain(3).parents == (-1, 0, 1)
    assert len(TreeTemplate.full(4, 3, budget=7).paths) == 7
    with pytest.raises(ValueError, match="prefix"):
        TreeTemplate(((0,), (1, 0)))
    with pytest.raises(ValueError, match="non-negative"):
        TreeTemplate(((-1,),))
    with pytest.raises(ValueError, match="parent"):
        DraftProposal(token_ids=(1, 2), parents=(-1, 1))
    with pytest.raises(ValueError, match="deterministic"):
        DraftProposal(token_ids=(1, 2), draft_probs=torch.ones(2, 4) / 4, parents=(-1, -1))
    # a chain is the tree whose nodes each have one child: stored as a chain, whoever built it
    chain = DraftProposal(token_ids=(1, 2, 3), parents=(-1, 0, 1))
    assert chain.parents is None and not chain.is_tree and chain.node_parents == (-1, 0, 1)


def one_hot_rows(argmaxes, vocab=10):
    logits = torch.zeros(len(argmaxes), vocab)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


def test_greedy_tree_verification_follows_the_matching_branch():
    tokens = (4, 5, 6, 7, 8)  # a=4, b=5, c=6, d=7, e=8
    # rows: root, a, b, c, d, e. root -> 5 (b), b -> 8 (e), e -> 3 (bonus)
    result = verify_greedy(tokens, PARENTS, one_hot_rows([5, 0, 8, 0, 0, 3]))
    assert result.accepted_nodes == (1, 4) and result.token_ids == (5, 8, 3)
    result = verify_greedy(tokens, PARENTS, one_hot_rows([4, 6, 0, 7, 9, 0]))
    assert result.accepted_nodes == (0, 2, 3) and result.token_ids == (4, 6, 7, 9)
    result = verify_greedy(tokens, PARENTS, one_hot_rows([1, 0, 0, 0, 0, 0]))
    assert result.accepted_nodes == () and result.token_ids == (1,)
    with pytest.raises(ValueError):
        verify_greedy(tokens, PARENTS, one_hot_rows([1, 2]))


def test_tree_sampling_first_token_follows_the_target_distribution():
    vocab, draws = 6, 40000
    gen = torch.Generator().manual_seed(0)
    target_probs = torch.softmax(torch.randn(4, vocab, generator=gen), dim=-1)  # root + 3 nodes
    tokens, parents = (2, 0, 5), (-1, -1, 0)  # two root children, one grandchild
    counts = torch.zeros(vocab)
    accepted = 0
    for _ in range(draws):
        result = verify_rejection(tokens, parents, None, target_probs.log(), SamplingParams(temperature=1.0), gen)
        counts[result.token_ids[0]] += 1
        accepted += result.num_accepted > 0
    tv = 0.5 * float((counts / draws - target_probs[0]).abs().sum())
    assert tv < 0.01, tv
    # a root child is accepted with probability p(2) + p(0) (sequential rejection over one-hot siblings)
    expected = float(target_probs[0, 2] + target_probs[0, 0])
    assert abs(accepted / draws - expected) < 0.01


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_engine_tree_sampling_matches_the_target_sequence_distribution(sampling):
    vocab, length, draws = 4, 3, 6000
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(vocab, vocab, generator=gen) * 1.5
    target = BigramLM(table)
    oracle_guess = [1, 2, 3, 0, 1, 2]  # an arbitrary script: the tree holds it plus wrong siblings
    engine = SpeculativeEngine(target, ScriptedTreeProposer(1, oracle_guess, vocab, width=2, rank=0), 2)
    counts: dict[tuple, int] = {}
    for seed in range(draws):
        result = engine.generate([0], SamplingParams(temperature=0.8, max_tokens=length, ignore_eos=True, seed=seed,
                                                     sampling=sampling))
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    expected = sequence_distribution(table, 0, length, 0.8)
    tv = 0.5 * sum(abs(counts.get(s, 0) / draws - p) for s, p in expected.items())
    assert tv < 0.04, tv


@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_engine_tree_path_is_exact_and_accepts_as_scripted(k, wrong_at):
    vocab = 40
    target = BigramLM(peaked_table(vocab, seed=4))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    oracle = SpeculativeEngine(target).generate([3], params).token_ids
    proposer = ScriptedTreeProposer(1, oracle + [0] * 10, vocab, width=3, rank=2, wrong_at=wrong_at)
    result = SpeculativeEngine(target, proposer, k).generate([3], params)
    assert result.token_ids == oracle
    per_step = k if wrong_at is None else min(wrong_at, k)
    full_steps = [a for a in result.stats.accepted_per_position]
    assert result.stats.num_accepted_tokens == sum(full_steps)
    # every step but possibly the last (clamped by max_tokens) accepts exactly per_step tokens
    steps = result.stats.num_drafts
    assert result.stats.num_accepted_tokens >= (steps - 1) * per_step
    assert result.stats.num_accepted_tokens <= steps * per_step
    assert result.stats.num_tree_nodes >= steps


def _linear_logits(seed, ids, quantize=False):
    model = _model(seed, quantize)
    if quantize:  # one token at a time: the decode oracle
        for token in ids:
            logits = model.forward([token]).logits[-1]
        return logits
    return model.forward(ids).logits[-1]


def _model(seed, quantize):
    model = tiny_llama(seed)
    if quantize:
        from draftwise.backends.quantization import quantize_model

        quantize_model(model.model, "int8")
    return model


@pytest.mark.parametrize("quantize", [False, True])
def test_tree_pass_and_compaction_equal_linear_decoding(quantize):
    prefix, root, nodes = [3, 17, 42, 5], 9, [7, 11, 13, 20, 21]
    model = _model(0, quantize)
    model.forward(prefix)
    out = model.forward_tree([root, *nodes], PARENTS, return_hidden=True)
    assert out.logits.shape[0] == len(nodes) + 1 and out.hidden.shape[0] == len(nodes) + 1
    for node in range(-1, len(nodes)):
        ids = prefix + [root] + [nodes[i] for i in path_to(PARENTS, node)]
        expected = _linear_logits(0, ids, quantize)
        if quantize:
            assert torch.equal(out.logits[node + 1], expected), node  # bit for bit (row-wise int8 path)
        else:
            torch.testing.assert_close(out.logits[node + 1], expected, rtol=0, atol=1e-4)
    model.compact(len(prefix), [0, 1, 3, 4])  # root, a, c, d
    assert model.num_cached == len(prefix) + 4
    after = model.forward([30]).logits[-1]
    expected = _linear_logits(0, prefix + [root, 7, 13, 20, 30], quantize)
    if quantize:
        assert torch.equal(after, expected)
    else:
        torch.testing.assert_close(after, expected, rtol=0, atol=1e-4)


def test_compaction_of_a_prefix_is_a_rollback_and_bad_offsets_raise():
    model = tiny_llama(0)
    model.forward([1, 2, 3])
    model.forward_tree([4, 5, 6], (-1, -1))
    model.compact(3, [0, 1])
    assert model.num_cached == 5
    with pytest.raises(ValueError):
        model.compact(3, [1, 0])
    with pytest.raises(ValueError):
        model.compact(3, [5])
    with pytest.raises(ValueError, match="parent"):
        model.forward_tree([1, 2, 3], (-1, 5))


def test_stories_tree_pass_with_compaction_matches_a_fresh_prefill(stories):
    backend = stories.backend
    prompt = stories.encode("Once upon a time")
    backend.reset()
    backend.forward(prompt)
    root, nodes, parents = 5, [10, 20, 30, 40], (-1, -1, 1, 2)
    backend.forward_tree([root, *nodes], parents)
    backend.compact(len(prompt), [0, 2, 3, 4])
    tail = backend.forward([50]).logits[-1]
    backend.reset()
    fresh = backend.forward(prompt + [root, 20, 30, 40, 50]).logits[-1]
    torch.testing.assert_close(tail, fresh, rtol=0, atol=1e-4)
    backend.reset()


def test_default_compact_is_a_rollback_for_a_chain_and_refuses_a_tree():
    """Backends without tree passes (llama.cpp) get compact from CausalLM: the engine's one cache operation."""
    from draftwise.backends.base import CausalLM

    class ChainOnly(BigramLM):
        supports_tree = False
        compact = CausalLM.compact

    model = ChainOnly(peaked_table(8, seed=0))
    model.forward([1, 2, 3, 4, 5, 6])
    model.compact(2, [0, 1])  # the root and one accepted token of a 4-row pass: keep 4 entries
    assert model.tokens == [1, 2, 3, 4]
    with pytest.raises(NotImplementedError):
        model.compact(1, [0, 2])
