"""Draft trees from a draft model (EAGLE-2's dynamic tree grown one batched draft pass per depth, verified in
one target pass): greedy output identical to plain decoding, coupled sampling the same text, rejection sampling
the target's distribution; a grown tree's rows see exactly what a chain's would."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import first_layer_copy, tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.quantization import int8_kernels_available
from draftwise.backends.slots import LOGITS_ALL, LOGITS_LAST, Expansion, LeanSlots, Piece
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import EngineCore, SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer, DraftRequest, DraftSlots
from draftwise.sampling import Sampler
from draftwise.tree import DraftNode, node_depths, select_tree

MODE = "int8" if int8_kernels_available() else "none"
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
PROMPTS = [[3, 17, 42, 5], [9, 8, 7, 6, 5, 4, 3, 2] * 3, [11] * 30, list(range(2, 80))]


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(0).model


@pytest.fixture(scope="module")
def weak_hf(hf):
    """The target's first layer: a real, imperfect draft."""
    return first_layer_copy(hf)


@pytest.fixture(scope="module")
def target(hf):
    return build_lean(hf, quantization=MODE, name="tiny")


@pytest.fixture(scope="module")
def oracle(target):
    return [SpeculativeEngine(target).generate(p, GREEDY).token_ids for p in PROMPTS]


@pytest.mark.parametrize("width,k,budget", [(2, 2, None), (2, 4, None), (3, 4, 6), (4, 6, 20)])
def test_greedy_tree_drafts_are_exact_alone_and_batched(target, hf, weak_hf, oracle, width, k, budget):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    alone = [SpeculativeEngine(target, DraftModelProposer(draft, 96, width, budget), k).generate(p, GREEDY)
             for p in PROMPTS]
    assert [r.token_ids for r in alone] == oracle
    assert sum(r.stats.num_tree_nodes for r in alone) > 0  # trees really ran
    multi = build_lean(hf, quantization=MODE, name="tiny-batch", num_slots=3)
    batched_draft = build_lean(weak_hf, quantization=MODE, name="weak-batch", num_slots=3)
    engine = EngineCore(multi, DraftModelProposer(batched_draft, 96, tree_width=width, tree_budget=budget, slot_per_sequence=True), k)
    batched = engine.generate(PROMPTS, GREEDY)  # 4 requests through 3 slots
    assert [r.token_ids for r in batched] == oracle


def test_trees_accept_more_than_the_chain_and_respect_depth_and_budget(target, weak_hf, oracle):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    tau = {}
    for width in (1, 3):
        results = [SpeculativeEngine(target, DraftModelProposer(draft, 96, width, 7), 4).generate(p, GREEDY)
                   for p in PROMPTS]
        accepted = sum(r.stats.num_accepted_tokens for r in results)
        steps = sum(len(r.stats.k_history) for r in results)
        tau[width] = accepted / steps
        assert all(max(r.stats.k_history) <= 4 for r in results)
    assert tau[3] > tau[1]
    sampler = Sampler(GREEDY)
    slots = DraftSlots(draft, 96)
    proposal = slots.draft([DraftRequest(0, 0, PROMPTS[3], sampler, 4, width=3, budget=7)])[0]
    assert proposal.is_tree and len(proposal) <= 7 and proposal.depth <= 4
    assert draft.num_cached == len(PROMPTS[3])  # the slot holds the committed context only


def test_the_target_as_its_own_tree_draft_accepts_every_path_and_keeps_it(target, hf, oracle):
    """An identical draft is always right at depth 1 (its best child is the target's choice, and the tree keeps
    its best node). After a step the draft keeps the accepted nodes' entries (packed after the context)
    instead of feeding them again."""
    draft = build_lean(hf, quantization=MODE, name="same")
    proposer = DraftModelProposer(draft, 96, tree_width=2)
    fed = []
    forward = proposer.slots.backend.forward

    def counting(pieces):
        fed.append(sum(len(p.token_ids) for p in pieces))
        return forward(pieces)

    proposer.slots.backend.forward = counting
    result = SpeculativeEngine(target, proposer, 3).generate(PROMPTS[0], GREEDY)
    assert result.token_ids == oracle[0]
    stats = result.stats
    drafting_steps = sum(1 for k in stats.k_history if k > 0)  # a last step with one token left drafts nothing
    assert stats.accepted_per_position[0] == stats.drafted_per_position[0] == drafting_steps
    assert stats.acceptance_rate > 0.9
    # per step: a catch-up of the bonus token only (1 row, the accepted path kept), then one pass per depth
    assert max(fed[1:]) <= 2


def test_a_grown_tree_row_sees_what_the_same_chain_row_sees(hf):
    """Expansion pieces (one depth per pass, ancestors from earlier passes) give a node the logits the same
    path gets as a chain, bit for bit on the lean runtime."""
    model = build_lean(hf, quantization=MODE, name="rows", num_slots=2).model
    slots = LeanSlots(model)
    context = list(range(5, 75))  # crosses a 64-key block
    base = len(context)
    for slot in (0, 1):
        slots.forward([Piece(slot, 0, context, logits=LOGITS_LAST)])
    path = [40, 41, 42]
    chain = slots.forward([Piece(1, base, path, logits=LOGITS_ALL)]).logits  # [3, V]
    # the tree: depth 1 {30, 40}, depth 2 {41, 50} under 40, depth 3 {42} under 41
    one = slots.forward([Piece(0, base, [30, 40], expansion=Expansion(base, (base, base), ((), ())))]).logits
    two = slots.forward([Piece(0, base + 2, [50, 41], expansion=Expansion(base, (base + 1,) * 2,
                                                                          ((base + 1,), (base + 1,))))]).logits
    three = slots.forward([Piece(0, base + 4, [42], expansion=Expansion(base, (base + 2,),
                                                                        ((base + 1, base + 3),)))]).logits
    assert torch.equal(one[1], chain[0]) and torch.equal(two[1], chain[1]) and torch.equal(three[0], chain[2])


def test_coupled_sampling_with_trees_gives_the_plain_text(target, weak_hf):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    for seed in (1, 2):
        params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        for prompt in PROMPTS[:3]:
            plain = SpeculativeEngine(target).generate(prompt, params).token_ids
            tree = SpeculativeEngine(target, DraftModelProposer(draft, 96, 3), 4).generate(prompt, params)
            assert tree.token_ids == plain
            assert tree.stats.num_tree_nodes > 0


def test_rejection_sampling_with_trees_matches_the_target_distribution():
    """SpecInfer's multi-candidate rejection over a draft model's deterministic top-w siblings: the sequences'
    distribution equals the target's own (total variation against the exact distribution)."""
    vocab, length, draws, temperature = 3, 3, 4000, 1.0
    target_hf, draft_hf = tiny_llama(3, vocab=vocab).model, tiny_llama(4, vocab=vocab).model
    target = build_lean(target_hf, quantization="none", name="t3")
    draft = build_lean(draft_hf, quantization="none", name="d3")
    prompt = [1, 2]
    exact = {}
    for seq in itertools.product(range(vocab), repeat=length):
        target.reset()
        logits = target.forward(prompt + list(seq[:-1]), num_logits=length).logits  # [length, V]
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        exact[seq] = float(torch.prod(probs[torch.arange(length), torch.tensor(seq)]))
    target.reset()
    engine = SpeculativeEngine(target, DraftModelProposer(draft, vocab, tree_width=2), 2)
    counts: dict[tuple, int] = {}
    accepted = 0
    for seed in range(draws):
        params = SamplingParams(max_tokens=length, temperature=temperature, seed=seed, sampling="rejection",
                                ignore_eos=True)
        result = engine.generate(prompt, params)
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        accepted += result.stats.num_accepted_tokens
    tv = 0.5 * sum(abs(counts.get(s, 0) / draws - p) for s, p in exact.items())
    assert tv < 0.06, tv
    assert accepted > 0


def test_select_tree_keeps_the_best_nodes_closed_under_ancestors():
    nodes = [DraftNode(10, -1, 1, -0.1), DraftNode(11, -1, 1, -2.0), DraftNode(12, 0, 2, -0.3),
             DraftNode(13, 0, 2, -3.0), DraftNode(14, 2, 3, -0.5)]
    tokens, parents = select_tree(nodes, 3)
    assert tokens == (10, 12, 14) and parents == (-1, 0, 1)
    tokens, parents = select_tree(nodes, 4)
    assert tokens == (10, 11, 12, 14) and node_depths(parents) == [1, 1, 2, 3]


def test_tree_fields_are_validated_and_refused_where_they_cannot_run(weak_hf):
    with pytest.raises(ValueError, match="tree_width"):
        SpeculativeConfig(method="draft_model", model="d", tree_width=0)
    with pytest.raises(ValueError, match="tree_budget"):
        SpeculativeConfig(method="hybrid", model="d", tree_budget=0)
    assert SpeculativeConfig(method="draft_model", model="d", tree_width=3, tree_budget=12).tree_width == 3
    from fakes import BigramLM

    with pytest.raises(ValueError, match="lean runtime"):
        DraftModelProposer(BigramLM(torch.zeros(4, 4)), 4, tree_width=2, slot_per_sequence=True)
    chain = DraftModelProposer(BigramLM(torch.zeros(4, 4)), 4, tree_width=2)  # a one-slot draft: chains
    assert chain.tree_width == 1


def test_sized_tree_keeps_the_nodes_that_pay_for_their_verification():
    # path probabilities 0.9, 0.8, 0.5, 0.05, 0.01 (scores are log-probabilities)
    import math

    from draftwise.proposers.draft_model import sized_tree

    nodes = [DraftNode(1, -1, 1, math.log(0.9)), DraftNode(2, 0, 2, math.log(0.8)), DraftNode(3, 1, 3, math.log(0.5)),
             DraftNode(4, -1, 1, math.log(0.05)), DraftNode(5, 3, 2, math.log(0.01))]
    flat = sized_tree(nodes, 5, 0.1, lambda rows: 0.1)  # verification costs the same for any size: keep all
    assert flat == 5
    steep = sized_tree(nodes, 5, 0.1, lambda rows: 0.1 * rows ** 2)  # verification cost explodes: keep one
    assert steep == 1
    # a row costs 10% of a pass: the 0.05 and 0.01 nodes do not pay for theirs, the 0.5 one does
    assert sized_tree(nodes, 5, 0.1, lambda rows: 0.1 * (1 + 0.1 * (rows - 1))) == 3
    assert sized_tree(nodes, 2, 0.1, lambda rows: 0.1) == 2  # never past the budget


def test_cost_sized_trees_stay_exact(target, weak_hf, oracle):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    proposer = DraftModelProposer(draft, 96, 3, 12, verify_seconds=lambda rows: 0.01 * (1 + 0.2 * rows))
    results = [SpeculativeEngine(target, proposer, 4).generate(p, GREEDY) for p in PROMPTS]
    assert [r.token_ids for r in results] == oracle
    nodes = sum(r.stats.num_tree_nodes for r in results)
    steps = sum(len(r.stats.k_history) for r in results)
    assert 0 < nodes < 12 * steps  # sized below the budget
