"""Continuous batching with speculative decoding (draftwise.batching): every sequence's output equals the same
request served alone, whatever else is in the batch (interleaved arrivals, prompts of different lengths across
chunked prefills, cancellations), with or without speculation; load-aware K; the pass-cost curve."""

from __future__ import annotations


import pytest
import torch

from conftest import first_layer_copy, tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.slots import OneSlot
from draftwise.backends.quantization import int8_kernels_available
from draftwise.engine import EngineCore
from draftwise.speculation.pass_costs import calibrate_pass_costs
from draftwise.builder import build_batched_engine
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.speculation.cost_model import PassCostCurve, plan_batch_k
from draftwise.engine import SpeculativeEngine
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.base import PerSequenceProposers
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.hybrid import HybridPolicy, HybridProposer
from draftwise.proposers.ngram import NgramProposer
from draftwise.proposers.suffix import SuffixCache, SuffixProposer

MODE = "int8" if int8_kernels_available() else "none"
SLOTS = 4
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def hf():
    return tiny_llama(0).model


@pytest.fixture(scope="module")
def single(hf):
    """The one-slot lean target: the oracle (plain decoding of each request alone)."""
    return build_lean(hf, quantization=MODE, name="tiny")


@pytest.fixture(scope="module")
def multi(hf):
    return build_lean(hf, quantization=MODE, name="tiny-batch", num_slots=SLOTS)


@pytest.fixture(scope="module")
def weak_draft_hf(hf):
    """The target's first layer: a real, imperfect draft."""
    return first_layer_copy(hf)


def prompts(lengths, seed: int = 0, vocab: int = 96) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        base = torch.randint(2, vocab, (max(1, n // 3),), generator=generator).tolist()
        out.append((base * 4)[:n])  # repeated text: n-gram and suffix drafts get matches
    return out


def alone(single, prompt, params=GREEDY, proposer=None, k: int = 4) -> list[int]:
    engine = SpeculativeEngine(single, proposer, k) if proposer else SpeculativeEngine(single)
    return engine.generate(prompt, params).token_ids


def ngram() -> PerSequenceProposers:
    return PerSequenceProposers(NgramProposer, "ngram")


class LinearCosts:
    """Scripted hybrid costs (seconds): a draft token 0.2, a target pass over n tokens ``1 + 0.05 (n - 1)``."""

    draft_seconds_per_token = 0.2

    def verify_cost(self, num_tokens: int) -> float:
        return 1.0 + 0.05 * (num_tokens - 1)


def suffix_factory():
    """Makes per-sequence suffix proposers sharing one cross-request index (as the builder's)."""
    shared = SuffixCache(24, 100, 100_000)

    def suffix() -> SuffixProposer:
        proposer = SuffixProposer()
        proposer.cache = shared
        return proposer

    return suffix


def batched_hybrid(draft_hf, k: int = 4) -> HybridProposer:
    """Per-sequence suffix proposers over one shared index, and the batched draft model ``draft_hf``."""
    draft = DraftModelProposer(build_lean(draft_hf, quantization=MODE, num_slots=SLOTS), 96, slot_per_sequence=True)
    return HybridProposer(suffix_factory(), draft, HybridPolicy(LinearCosts(), max_k=k, learn_costs=False))


def run_interleaved(engine: EngineCore, schedule: dict[int, list[list[int]]], params=GREEDY,
                    cancel_at: dict[int, int] | None = None):
    """Add ``schedule[step]`` prompts before step ``step``; cancel request i before step ``cancel_at[i]``.
    Returns the sequences in arrival order."""
    sequences, step = [], 0
    cancel_at = cancel_at or {}
    while step <= max(schedule) or engine.has_work:
        for prompt in schedule.get(step, []):
            sequences.append(engine.add(prompt, params))
        for index, when in cancel_at.items():
            if when == step and index < len(sequences):
                engine.cancel(sequences[index])
        engine.step()
        step += 1
        assert step < 2000
    return sequences


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("method", ["plain", "ngram-fixed", "ngram-auto", "suffix", "draft-fixed", "draft-auto",
                                    "hybrid-fixed", "hybrid-auto"])
def test_greedy_outputs_equal_each_request_alone(single, multi, hf, weak_draft_hf, method):
    """Six requests of 5..170 tokens (prompt chunks cross steps and 64-key blocks) through 4 slots, arriving at
    steps 0, 0, 1, 3, 9 and 20, equal plain decoding of each alone, bit for bit."""
    proposer, policy = None, "fixed"
    if method.startswith("ngram"):
        proposer, policy = ngram(), method.split("-")[1]
    elif method == "suffix":
        proposer = PerSequenceProposers(SuffixProposer, "suffix")
    elif method.startswith("draft"):
        proposer = DraftModelProposer(build_lean(weak_draft_hf, quantization=MODE, num_slots=SLOTS), 96, slot_per_sequence=True)
        policy = method.split("-")[1]
    elif method.startswith("hybrid"):
        proposer, policy = batched_hybrid(weak_draft_hf), method.split("-")[1]
    engine = EngineCore(multi, proposer, 4, max_num_batched_tokens=48, k_policy=policy,
                           pass_costs=PassCostCurve(points={1: 1.0, 64: 1.5}), learn_costs=False)
    batch = prompts([5, 70, 170, 12, 33, 9], seed=1)
    schedule = {0: batch[:2], 1: [batch[2]], 3: [batch[3]], 9: [batch[4]], 20: [batch[5]]}
    sequences = run_interleaved(engine, schedule)
    for prompt, sequence in zip(batch, sequences):
        assert sequence.result.token_ids == alone(single, prompt), (method, len(prompt))
        assert sequence.result.finish_reason == "length"
    assert engine.num_running == 0 and engine.num_free_slots == SLOTS
    if proposer is not None:
        assert sum(s.stats.num_draft_tokens for s in sequences) > 0  # speculation really ran
    if method.startswith("hybrid"):
        assert proposer.num_suffix_steps > 0 and proposer.num_draft_steps > 0  # both sides drafted


def test_hybrid_in_the_batch_keeps_the_draft_state_and_switches_sides(single, multi, weak_draft_hf):
    """An imperfect draft beside suffix decoding on repeated text: sequences switch between suffix and
    draft-model steps (the draft slot catches up on what suffix steps committed) and stay exact; a finished
    sequence keeps the draft's state in the prefix cache and the next turn imports it."""
    hybrid = batched_hybrid(weak_draft_hf, k=3)
    engine = EngineCore(multi, hybrid, 3, prefix_cache=PrefixCache(64 << 20), learn_costs=False,
                        pass_costs=PassCostCurve(points={1: 1.0, 64: 1.5}))  # scripted target costs
    first_prompt = prompts([40], seed=6)[0]
    first = engine.generate([first_prompt], GREEDY)[0]
    assert first.token_ids == alone(single, first_prompt)
    kept = engine.prefix_cache.lookup("", first_prompt + first.token_ids).entry
    assert kept is not None and kept.proposer_state.draft is not None  # the draft's state is kept
    follow_up = first_prompt + first.token_ids + [5, 6, 7]
    second, *others = engine.generate([follow_up] + prompts([30, 9], seed=8), GREEDY)
    assert second.stats.num_cached_prompt_tokens == len(first_prompt) + len(first.token_ids) - 1
    assert second.token_ids == alone(single, follow_up)
    assert [r.token_ids for r in others] == [alone(single, p) for p in prompts([30, 9], seed=8)]
    assert hybrid.num_draft_steps > 0 and hybrid.num_suffix_steps > 0


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_a_next_turn_adopts_the_kept_suffix_index(single, multi, weak_draft_hf, method):
    """The suffix side's request index travels with the prefix-cache entry: the next turn (its prompt = the last
    prompt + answer + new tokens) adopts it and indexes only what is new, where a fresh index costs up to D node
    updates per prompt token (70 ms for 1,000 tokens: the batched server's later-turn TTFT, found by a new-user
    test); a second request matching the same entry at the same time builds its own; both stay exact."""
    if method == "suffix":
        proposers = PerSequenceProposers(suffix_factory(), "suffix")
        suffix_of = lambda sequence: proposers._proposers[sequence.seq_id]  # noqa: E731
    else:
        proposers = batched_hybrid(weak_draft_hf, k=3)
        suffix_of = lambda sequence: proposers._lanes[sequence.seq_id].suffix  # noqa: E731
    engine = EngineCore(multi, proposers, 3, prefix_cache=PrefixCache(64 << 20), learn_costs=False,
                        pass_costs=PassCostCurve(points={1: 1.0, 64: 1.5}))
    first_prompt = prompts([40], seed=6)[0]
    first = engine.generate([first_prompt], GREEDY)[0]
    entry = engine.prefix_cache.lookup("", first_prompt + first.token_ids).entry
    kept = entry.proposer_state if method == "suffix" else entry.proposer_state.suffix
    index, work_before = kept.index, kept.index.update_work
    entry_bytes, index_bytes = entry.nbytes, kept.nbytes
    follow_up = first_prompt + first.token_ids + [5, 6, 7]
    second, twin = engine.add(follow_up, GREEDY), engine.add(follow_up, GREEDY)
    engine.step()
    assert kept.index is None  # taken: one owner at a time
    assert index_bytes > 0 and entry.nbytes == entry_bytes - index_bytes  # no longer counted against the budget
    assert suffix_of(second).local is index and suffix_of(twin).local is not index
    twin_index = suffix_of(twin).local
    while engine.has_work:
        engine.step()
    assert second.result.token_ids == twin.result.token_ids == alone(single, follow_up)
    assert 2 * (index.update_work - work_before) < twin_index.update_work  # the prompt was not indexed again


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_hybrid_steps_are_counted_per_sequence(multi, weak_draft_hf, policy):
    """Each sequence's ``hybrid_steps`` are the proposals the hybrid made for it: over the batch they add up to
    the hybrid's own counters, the suffix and draft-model passes are the sequence's drafts, and no more passes
    are counted than the sequence took (the load-aware K plans some at K = 0 without asking the hybrid)."""
    hybrid = batched_hybrid(weak_draft_hf, k=3)
    engine = EngineCore(multi, hybrid, 3, learn_costs=False, k_policy=policy,
                        pass_costs=PassCostCurve(points={1: 1.0, 64: 1.5}))
    results = engine.generate(prompts([40, 30, 9, 60], seed=8), GREEDY)
    for result in results:
        steps = result.stats.hybrid_steps
        assert steps is not None and set(steps) == {"suffix", "draft_model", "plain"}
        assert steps["suffix"] + steps["draft_model"] == result.stats.num_drafts
        assert sum(steps.values()) <= result.stats.num_target_passes
    assert {side: sum(r.stats.hybrid_steps[side] for r in results) for side in ("suffix", "draft_model", "plain")} \
        == {"suffix": hybrid.num_suffix_steps, "draft_model": hybrid.num_draft_steps, "plain": hybrid.num_plain_steps}
    assert hybrid.num_suffix_steps > 0 and hybrid.num_draft_steps > 0


def test_speculative_draft_of_the_target_itself_accepts_everything(single, multi, hf):
    draft = DraftModelProposer(build_lean(hf, quantization=MODE, num_slots=SLOTS), 96, slot_per_sequence=True)
    engine = EngineCore(multi, draft, 3)
    batch = prompts([7, 40, 90], seed=2)
    results = engine.generate(batch, GREEDY)
    for prompt, result in zip(batch, results):
        assert result.token_ids == alone(single, prompt)
        assert result.stats.num_draft_tokens > 0 and result.stats.acceptance_rate == 1.0


def test_cancellations_mid_way_leave_the_others_exact(single, multi):
    """Cancelling two running requests (one while its prompt is being prefilled) frees their slots for the
    queued ones at once; the others' outputs are unchanged and a cancelled output is a prefix of its own."""
    engine = EngineCore(multi, ngram(), 4, max_num_batched_tokens=32)
    batch = prompts([20, 150, 8, 60, 15, 44], seed=3)
    sequences = run_interleaved(engine, {0: batch[:5], 4: [batch[5]]}, cancel_at={1: 2, 2: 6})
    for i, (prompt, sequence) in enumerate(zip(batch, sequences)):
        full = alone(single, prompt)
        if i in (1, 2):
            assert sequence.result.finish_reason == "cancelled"
            assert sequence.result.token_ids == full[:len(sequence.result.token_ids)]
        else:
            assert sequence.result.token_ids == full, i
    assert sequences[1].result.token_ids == []  # cancelled during its 150-token prefill
    assert engine.num_free_slots == SLOTS


def test_cancelling_a_waiting_request_and_repeated_cancels(multi):
    engine = EngineCore(multi, None, max_num_seqs=1)
    first, second = engine.add([5, 6, 7], GREEDY), engine.add([8, 9], GREEDY)
    engine.step()
    engine.cancel(second)  # still waiting: leaves the queue
    engine.cancel(second)
    assert second.result.finish_reason == "cancelled" and second.result.token_ids == []
    assert engine.num_waiting == 0 and engine.num_running == 1
    engine.cancel(first)
    assert first.result.finish_reason == "cancelled" and len(first.result.token_ids) == 1
    assert not engine.has_work and engine.step() == []


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_seeded_sampling_equals_the_request_alone(single, multi, rule):
    """Coupled sampling: the text is the target's Gumbel-argmax per position, so the batched speculative text
    equals plain decoding alone. Rejection sampling: with fixed K and a per-sequence n-gram proposer, the drafts
    and random draws equal the single engine's with the same proposer and K."""
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=s, sampling=rule, ignore_eos=True)
              for s in (1, 2, 3, 4, 5)]
    batch = prompts([6, 30, 75, 11, 50], seed=4)
    engine = EngineCore(multi, ngram(), 4)
    results = engine.generate(batch, params)
    for prompt, p, result in zip(batch, params, results):
        oracle = alone(single, prompt, p) if rule == "coupled" else alone(single, prompt, p, NgramProposer(), 4)
        assert result.token_ids == oracle


def test_stops_max_tokens_and_statistics(single, multi):
    engine = EngineCore(multi, ngram(), 4, eos_token_ids=[1])
    batch = prompts([10, 25], seed=5)
    full = alone(single, batch[0])
    stop = next(t for i, t in enumerate(full) if i >= 3 and t not in full[:i])  # first seen mid-sequence
    one, stopped, plain = (engine.add(batch[0], SamplingParams(max_tokens=1, ignore_eos=True)),
                           engine.add(batch[0], SamplingParams(max_tokens=24, stop_token_ids=(stop,), ignore_eos=True)),
                           engine.add(batch[1], GREEDY, num_speculative_tokens=0))
    while engine.has_work:
        engine.step()
    assert one.result.token_ids == full[:1] and one.result.finish_reason == "length"
    assert stopped.result.token_ids == full[:full.index(stop)] and stopped.result.finish_reason == "stop"
    assert plain.result.token_ids == alone(single, batch[1]) and plain.result.stats.num_draft_tokens == 0
    stats = stopped.result.stats
    assert stats.num_generated_tokens == len(stopped.result.token_ids) and stats.num_prompt_tokens == 10
    assert stats.num_step_tokens + 1 == stats.num_generated_tokens  # the first token comes from the prefill


def test_prefix_cache_reuse_in_the_batch(single, multi, hf):
    draft = DraftModelProposer(build_lean(hf, quantization=MODE, num_slots=SLOTS), 96, slot_per_sequence=True)
    engine = EngineCore(multi, draft, 3, prefix_cache=PrefixCache(64 << 20))
    first_prompt = prompts([40], seed=6)[0]
    first = engine.generate([first_prompt], GREEDY)[0]
    follow_up = first_prompt + first.token_ids + [5, 6, 7]
    second = engine.generate([follow_up], GREEDY)[0]
    assert second.stats.num_cached_prompt_tokens == len(first_prompt) + len(first.token_ids) - 1
    assert second.token_ids == alone(single, follow_up)
    assert second.stats.acceptance_rate == 1.0  # the draft's kept state was imported too
    other_scope = engine.add(follow_up, GREEDY, scope="someone else")
    while engine.has_work:
        engine.step()
    assert other_scope.result.stats.num_cached_prompt_tokens == 0


def test_bad_requests_and_settings(multi, single):
    engine = EngineCore(multi, ngram(), 4)
    with pytest.raises(ValueError, match="empty"):
        engine.add([], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        engine.add([96], GREEDY)
    with pytest.raises(ValueError, match="no room"):
        engine.add([3] * 256, GREEDY)
    with pytest.raises(ValueError, match="0..4"):
        engine.add([3], GREEDY, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineCore(multi, max_num_seqs=SLOTS + 1)
    assert EngineCore(tiny_llama(0)).max_num_seqs == 1  # any other backend runs as one slot
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineCore(tiny_llama(0), max_num_seqs=2)
    with pytest.raises(ValueError, match="k_policy"):
        EngineCore(multi, ngram(), k_policy="sometimes")
    with pytest.raises(ValueError, match="slots"):
        EngineCore(multi, DraftModelProposer(single, 96, slot_per_sequence=True), 3)


# ---------------------------------------------------------------------------------------------- load-aware K
def linear_costs(per_row: float, base: float = 1.0) -> PassCostCurve:
    """A compute-bound curve: every row costs ``per_row`` seconds on top of ``base``."""
    return PassCostCurve(points={1: base + per_row, 256: base + 256 * per_row})


def test_plan_batch_k_falls_with_load_and_rises_when_it_drops():
    cheap = linear_costs(0.01).seconds  # a memory-bound pass: rows cost little
    costly = linear_costs(0.25).seconds  # a compute-bound pass: every row costs a quarter of the base
    good = [0.8] * 6
    assert plan_batch_k([good], [6], 1, cheap) == [6]
    # T(n) = 1 + n / 4: K=4 gives 3.36 tokens in 2.25 s (1.49 tokens/s), K=3 1.48, K=5 1.48, K=0 0.8
    assert plan_batch_k([good], [6], 1, costly) == [4]
    per_load = {n: plan_batch_k([good] * n, [6] * n, n, costly) for n in (1, 2, 4, 8, 16, 32)}
    ks = [max(plan) for plan in per_load.values()]
    assert ks == sorted(ks, reverse=True) and ks[0] == 4 and ks[-1] == 0  # K falls as the batch grows...
    assert plan_batch_k([good] * 2, [6] * 2, 2, costly) == [3, 3]  # ...and rises again when the load drops
    mixed = plan_batch_k([[0.95] * 6, [0.2] * 6, [0.7] * 6], [6, 6, 6], 3, linear_costs(0.05).seconds)
    assert mixed[0] > mixed[2] > mixed[1] == 0  # the draft rows go where acceptance is
    assert plan_batch_k([good], [2], 1, cheap) == [2]  # capped by what was offered
    assert plan_batch_k([good] * 2, [6, 6], 2, cheap, max_draft_rows=3) == [2, 1]
    # a draft model's passes (one per depth) make long drafts dearer
    assert plan_batch_k([good], [6], 1, cheap, lambda rows: 0.3) < plan_batch_k([good], [6], 1, cheap)
    with pytest.raises(ValueError):
        plan_batch_k([good], [7], 1, cheap)


def test_pass_cost_curve():
    curve = PassCostCurve(smoothing=0.5)
    with pytest.raises(ValueError, match="no measurement"):
        curve.seconds(1)
    curve.observe(4, 1.0)
    assert curve.seconds(2) == 1.0 and curve.seconds(8) == 2.0  # one point: proportional beyond it
    curve.observe(8, 1.4)
    curve.observe(8, 1.8)  # running average: 1.6
    assert curve.seconds(6) == pytest.approx(1.3) and curve.seconds(12) == pytest.approx(2.2)
    curve.observe(16, 1.2)  # noisy: read as non-decreasing
    assert curve.seconds(16) == pytest.approx(1.6) and curve.seconds(0) == 0.0
    with pytest.raises(ValueError):
        curve.observe(0, 1.0)
    shared = PassCostCurve(per_sequence=0.25)
    shared.observe(4, 2.0, sequences=4)  # 1 s of it is the four sequences' fixed part
    assert shared.seconds(4) == 1.0 and shared.pass_seconds(4, 2) == 1.5
    # the fixed part of a pass is the same whatever the K: it makes draft rows relatively cheaper
    flat = PassCostCurve(points={1: 1.0, 16: 2.5})
    with_fixed = PassCostCurve(points={1: 1.0, 16: 2.5}, per_sequence=1.0)
    assert plan_batch_k([[0.6] * 4], [4], 1, flat.seconds) < \
        plan_batch_k([[0.6] * 4], [4], 1, lambda rows: with_fixed.pass_seconds(rows, 1))


def knee_costs() -> PassCostCurve:
    """Memory-bound up to 3 rows (free rows), then every row costs more than a whole 3-row pass."""
    return PassCostCurve(points={1: 1.0, 3: 1.0, 4: 2.0, 256: 300.0})


def test_load_aware_k_in_the_engine(single, multi):
    """Where rows past the third are dear, one sequence speculates and four do not; when three finish, K rises
    again. Outputs stay exact."""
    engine = EngineCore(multi, ngram(), 6, k_policy="auto", pass_costs=knee_costs(), learn_costs=False)
    long_prompt = prompts([30], seed=7)[0]
    batch = [long_prompt] + prompts([8, 9, 10], seed=8)
    params = [SamplingParams(max_tokens=60, ignore_eos=True)] + [SamplingParams(max_tokens=12, ignore_eos=True)] * 3
    sequences = [engine.add(p, sp) for p, sp in zip(batch, params)]
    busy, alone_ks = [], []
    while engine.has_work:
        engine.step()
        step = engine.last_step
        if step.num_decoding == 4:
            busy.extend(step.ks)
        elif step.num_decoding == 1:
            alone_ks.extend(step.ks)
    assert busy and max(busy) == 0
    assert alone_ks and max(alone_ks) > 0
    for prompt, p, sequence in zip(batch, params, sequences):
        assert sequence.result.token_ids == alone(single, prompt, p)


def test_probe_after_plain_steps(multi):
    """A sequence whose acceptance estimate fell below break-even still gets a one-token probe now and then."""
    engine = EngineCore(multi, ngram(), 4, k_policy="auto", pass_costs=linear_costs(0.05), learn_costs=False)
    sequence = engine.add(prompts([12], seed=9)[0], SamplingParams(max_tokens=80, ignore_eos=True))
    engine.step()
    for _ in range(30):
        sequence.estimator.observe(4, 0)  # as if every draft had been rejected
    ks = []
    while engine.has_work:
        engine.step()
        ks.append(engine.last_step.ks[0] if engine.last_step.ks else 0)
    assert 0 in ks and 1 in ks  # plain steps, and probes


def test_calibration_measures_and_frees_the_slots(multi):
    curve = calibrate_pass_costs(multi.model, [1, 4, 9], [0, 1, 2], repeats=1)
    assert sorted(curve.points) == [1, 4, 9] and all(s > 0 for s in curve.points.values())
    assert multi.model.cache.lengths[:3] == [0, 0, 0]
    engine = EngineCore(multi, ngram(), 4, k_policy="auto", max_num_seqs=3, max_num_batched_tokens=64)
    assert set(engine.pass_costs.points) >= {1, 2, 3, 4, 8, 15}


# ---------------------------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def stories_batch(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    return load_model(str(stories_path), quantization=MODE, runtime="lean", num_slots=SLOTS)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "hybrid"])
def test_stories_batch_equals_alone(stories_batch, stories_path, method):
    from draftwise.models.loading import derive_layer_draft, load_model
    from draftwise.builder import BuildOptions

    target = stories_batch
    single_model = load_model(str(stories_path), quantization=MODE, runtime="lean")
    texts = ["Once upon a time", "Lily and Ben went to the park. They saw", "The little dog", "One day, Tom",
             "The sun was shining and the birds"]
    prompt_ids = [target.encode(t) for t in texts]
    params = SamplingParams(max_tokens=32)
    if method in ("ngram", "hybrid"):  # hybrid: the stories model drafts for itself
        draft = dict(model=str(stories_path), backend="torch") if method == "hybrid" else {}
        config = SpeculativeConfig(method=method, num_speculative_tokens=4, **draft)
        engine, _ = build_batched_engine(target, config, BuildOptions(quantization=MODE), max_num_seqs=SLOTS)
        assert engine.proposer.name == method
    else:
        hf_draft = derive_layer_draft(load_model(str(stories_path), device="cpu"), 2).backend.model
        draft = DraftModelProposer(build_lean(hf_draft, quantization=MODE, num_slots=SLOTS), target.backend.vocab_size, slot_per_sequence=True)
        engine = EngineCore(target.backend, draft, 4, eos_token_ids=target.eos_token_ids)
    results = engine.generate(prompt_ids, params)
    for ids, result in zip(prompt_ids, results):
        oracle = SpeculativeEngine(single_model.backend, eos_token_ids=single_model.eos_token_ids).generate(ids, params)
        assert result.token_ids == oracle.token_ids
    if method != "ngram":
        assert sum(r.stats.num_accepted_tokens for r in results) > 0
    for result in results:  # hybrid: every decode pass but a last one clamped to K = 0 was the hybrid's to draft
        steps = result.stats.hybrid_steps
        if method != "hybrid":
            assert steps is None
            continue
        assert steps["suffix"] + steps["draft_model"] == result.stats.num_drafts
        assert result.stats.num_target_passes - sum(steps.values()) in (0, 1)


def test_build_engine_batches_lean_targets_only(stories_path, draftwise_home, caplog, monkeypatch):
    from draftwise.builder import build_engine

    ngram_config = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    bundle = build_engine(str(stories_path), ngram_config, quantization=MODE, runtime="lean", max_num_seqs=3,
                          max_num_batched_tokens=100)
    engine = bundle.core
    assert isinstance(engine, EngineCore) and engine.max_num_seqs == 3 and engine.max_num_batched_tokens == 100
    assert engine.proposer.name == "ngram" and engine.k_policy == "fixed" and engine.prefix_cache is not None
    plain = build_engine(str(stories_path), None, quantization=MODE, runtime="lean", max_num_seqs=2).core
    assert isinstance(plain, EngineCore) and plain.proposer is None
    one = build_engine(str(stories_path), ngram_config, quantization=MODE, runtime="lean").core
    assert isinstance(one.backend, OneSlot)  # max_num_seqs 1: the single-sequence engine
    hybrid = SpeculativeConfig(method="hybrid", model=str(stories_path), num_speculative_tokens=3)
    batched_hybrid = build_engine(str(stories_path), hybrid, quantization=MODE, runtime="lean", max_num_seqs=2)
    assert isinstance(batched_hybrid.core, EngineCore) and batched_hybrid.core.proposer.name == "hybrid"
    monkeypatch.setattr("draftwise.builder.BATCHED_METHODS", ("ngram",))  # a method the batch does not run
    suffix_config = SpeculativeConfig(method="suffix", num_speculative_tokens=3)
    with caplog.at_level("WARNING"):
        assert isinstance(build_engine(str(stories_path), suffix_config, quantization=MODE, runtime="lean",
                                       max_num_seqs=2).core.backend, OneSlot)
        assert isinstance(build_engine(str(stories_path), ngram_config, runtime="transformers",
                                       max_num_seqs=2).core.backend, OneSlot)
    assert "does not run in the batched engine" in caplog.text and "needs the lean runtime" in caplog.text


def test_a_batched_engine_whose_k_outgrows_the_context_calibrates_what_fits(stories_path, draftwise_home):
    """Found by a new-user test: `serve --max-model-len 40` with a suffix proposer at K=64 and k_policy auto
    died at start ("cache entry 63 outside a context of 40"): the calibration timed 65-row passes in one slot.
    It now times the row counts a slot can hold, and the engine serves (K is clamped to the room anyway)."""
    from draftwise.builder import build_engine

    config = SpeculativeConfig(method="suffix", num_speculative_tokens=64, k_policy="auto")
    engine = build_engine(str(stories_path), config, quantization=MODE, runtime="lean", max_num_seqs=2,
                          max_context=40).core
    assert isinstance(engine, EngineCore)
    assert max(engine.pass_costs.points) <= 40
    [result] = engine.generate([[1, 400, 500]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8
