"""Cost model and calibration cache (no timing assertions: only what was measured, cached and reused)."""

from __future__ import annotations

import json

import pytest

from draftwise.speculation import calibration
from draftwise.speculation.calibration import (
    CostModel,
    ForwardCosts,
    cached_forward_costs,
    calibrate_cost_model,
    calibration_dir,
    monotone_fit,
)
from draftwise.proposers.ngram import NgramProposer
from fakes import BigramLM, peaked_table


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def timer(monkeypatch):
    """Replace the stopwatch with scripted timings (0.1 s * (1 + 0.2 (k - 1)), k = 3 dips as noise) and record
    which backends were timed for which ks."""
    calls = []

    def fake(backend, ks, *, context_len, repeats, warmup, num_logits=None):
        ks = sorted(set(ks) | {1})
        calls.append((backend.name, ks, context_len) + ((num_logits,) if num_logits is not None else ()))
        growth = 1 + 0.001 * max(0, context_len - 200)  # passes 0.1% slower per context token beyond 200
        return {k: [0.1 * (1 + 0.2 * (k - 1)) * (0.5 if k == 3 else 1.0) * growth] * repeats for k in ks}

    monkeypatch.setattr(calibration, "_time_forward_passes", fake)
    return calls


def bigram(name="bigram", max_context=512):
    return BigramLM(peaked_table(16, seed=0), max_context=max_context, name=name)


def test_cost_model_curve_and_round_trip():
    costs = CostModel((1.0, 1.5, 1.75), draft_seconds_per_token=0.25, source="scripted")
    assert costs.max_k == 2
    assert costs.verify_cost(2) == 1.5
    assert costs.verify_cost(5) == pytest.approx(1.75 + 2 * 0.25)  # linear extension of the last segment
    assert costs.step_cost(0) == 1.0 and costs.step_cost(2) == pytest.approx(0.5 + 1.75)
    assert CostModel.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    with pytest.raises(ValueError):
        costs.verify_cost(0)
    with pytest.raises(ValueError):
        CostModel((1.0, -1.0))
    forward = ForwardCosts(seconds={1: 0.1, 2: 0.15, 3: 0.2}, context_len=8)
    assert CostModel.from_forward_costs(forward, 0.01).verify_seconds == (0.1, 0.15, 0.2)
    assert ForwardCosts.from_dict(forward.to_dict()) == forward
    with pytest.raises(ValueError):
        CostModel.from_forward_costs(ForwardCosts(seconds={1: 0.1, 3: 0.2}, context_len=8), 0.0)


def test_real_measurement_is_cached(home):
    model = bigram()
    costs = cached_forward_costs(model, [1, 2, 3], repeats=2, max_spread=float("inf"))
    assert model.num_forwards > 0 and set(costs.seconds) == {1, 2, 3}
    (path,) = (home / "calibration").glob("*.json")
    assert calibration_dir() == home / "calibration"
    stored = json.loads(path.read_text())
    assert stored["key"]["model"]["name"] == "bigram" and "cpu_count" in stored["key"]["machine"]
    assert ForwardCosts.from_dict(stored["forward_costs"]) == costs


def test_forward_costs_are_cached_per_model_and_reused(home, timer):
    model = bigram()
    first = cached_forward_costs(model, [1, 2, 3], repeats=2)
    assert len(timer) == 1
    again = cached_forward_costs(model, [2, 3], repeats=2)  # a subset: read from the cache
    assert len(timer) == 1 and again == first
    cached_forward_costs(model, [1, 2, 3, 4], repeats=2)  # more ks than cached: measured again
    assert timer[-1][1] == [1, 2, 3, 4]
    cached_forward_costs(bigram(name="other-model"), [1, 2], repeats=2)
    assert timer[-1][0] == "other-model"
    assert len(list((home / "calibration").glob("*.json"))) == 2
    cached_forward_costs(model, [1, 2], repeats=2, refresh=True)
    assert len(timer) == 4


def test_cache_key_includes_the_machine(home, timer, monkeypatch):
    model = bigram()
    cached_forward_costs(model, [1, 2], repeats=1)
    monkeypatch.setattr(calibration, "machine_identity", lambda device="cpu": {"cpu_count": 999})
    cached_forward_costs(model, [1, 2], repeats=1)
    assert len(timer) == 2


def test_unreadable_cache_is_measured_again(home, timer):
    model = bigram()
    cached_forward_costs(model, [1, 2], repeats=1)
    (path,) = (home / "calibration").glob("*.json")
    path.write_text("{not json")
    costs = cached_forward_costs(model, [1, 2], repeats=1)
    assert len(timer) == 2 and set(costs.seconds) == {1, 2}
    assert json.loads(path.read_text())["forward_costs"]["seconds"].keys() == {"1", "2"}


def test_noisy_measurement_is_used_but_not_cached(home, monkeypatch):
    monkeypatch.setattr(calibration, "_time_forward_passes",
                        lambda backend, ks, **_: {1: [0.1, 0.1, 0.5], 2: [0.2, 0.2, 0.2]})
    costs = cached_forward_costs(bigram(), [1, 2], repeats=3)
    assert costs.seconds == {1: 0.1, 2: 0.2}  # medians
    assert not list(home.glob("calibration/*.json"))


def test_context_length_is_fitted_to_the_model(home, timer):
    costs = cached_forward_costs(bigram(max_context=12), [1, 2, 3, 4], repeats=1)
    assert costs.context_len == 8 and timer[-1][2] == 8
    with pytest.raises(ValueError, match="too short"):
        cached_forward_costs(bigram(max_context=4), [1, 2, 3, 4], repeats=1)


def test_monotone_fit():
    assert monotone_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert monotone_fit([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone_fit([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert monotone_fit([]) == []


def test_calibrate_cost_model_for_draft_model_and_ngram(home, timer):
    target, draft = bigram("target"), bigram("draft")
    with_draft = calibrate_cost_model(target, 4, draft=draft, repeats=1)
    assert with_draft.max_k == 4 and with_draft.source == "measured"
    # the verify curve, the draft's one-token and 256-token (prefill: the last row's logits only, as a catch-up
    # asks) passes, then both again at a long context
    assert timer == [("target", [1, 2, 3, 4, 5], 200), ("draft", [1, 256], 200, 1), ("draft", [1], 510),
                     ("target", [1], 510)]
    assert with_draft.draft_seconds_per_token == pytest.approx(0.1)
    assert with_draft.draft_prefill_seconds_per_token == pytest.approx(0.1 * (1 + 0.2 * 255) / 256)
    assert with_draft.context_len == 200
    assert with_draft.target_context_growth == pytest.approx(0.001)
    assert with_draft.draft_context_growth == pytest.approx(0.001)
    curve = with_draft.verify_seconds
    assert all(a <= b for a, b in zip(curve, curve[1:]))  # the dip at k = 3 is smoothed away
    assert curve == pytest.approx(monotone_fit([0.1, 0.12, 0.07, 0.16, 0.18]))
    assert calibrate_cost_model(target, 4, draft=draft, repeats=1) == with_draft  # all from the cache
    assert len(timer) == 4

    with_ngram = calibrate_cost_model(target, 3, proposer=NgramProposer(1, 3), repeats=1)
    assert len(timer) == 4  # the target's cached curve and growth are shared
    assert with_ngram.draft_prefill_seconds_per_token == 0.0 and with_ngram.draft_context_growth == 0.0
    assert with_ngram.max_k == 3
    assert 0 < with_ngram.draft_seconds_per_token < 0.01  # really timed: microseconds
    assert calibrate_cost_model(target, 2, repeats=1).draft_seconds_per_token == 0.0
    with pytest.raises(ValueError):
        calibrate_cost_model(target, 0)


def test_build_engine_with_auto_k_on_stories260k(stories_path, draftwise_home):
    """The builder wires an n-gram proposer and the controller; output equals plain decoding."""
    from draftwise.builder import build_engine
    from draftwise.config import SamplingParams, SpeculativeConfig
    from draftwise.speculation.controller import AutoK

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, k_policy="auto")
    bundle = build_engine(str(stories_path), config, device="cpu")
    assert bundle.method == "ngram" and bundle.draft is None
    controller = bundle.engine._controller_factory()
    assert isinstance(controller, AutoK) and controller.max_k == 4 and controller.cost_model.max_k == 4
    prompt = bundle.target.encode("One two three. One two three. One two three. One")
    params = SamplingParams(max_tokens=40)
    plain = build_engine(str(stories_path), None, device="cpu").engine.generate(prompt, params)
    assert bundle.engine.generate(prompt, params).token_ids == plain.token_ids


def test_cache_key_holds_the_backends_timing_settings(home, timer):
    """llama.cpp threads, flash attention and batch invariance change the timings: each setting gets its own
    cache entry, a backend without them keeps the plain identity."""
    model = bigram()
    assert "settings" not in calibration.backend_identity(model)
    cached_forward_costs(model, [1, 2], repeats=1)
    model.n_threads, model.flash_attention, model.batch_invariant = 2, True, True
    identity = calibration.backend_identity(model)
    assert identity["settings"] == {"n_threads": 2, "flash_attention": True, "batch_invariant": True}
    cached_forward_costs(model, [1, 2], repeats=1)
    assert len(timer) == 2  # new settings: measured again
    for name, value in (("n_threads", 1), ("flash_attention", False), ("batch_invariant", False)):
        setattr(model, name, value)
        cached_forward_costs(model, [1, 2], repeats=1)
    assert len(timer) == 5
    cached_forward_costs(model, [1, 2], repeats=1)
    assert len(timer) == 5  # same settings again: from the cache
    assert len(list((home / "calibration").glob("*.json"))) == 5


def test_prefill_timing_asks_for_the_last_rows_logits_only(home):
    """A draft's catch-up asks for its last row's logits; timing the prefill pass with every row's logits (an LM
    head over each row, k x vocab floats copied out) measured it about twice as slow on llama.cpp. The passes get
    ``num_logits`` as given, and the cache keeps such timings apart from full-logit (verification) ones."""
    asked = []

    class Recording(BigramLM):
        def forward(self, token_ids, *, num_logits=None, **kwargs):
            if len(token_ids) > 1 or num_logits is not None:
                asked.append((len(token_ids), num_logits))
            return super().forward(token_ids, num_logits=num_logits, **kwargs)

    model = Recording(peaked_table(16, seed=0), max_context=512, name="recording")
    calibration.forward_pass_samples(model, [1, 8], context_len=20, repeats=1, warmup=0, num_logits=1)
    assert (8, 1) in asked and (8, None) not in asked  # the timed 8-token passes ask for one row
    asked.clear()
    calibration.forward_pass_samples(model, [1, 8], context_len=20, repeats=1, warmup=0)
    assert (8, None) in asked  # verification passes: every row's logits
    cached_forward_costs(model, [1, 8], context_len=20, repeats=1, num_logits=1)
    cached_forward_costs(model, [1, 8], context_len=20, repeats=1)
    assert len(list((home / "calibration").glob("*.json"))) == 2


def test_draft_passes_and_seconds_give_the_one_token_cost_and_the_catch_up_rate():
    """A draft is timed on one token and a prefill chunk (fewer tokens where its context cannot hold them); the
    chunk's time per token is the catch-up rate, the one-token pass the drafting cost."""
    from draftwise.speculation.calibration import PREFILL_CHUNK_TOKENS, ForwardCosts, draft_passes, draft_seconds

    roomy = BigramLM(peaked_table(16, seed=0), max_context=4096, name="roomy")
    tight = BigramLM(peaked_table(16, seed=0), max_context=300, name="tight")
    assert draft_passes(roomy, 200) == [1, PREFILL_CHUNK_TOKENS]
    assert draft_passes(tight, 200) == [1, 99]  # 300 - 200 - 1 tokens fit above the context
    one, per_token = draft_seconds(ForwardCosts({1: 0.02, 99: 0.495}, context_len=200))
    assert one == pytest.approx(0.02) and per_token == pytest.approx(0.005)
