"""A windowed draft (``draft_window``): the draft model reads the context's first tokens (attention sinks) and its
most recent ones, so a long prompt costs it a short prefill. The output stays the target's own (greedy, coupled
sampling, alone, batched, across turns with prefix reuse); the draft really reads the window; its samples are
drawn at the sequence's positions, not the view's."""

from __future__ import annotations


import pytest

from conftest import first_layer_copy, tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.quantization import int8_kernels_available
from draftwise.commands.bench import CliError, draft_windows, method_label
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import EngineCore, SpeculativeEngine
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.draft_model import WINDOW_SINKS, DraftModelProposer, DraftRequest, DraftSlots, window_view
from draftwise.sampling import Sampler

MODE = "int8" if int8_kernels_available() else "none"
WINDOW = 32
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)
# short (never windowed), just past the window, and long: 48 more tokens make every view outgrow it again
PROMPTS = [[3, 17, 42, 5], [9, 8, 7, 6, 5, 4, 3, 2] * 5, list(range(2, 90))]


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(0).model


@pytest.fixture(scope="module")
def weak_hf(hf):
    return first_layer_copy(hf)


@pytest.fixture(scope="module")
def target(hf):
    return build_lean(hf, quantization=MODE, name="tiny")


@pytest.fixture(scope="module")
def oracle(target):
    return [SpeculativeEngine(target).generate(p, GREEDY).token_ids for p in PROMPTS]


def test_window_view_keeps_the_sinks_and_the_recent_tokens():
    context = list(range(100, 160))
    assert window_view(context, 0) == (context, 0)
    assert window_view(context, WINDOW_SINKS) == (context, 0)
    view, offset = window_view(context, 40)
    assert view == context[:WINDOW_SINKS] + context[40:] and offset == 40 - WINDOW_SINKS
    assert len(view) + offset == len(context)


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_windowed_drafts_are_exact_alone_and_batched(target, hf, weak_hf, oracle, k):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    alone = [SpeculativeEngine(target, DraftModelProposer(draft, 96, window=WINDOW), k).generate(p, GREEDY)
             for p in PROMPTS]
    assert [r.token_ids for r in alone] == oracle
    multi = build_lean(hf, quantization=MODE, name="tiny-batch", num_slots=2)
    batched_draft = build_lean(weak_hf, quantization=MODE, name="weak-batch", num_slots=2)
    engine = EngineCore(multi, DraftModelProposer(batched_draft, 96, window=WINDOW, slot_per_sequence=True), k)
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == oracle  # 3 requests through 2 slots


def test_windowed_trees_are_exact(target, weak_hf, oracle):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    results = [SpeculativeEngine(target, DraftModelProposer(draft, 96, 3, window=WINDOW), 4).generate(p, GREEDY)
               for p in PROMPTS]
    assert [r.token_ids for r in results] == oracle
    assert sum(r.stats.num_tree_nodes for r in results) > 0


def test_the_draft_reads_only_the_window_and_recuts_when_it_outgrows_it(weak_hf):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    slots = DraftSlots(draft, 96, window=WINDOW)
    fed = []
    forward = slots.backend.forward
    slots.backend.forward = lambda pieces: fed.append(sum(len(p.token_ids) for p in pieces)) or forward(pieces)
    slots.draft([DraftRequest(0, 0, list(range(2, 70)), Sampler(GREEDY), 1)])  # 68 = 2W + sinks: whole
    assert fed == [68] and slots.cached(0) == list(range(2, 70))
    fed.clear()
    context = list(range(2, 90))
    slots.draft([DraftRequest(0, 0, context, Sampler(GREEDY), 1)])
    cut = len(context) - WINDOW
    assert slots.cached(0) == window_view(context, cut)[0]
    assert fed == [WINDOW]  # the sinks' entries stay
    grown = context + [7] * WINDOW  # the view is 2W + sinks now
    fed.clear()
    slots.draft([DraftRequest(0, 0, grown, Sampler(GREEDY), 1)])
    assert fed == [WINDOW] and len(slots.cached(0)) == 2 * WINDOW + WINDOW_SINKS  # same cut: the new tokens only
    fed.clear()
    slots.draft([DraftRequest(0, 0, grown + [8], Sampler(GREEDY), 1)])  # one more: a new cut
    assert slots.cached(0) == window_view(grown + [8], len(grown) + 1 - WINDOW)[0]
    assert fed == [WINDOW]
    fed.clear()
    slots.draft([DraftRequest(0, 0, [5, 6, 7], Sampler(GREEDY), 1)])  # a short new context: read whole
    assert slots.cached(0) == [5, 6, 7] and fed == [3]


def test_draft_tokens_are_sampled_at_the_sequence_positions(weak_hf):
    """A windowed view is shorter than the sequence; coupled noise and seeds follow the sequence position."""
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    positions = []

    class Recording(Sampler):
        def choose(self, logits, position):
            positions.append(position)
            return super().choose(logits, position)

    context = list(range(2, 90))
    DraftSlots(draft, 96, window=WINDOW, confidence_threshold=0.0).draft(
        [DraftRequest(0, 0, context, Recording(GREEDY), 3)])
    assert positions == [len(context), len(context) + 1, len(context) + 2]


def test_coupled_sampling_with_a_window_gives_the_plain_text(target, weak_hf):
    draft = build_lean(weak_hf, quantization=MODE, name="weak")
    for seed in (1, 2):
        params = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        for prompt in PROMPTS[1:]:
            plain = SpeculativeEngine(target).generate(prompt, params).token_ids
            proposer = DraftModelProposer(draft, 96, window=WINDOW)
            windowed = SpeculativeEngine(target, proposer, 4).generate(prompt, params)
            assert windowed.token_ids == plain


def test_turns_with_prefix_reuse_keep_the_window_and_stay_exact(hf, weak_hf):
    """A kept draft state carries its cut: the next turn's draft catches up on the new tokens only."""
    multi = build_lean(hf, quantization=MODE, name="tiny-turns", num_slots=1)
    draft = build_lean(weak_hf, quantization=MODE, name="weak-turns", num_slots=1)
    proposer = DraftModelProposer(draft, 96, window=64, slot_per_sequence=True)
    warm = EngineCore(multi, proposer, 4, prefix_cache=PrefixCache(1 << 30))
    cold = EngineCore(build_lean(hf, quantization=MODE, name="tiny-cold", num_slots=1),
                      DraftModelProposer(build_lean(weak_hf, quantization=MODE, name="weak-cold", num_slots=1), 96,
                                        window=64, slot_per_sequence=True), 4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fed = []
    forward = proposer.slots.backend.forward
    proposer.slots.backend.forward = lambda pieces: fed.append(sum(len(p.token_ids) for p in pieces)) or forward(pieces)
    # cut at 86: a view of 68 tokens, 109 by the end (< 2W + sinks)
    conversation = [(i * 7) % 90 + 2 for i in range(150)]
    for extra in ([], [11, 12, 13], [20, 21]):
        conversation = conversation + extra
        fed.clear()
        out = warm.generate([conversation], params)[0]
        assert out.token_ids == cold.generate([conversation], params)[0].token_ids
        if extra:  # the kept view lags the committed context by at most K + 1 tokens (never fed to the draft)
            assert fed[0] <= len(extra) + 4 + 1, fed
        conversation = conversation + out.token_ids


def test_the_window_is_validated_everywhere():
    with pytest.raises(ValueError, match="draft_window"):
        SpeculativeConfig(method="draft_model", model="d", draft_window=8)
    with pytest.raises(ValueError, match="draft_window"):
        SpeculativeConfig(method="ngram", draft_window=64)  # a field ngram does not read
    assert SpeculativeConfig(method="hybrid", model="d", draft_window=64).draft_window == 64
    with pytest.raises(ValueError, match="draft_window"):
        DraftSlots(tiny_llama(0), 96, window=4)
    assert draft_windows("full,256,256") == [None, 256]
    for bad in ("", "16", "big", "-5"):
        with pytest.raises(CliError):
            draft_windows(bad)
    assert method_label("draft", 4, "fixed", 1, 256) == "draft K=4 win=256"
    assert method_label("draft", 4) == "draft K=4"
