"""The engine core over every backend: a single-sequence backend runs as one slot (requests one after another,
in arrival order), trees and live-cache reuse go through the core, the lean multi-slot backend verifies
several sequences' trees in one pass, a tree on a chain-only backend fails only its request, and the probe
schedule both K policies share."""

from __future__ import annotations

import pytest

from conftest import tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.slots import LeanSlots, OneSlot, chunk_counts
from draftwise.builder import _suffix_proposers
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.speculation.controller import ProbeBackoff
from draftwise.engine import EngineCore, SpeculativeEngine
from draftwise.proposers.base import PerSequenceProposers
from draftwise.prefix_cache import PrefixCache
from fakes import BigramLM, ScriptedLM, ScriptedTreeProposer, peaked_table

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def plain(target, prompt, params=GREEDY) -> list[int]:
    return SpeculativeEngine(target).generate(prompt, params).token_ids


def test_a_one_slot_core_serves_requests_one_after_another_in_arrival_order():
    target = BigramLM(peaked_table(40, seed=1))
    prompts = [[1, 2, 3], [7, 8], [30, 4, 5, 6]]
    oracle = [plain(target, p) for p in prompts]
    core = EngineCore(target)
    assert isinstance(core.backend, OneSlot) and core.max_num_seqs == 1
    sequences = [core.add(p, GREEDY) for p in prompts]
    finished_order = []
    while core.has_work:
        assert core.num_running <= 1
        for output in core.step():
            if output.finished:
                finished_order.append(output.sequence.seq_id)
    assert finished_order == [s.seq_id for s in sequences]
    assert [s.result.token_ids for s in sequences] == oracle


def test_trees_run_through_the_core_on_one_slot_and_equal_plain_decoding():
    target = BigramLM(peaked_table(40, seed=2))
    prompt = [3, 9, 27]
    oracle = plain(target, prompt)
    proposer = ScriptedTreeProposer(len(prompt), oracle, 40, width=3, rank=2, wrong_at=2)
    core = EngineCore(target, PerSequenceProposers.of(proposer), 4)
    result = core.generate([prompt], GREEDY)[0]
    assert result.token_ids == oracle
    assert result.stats.num_tree_nodes > 0 and result.stats.num_accepted_tokens > 0


def test_a_tree_on_a_chain_only_backend_fails_only_its_request():
    target = ScriptedLM(lambda prompt: (prompt[0], False, False), vocab_size=40)
    assert not target.supports_tree
    core = EngineCore(target, PerSequenceProposers.of(ScriptedTreeProposer(3, [5] * 20, 40)), 3)
    sequence = core.add([5, 6, 7], GREEDY)
    errors = []
    while core.has_work:
        errors += [o.error for o in core.step() if o.error is not None]
    assert sequence.finish_reason == "error" and len(errors) == 1 and "verifies chains only" in str(errors[0])
    assert EngineCore(target).generate([[5, 6, 7]], GREEDY)[0].token_ids == [5] * GREEDY.max_tokens


def test_the_lean_multi_slot_backend_verifies_several_sequences_trees_in_one_pass():
    """3 requests, each drafting a tree every step (3 siblings per depth, the right one second, so the accepted
    path is not a prefix of the pass): their trees share passes, and every output equals its request's plain
    decoding alone. Suffix trees (width 3) batched the same way are exact too."""
    hf = tiny_llama(0).model
    single = build_lean(hf, quantization="none", name="tiny")
    multi = build_lean(hf, quantization="none", name="tiny-batch", num_slots=3)
    prompts = [[3, 4, 5, 6] * 6, [10, 11, 12] * 8, [20, 21, 22, 23, 24] * 5]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    oracles = [plain(single, p, params) for p in prompts]
    scripted = iter([ScriptedTreeProposer(len(p), o, 96, width=3, rank=1, wrong_at=2)
                     for p, o in zip(prompts, oracles)])
    core = EngineCore(multi, PerSequenceProposers(lambda: next(scripted), "scripted-tree"), 4, max_num_seqs=3)
    assert isinstance(core.backend, LeanSlots) and core.backend.supports_tree
    trees_per_pass = []
    forward = core.backend.forward

    def recording(pieces):
        trees_per_pass.append(sum(piece.parents is not None for piece in pieces))
        return forward(pieces)

    core.backend.forward = recording
    results = core.generate(prompts, params)
    assert [r.token_ids for r in results] == oracles
    assert all(r.stats.num_tree_nodes > 0 and r.stats.num_accepted_tokens > 0 for r in results)
    assert max(trees_per_pass) == 3

    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_decoding_tree_width=3)
    suffix = EngineCore(multi, _suffix_proposers(config), 4, max_num_seqs=3)
    assert [r.token_ids for r in suffix.generate(prompts, params)] == oracles


def test_a_backend_without_export_reuses_the_sequence_its_slot_still_holds():
    target = BigramLM(peaked_table(40, seed=3))
    assert not target.supports_cache_export
    engine = SpeculativeEngine(target, prefix_cache=PrefixCache(1 << 20))
    first = [1, 2, 3, 4, 5]
    out = engine.generate(first, GREEDY).token_ids
    follow_up = first + out + [9, 9]
    again = engine.generate(follow_up, GREEDY)
    assert again.stats.num_cached_prompt_tokens == len(first) + len(out) - 1  # all the cache held
    assert again.token_ids == plain(BigramLM(peaked_table(40, seed=3)), follow_up)
    SpeculativeEngine(target).generate([20, 21], GREEDY)  # another engine changes the backend's cache
    after = engine.generate(follow_up + again.token_ids, GREEDY)
    assert after.stats.num_cached_prompt_tokens == 0


def test_probe_backoff_doubles_to_its_cap_and_resets():
    backoff = ProbeBackoff(4, 20)
    seen = []
    for _ in range(4):
        backoff.rejected()
        seen.append(backoff.interval)
    assert seen == [8, 16, 20, 20]
    backoff.rejected(at_least=50)
    assert backoff.interval == 50
    backoff.reset()
    assert backoff.interval == 4
    with pytest.raises(ValueError):
        ProbeBackoff(8, 4)


def test_the_prefill_chunker_takes_the_oldest_first_within_rows_and_pieces():
    assert chunk_counts([300, 100, 50], 256, 8) == [256, 0, 0]
    assert chunk_counts([100, 100, 100], 256, 8) == [100, 100, 56]
    assert chunk_counts([100, 100, 100], 256, 2) == [100, 100, 0]
    assert chunk_counts([10, 20], 256, 1) == [10, 0]
    assert chunk_counts([], 5, 1) == []
