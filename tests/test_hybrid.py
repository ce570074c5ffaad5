"""Hybrid proposer: greedy exactness, the per-step choice between suffix decoding and the draft model under
scripted costs, and learning acceptance from committed tokens."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import tiny_llama
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.base import DraftProposal
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.hybrid import HybridProposer, SideOptions, accepted_length, assign_sides
from draftwise.proposers.suffix import SuffixDraft, SuffixProposer
from fakes import BigramLM, peaked_table


@dataclass
class FakeCosts:
    """Deterministic costs (seconds): a target pass over n tokens costs ``1 + 0.05 (n - 1)``."""

    draft_seconds_per_token: float = 0.1

    def verify_cost(self, num_tokens: int) -> float:
        return 1.0 + 0.05 * (num_tokens - 1)


def cycle_table(vocab: int, period: int) -> torch.Tensor:
    """Bigram logits whose argmax after token t is ``(t + 1) % period``."""
    table = torch.zeros(vocab, vocab)
    for t in range(vocab):
        table[t, (t + 1) % period] = 8.0
    return table


def hybrid(target_table, draft_table, k, **options):
    vocab = target_table.shape[0]
    costs = options.pop("costs", FakeCosts())
    options.setdefault("priced_by_engine", False)  # the scripted costs price every step
    proposer = HybridProposer(SuffixProposer(), DraftModelProposer(BigramLM(draft_table), vocab), costs, max_k=k,
                              **options)
    return BigramLM(target_table), proposer


def plain(target, prompt, params, eos=()):
    return SpeculativeEngine(target, eos_token_ids=eos).generate(prompt, params)


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", [[3, 4, 5, 6, 7] * 6, [5, 8], [2, 9, 2, 9, 4, 2, 9]])
def test_bigram_exactness_with_an_imperfect_draft(k, prompt):
    target, proposer = hybrid(peaked_table(12, seed=7), peaked_table(12, seed=8), k)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    result = SpeculativeEngine(target, proposer, k).generate(prompt, params)
    assert result.token_ids == plain(BigramLM(peaked_table(12, seed=7)), prompt, params).token_ids
    assert proposer.num_suffix_steps + proposer.num_draft_steps == result.stats.num_drafts


@pytest.mark.parametrize("k", [2, 4])
def test_tiny_llama_exactness_over_consecutive_requests(k):
    target, draft = tiny_llama(seed=0), tiny_llama(seed=1)
    proposer = HybridProposer(SuffixProposer(tree_width=2), DraftModelProposer(draft, target.vocab_size), FakeCosts(),
                              max_k=k, priced_by_engine=False)
    engine = SpeculativeEngine(target, proposer, k)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for prompt in ([3, 17, 42, 5] * 6, [9, 9, 9, 9, 9, 9, 9, 9], [11, 12, 13, 14, 15, 16, 11, 12, 13], [3, 17, 42, 5] * 6):
        assert engine.generate(prompt, params).token_ids == plain(target, prompt, params).token_ids, prompt
    assert proposer.num_draft_steps > 0


def test_stories260k_exactness(stories, stories_draft):
    params = SamplingParams(max_tokens=48)
    proposer = HybridProposer(SuffixProposer(), DraftModelProposer(stories_draft.backend, stories.backend.vocab_size),
                              FakeCosts(), max_k=4, priced_by_engine=False)
    engine = SpeculativeEngine(stories.backend, proposer, 4, eos_token_ids=stories.eos_token_ids)
    for text in ("Once upon a time",
                 "One two three. One two three. One two three. One two three. One two"):
        prompt = stories.encode(text)
        oracle = plain(stories.backend, prompt, params, stories.eos_token_ids)
        result = engine.generate(prompt, params)
        assert result.token_ids == oracle.token_ids, text
    assert proposer.num_draft_steps > 0 and proposer.num_suffix_steps > 0


def _sides(proposer: HybridProposer) -> dict[str, int]:
    """The proposer's own counters (over every request so far), keyed like ``stats.hybrid_steps``."""
    return {"suffix": proposer.num_suffix_steps, "draft_model": proposer.num_draft_steps,
            "plain": proposer.num_plain_steps}


def test_stories260k_requests_count_their_steps_by_side(stories, stories_draft):
    """Each request's ``hybrid_steps`` are its share of the proposer's counters; the suffix and draft-model
    passes are its drafts, and every decode pass but a last one clamped to K = 0 was the hybrid's to draft."""
    params = SamplingParams(max_tokens=40)
    proposer = HybridProposer(SuffixProposer(), DraftModelProposer(stories_draft.backend, stories.backend.vocab_size),
                              FakeCosts(), max_k=4, priced_by_engine=False)
    engine = SpeculativeEngine(stories.backend, proposer, 4, eos_token_ids=stories.eos_token_ids)
    totals = dict.fromkeys(_sides(proposer), 0)
    for text in ("Once upon a time", "One two three. One two three. One two three. One two three. One two"):
        before = _sides(proposer)
        stats = engine.generate(stories.encode(text), params).stats
        assert stats.hybrid_steps == {side: n - before[side] for side, n in _sides(proposer).items()}, text
        assert stats.hybrid_steps["suffix"] + stats.hybrid_steps["draft_model"] == stats.num_drafts > 0
        assert stats.num_target_passes - sum(stats.hybrid_steps.values()) in (0, 1)
        assert stats.to_dict()["hybrid_steps"] == stats.hybrid_steps
        totals = {side: totals[side] + n for side, n in stats.hybrid_steps.items()}
    assert totals["suffix"] > 0 and totals["draft_model"] > 0
    plain = engine.stream(stories.encode("Once upon a time"), params, num_speculative_tokens=0)
    for _ in plain:
        pass
    assert plain.result.stats.hybrid_steps is None  # speculation off: the hybrid never drafted
    one_token = engine.generate(stories.encode("Once upon a time"), SamplingParams(max_tokens=1)).stats
    assert one_token.hybrid_steps == {"suffix": 0, "draft_model": 0, "plain": 0}  # hybrid, no pass to draft


def test_plain_steps_are_counted_when_neither_side_pays():
    """A target that never repeats (no suffix match) and a draft model too slow to pay: every step is plain."""
    table = cycle_table(200, 200)
    target, proposer = hybrid(table, table, 4, learn_costs=False, costs=FakeCosts(draft_seconds_per_token=10.0))
    stats = SpeculativeEngine(target, proposer, 4).generate([0], SamplingParams(max_tokens=20, ignore_eos=True)).stats
    assert stats.num_drafts == 0
    assert stats.hybrid_steps == {"suffix": 0, "draft_model": 0, "plain": proposer.num_plain_steps}
    assert proposer.num_plain_steps == stats.num_target_passes - 1  # the last step: one token left, K = 0


def test_seeded_sampling_is_reproducible_whatever_ran_before():
    """A seeded sampling request ignores what the hybrid learned from earlier requests (and their outputs), so
    the same request gives the same text after other requests; an unseeded one may use all of it."""
    target, proposer = hybrid(peaked_table(12, seed=7, scale=1.5), peaked_table(12, seed=9, scale=1.5), 3)
    engine = SpeculativeEngine(target, proposer, 3)
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=5)
    prompt = [1, 2, 3, 1, 2, 3]
    first = engine.generate(prompt, params).token_ids
    for seed in range(3):
        engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=None))
        engine.generate(prompt + [seed], SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.generate(prompt, params).token_ids == first
    assert proposer.num_suffix_steps > 0 and proposer.num_draft_steps > 0
    assert proposer.suffix.cache.num_requests == 7


# ---------------------------------------------------------------------------------------------- the choice
def test_picks_suffix_on_repetitive_text():
    """The target cycles through 0..15 and the prompt holds the cycle three times: every suffix draft is
    certain, and a K-token suffix step costs no drafting, so suffix wins every step."""
    table = cycle_table(32, 16)
    target, proposer = hybrid(table, table, 4, learn_costs=False)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = list(range(16)) * 3
    result = SpeculativeEngine(target, proposer, 4).generate(prompt, params)
    assert result.token_ids == plain(BigramLM(table), prompt, params).token_ids
    assert proposer.num_draft_steps == 0 and proposer.num_suffix_steps > 0
    assert result.stats.num_accepted_tokens >= 0.7 * len(result.token_ids)


def test_picks_the_draft_model_when_nothing_repeats():
    """The target counts through 0..199 without repeating: the suffix index never has a continuation."""
    table = cycle_table(200, 200)
    target, proposer = hybrid(table, table, 4, learn_costs=False)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    result = SpeculativeEngine(target, proposer, 4).generate([0], params)
    assert result.token_ids == list(range(1, 61))
    assert proposer.num_suffix_steps == 0 and proposer.num_draft_steps > 0
    assert proposer.learned.acceptance.overall > 0.9  # learned from the committed tokens: the draft is the target


def test_choice_weighs_confidence_against_costs():
    costs = FakeCosts(draft_seconds_per_token=0.1)
    proposer = HybridProposer(SuffixProposer(), DraftModelProposer(BigramLM(cycle_table(8, 8)), 8), costs, max_k=4,
                              learn_costs=False)
    confident = SuffixDraft((1, 2, 3, 4), (-1, 0, 1, 2), (1.0, 1.0, 1.0, 1.0), 6)
    weak = SuffixDraft((1,), (-1,), (0.2,), 1)
    assert proposer.choose(confident, 4) == "suffix"
    assert proposer.choose(weak, 4) == "draft_model"  # 1.2 tokens / 1.05 s < 2.31 tokens / 1.6 s
    assert proposer.choose(SuffixDraft(), 4) == "draft_model"
    proposer.learned.draft_seconds_per_token = 10.0  # a slow draft model: even the weak suffix draft pays more
    assert proposer.choose(weak, 4) == "suffix"
    proposer.learned.draft_seconds_per_token = 0.1
    proposer.learned.suffix_predicted = 50.0  # the suffix drafts turned out wrong: their confidence is discounted
    assert proposer.suffix_correction() < 0.1
    assert proposer.choose(confident, 4) == "draft_model"


def test_a_cut_proposal_keeps_its_side():
    """The engine cuts drafts to its row budget and the context; the cut draft is still counted for its side."""
    proposal = DraftProposal((1, 2, 3), parents=(-1, -1, 0), hybrid_side="suffix")
    assert proposal.truncated(2).hybrid_side == "suffix" and proposal.truncated(2).token_ids == (1, 2)
    assert DraftProposal((1, 2)).hybrid_side == ""


def test_accepted_length_of_chains_and_trees():
    assert accepted_length((5, 6, 7), None, [5, 6, 9]) == 2
    assert accepted_length((5, 6, 7), None, [5, 6, 7, 8]) == 3
    assert accepted_length((5, 6, 7), None, [4]) == 0
    tokens, parents = (5, 6, 7, 8), (-1, -1, 1, 1)  # 5 | 6 -> 7, 6 -> 8
    assert accepted_length(tokens, parents, [6, 8, 1]) == 2
    assert accepted_length(tokens, parents, [5, 7]) == 1
    assert accepted_length(tokens, parents, [9]) == 0


# ---------------------------------------------------------------------------------------------- batch sides
def _step_rate(options, sides, base_rows, pass_seconds, draft_pass_seconds):
    """The rate assign_sides maximises, written out independently."""
    model = [o for o, side in zip(options, sides) if side == "draft_model"]
    expected = sum(o.model_expected if side == "draft_model" else o.suffix_expected for o, side in zip(options, sides))
    rows = base_rows + sum(o.model_rows if side == "draft_model" else o.suffix_rows for o, side in zip(options, sides))
    depth = max((o.model_depth for o in model), default=0)
    draft = sum(draft_pass_seconds(sum(1 for o in model if o.model_depth > d)) for d in range(depth))
    return expected / (pass_seconds(rows) + draft)


def test_assign_sides_for_one_sequence_is_the_rate_comparison():
    option = SideOptions(suffix_expected=2.0, suffix_rows=2, model_expected=3.0, model_rows=4, model_depth=4)
    verify = FakeCosts().verify_cost
    # suffix 2 / 1.10 = 1.82 tokens/s; model 3 / (1.20 + 4 x 0.1) = 1.88
    assert assign_sides([option], 1, verify, lambda rows: 0.1) == ["draft_model"]
    assert assign_sides([option], 1, verify, lambda rows: 0.12) == ["suffix"]  # 3 / 1.68 = 1.79
    plain = SideOptions(1.0, 0, 1.2, 4, 4)  # no suffix match and a draft that does not pay: a plain step
    assert assign_sides([plain], 1, verify, lambda rows: 0.1) == ["suffix"]


def test_assign_sides_weighs_the_batch_load():
    options = [SideOptions(1.3, 1, 3.0, 4, 4) for _ in range(4)]
    flat = lambda rows: 1.0 + 0.01 * rows  # memory-bound passes: draft rows are nearly free
    steep = lambda rows: 0.2 * rows  # compute-bound: every row costs its share
    per_pass = lambda rows: 0.15 + 0.01 * rows  # a draft pass costs about the same for 1 or 4 rows
    assert assign_sides(options, 4, flat, per_pass) == ["draft_model"] * 4
    assert assign_sides(options, 4, steep, per_pass) == ["suffix"] * 4
    # one move alone does not repay the draft passes, all four do: the best set is kept, not the first loss
    costly_pass = lambda rows: 0.5 + 0.001 * rows
    gains = [SideOptions(1.0, 0, 3.5, 4, 4) for _ in range(4)]
    one = _step_rate(gains, ["draft_model", "suffix", "suffix", "suffix"], 4, flat, costly_pass)
    none = _step_rate(gains, ["suffix"] * 4, 4, flat, costly_pass)
    assert one < none
    assert assign_sides(gains, 4, flat, costly_pass) == ["draft_model"] * 4


@pytest.mark.parametrize("seed", range(6))
def test_assign_sides_is_near_the_best_assignment(seed):
    """Against every assignment of 5 sequences (random options and costs): the forward selection reaches at least
    97% of the best rate."""
    import itertools
    import random

    rng = random.Random(seed)
    options = []
    for _ in range(5):
        depth = rng.randint(1, 6)
        options.append(SideOptions(1.0 + rng.random() * 3, rng.randint(0, 6), 1.0 + rng.random() * depth, depth,
                                   depth))
    a, b = rng.uniform(0.5, 1.0), rng.uniform(0.0, 0.1)
    c, d = rng.uniform(0.05, 0.3), rng.uniform(0.0, 0.05)
    pass_seconds = lambda rows: a + b * rows
    draft_pass_seconds = lambda rows: c + d * rows
    chosen = _step_rate(options, assign_sides(options, 5, pass_seconds, draft_pass_seconds), 5, pass_seconds,
                        draft_pass_seconds)
    best = max(_step_rate(options, sides, 5, pass_seconds, draft_pass_seconds)
               for sides in itertools.product(["suffix", "draft_model"], repeat=5))
    assert chosen >= 0.97 * best


def test_assign_sides_prices_the_drafts_catch_up():
    """A sequence whose draft slot is 60 tokens behind (after suffix steps) pays a long first draft pass: it
    stays on its suffix draft where a caught-up one moves to the draft model."""
    flat = lambda rows: 1.0 + 0.01 * rows
    per_row = lambda rows: 0.02 + 0.02 * rows
    caught_up = SideOptions(1.5, 2, 3.0, 4, 4, model_catch_up=1)
    behind = SideOptions(1.5, 2, 3.0, 4, 4, model_catch_up=60)
    assert assign_sides([caught_up], 1, flat, per_row) == ["draft_model"]
    assert assign_sides([behind], 1, flat, per_row) == ["suffix"]
    assert assign_sides([behind, caught_up], 2, flat, per_row) == ["suffix", "draft_model"]
