"""Cost model and calibration cache (no timing assertions: only what was measured, cached and reused)."""

from __future__ import annotations

import json

import pytest

from draftwise import calibration
from draftwise.calibration import (
    CostModel,
    ForwardCosts,
    cached_forward_costs,
    calibrate_cost_model,
    calibration_dir,
)
from draftwise.proposers.ngram import NgramProposer
from fakes import BigramLM, peaked_table


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    return tmp_path


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


def test_forward_costs_are_cached_per_model_and_reused(home):
    model = bigram()
    first = cached_forward_costs(model, [1, 2, 3], repeats=2)
    measured_forwards = model.num_forwards
    assert measured_forwards > 0
    files = list((home / "calibration").glob("*.json"))
    assert len(files) == 1 and calibration_dir() == home / "calibration"
    stored = json.loads(files[0].read_text())
    assert stored["key"]["model"]["name"] == "bigram" and "cpu_count" in stored["key"]["machine"]

    again = cached_forward_costs(model, [2, 3], repeats=2)  # a subset: read from the cache
    assert model.num_forwards == measured_forwards
    assert again == first

    cached_forward_costs(model, [1, 2, 3, 4], repeats=2)  # more ks than cached: measured again
    assert model.num_forwards > measured_forwards
    other = bigram(name="other-model")
    cached_forward_costs(other, [1, 2], repeats=2)
    assert other.num_forwards > 0
    assert len(list((home / "calibration").glob("*.json"))) == 2


def test_cache_key_includes_the_machine(home, monkeypatch):
    model = bigram()
    cached_forward_costs(model, [1, 2], repeats=1)
    count = model.num_forwards
    monkeypatch.setattr(calibration, "machine_identity", lambda device="cpu": {"cpu_count": 999})
    cached_forward_costs(model, [1, 2], repeats=1)
    assert model.num_forwards > count


def test_unreadable_cache_is_measured_again(home):
    model = bigram()
    cached_forward_costs(model, [1, 2], repeats=1)
    (path,) = (home / "calibration").glob("*.json")
    path.write_text("{not json")
    count = model.num_forwards
    costs = cached_forward_costs(model, [1, 2], repeats=1)
    assert model.num_forwards > count and set(costs.seconds) == {1, 2}
    assert json.loads(path.read_text())["forward_costs"]["seconds"].keys() == {"1", "2"}


def test_context_length_is_fitted_to_the_model(home):
    model = bigram(max_context=12)
    costs = cached_forward_costs(model, [1, 2, 3, 4], repeats=1)
    assert costs.context_len == 8
    with pytest.raises(ValueError, match="too short"):
        cached_forward_costs(bigram(max_context=4), [1, 2, 3, 4], repeats=1)


def test_calibrate_cost_model_for_draft_model_and_ngram(home):
    target, draft = bigram("target"), bigram("draft")
    with_draft = calibrate_cost_model(target, 4, draft=draft, repeats=1)
    assert with_draft.max_k == 4 and with_draft.source == "measured"
    assert draft.num_forwards > 0 and with_draft.draft_seconds_per_token > 0
    forwards = target.num_forwards, draft.num_forwards
    assert calibrate_cost_model(target, 4, draft=draft, repeats=1) == with_draft  # both from the cache
    assert (target.num_forwards, draft.num_forwards) == forwards

    with_ngram = calibrate_cost_model(target, 3, proposer=NgramProposer(1, 3), repeats=1)
    assert with_ngram.verify_seconds == with_draft.verify_seconds[:4]  # the target's cached curve is shared
    assert 0 < with_ngram.draft_seconds_per_token < with_ngram.verify_seconds[0]
    assert calibrate_cost_model(target, 2, repeats=1).draft_seconds_per_token == 0.0
    with pytest.raises(ValueError):
        calibrate_cost_model(target, 0)


def test_build_engine_with_auto_k_on_stories260k(stories_path, draftwise_home):
    """The builder wires an n-gram proposer and the controller; output equals plain decoding."""
    from draftwise.builder import build_engine
    from draftwise.config import SamplingParams, SpeculativeConfig
    from draftwise.controller import AutoK

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, k_policy="auto")
    bundle = build_engine(str(stories_path), config, device="cpu")
    assert bundle.method == "ngram" and bundle.draft is None
    assert isinstance(bundle.engine._controller_factory(), AutoK)
    assert list((draftwise_home / "calibration").glob("*.json"))
    prompt = bundle.target.encode("One two three. One two three. One two three. One")
    params = SamplingParams(max_tokens=40)
    plain = build_engine(str(stories_path), None, device="cpu").engine.generate(prompt, params)
    assert bundle.engine.generate(prompt, params).token_ids == plain.token_ids
