"""The engine core over every backend: a single-sequence backend runs as one slot (requests one after another,
in arrival order), trees and live-cache reuse go through the core, a tree on a chain-only backend fails only
its request, and the probe schedule both K policies share."""

from __future__ import annotations

import pytest

from conftest import tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.slots import LeanSlots, OneSlot
from draftwise.config import SamplingParams
from draftwise.controller import ProbeBackoff
from draftwise.engine import EngineCore, PerSequenceProposers, SpeculativeEngine
from draftwise.prefix_cache import PrefixCache
from fakes import BigramLM, ScriptedTreeProposer, peaked_table

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
    model = build_lean(tiny_llama(0).model, quantization="none", name="tiny-batch", num_slots=2)
    oracle_target = build_lean(tiny_llama(0).model, quantization="none", name="tiny")
    core = EngineCore(model, PerSequenceProposers.of(ScriptedTreeProposer(3, [1] * 20, 96)), 3)
    assert isinstance(core.backend, LeanSlots) and not core.backend.supports_tree
    sequence = core.add([5, 6, 7], GREEDY)
    errors = []
    while core.has_work:
        errors += [o.error for o in core.step() if o.error is not None]
    assert sequence.finish_reason == "error" and len(errors) == 1 and "verifies chains only" in str(errors[0])
    assert EngineCore(model).generate([[5, 6, 7]], GREEDY)[0].token_ids == plain(oracle_target, [5, 6, 7])


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
