"""The method registry: every entry builds, config validation goes through it, and adding a method needs no
branch elsewhere."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from draftwise.config import SpeculativeConfig
from draftwise.methods import METHODS, get_method, method_names


def test_every_method_has_a_module_and_a_build_function_in_the_builder():
    from draftwise.builder import PROPOSER_BUILDERS

    assert method_names() == ("draft_model", "ngram", "suffix", "medusa", "eagle", "hybrid")
    assert set(PROPOSER_BUILDERS) == set(METHODS)
    for spec in METHODS.values():
        importlib.import_module(spec.module)
        assert callable(PROPOSER_BUILDERS[spec.name]), spec.name
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        assert set(spec.fields) <= known, spec.name


def test_unknown_method_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown speculative method 'magic'.*suffix.*hybrid"):
        get_method("magic")
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpeculativeConfig(method="magic")


@pytest.mark.parametrize("method, model", [("ngram", None), ("suffix", None), ("draft_model", "d"), ("hybrid", "d"),
                                           ("medusa", "h"), ("eagle", "h")])
def test_each_method_accepts_its_defaults_and_refuses_foreign_fields(method, model):
    assert SpeculativeConfig(method=method, model=model).method == method
    spec = get_method(method)
    for other in METHODS.values():
        for name in set(other.fields) - set(spec.fields):
            value = {"tree": [[0]], "tree_budget": 3, "draft_vocab_size": 64, "token_map": "map.npy",
                     "backend": "llama.cpp", "draft_window": 256, "catch_up": "eager",
                     "draft_confidence_threshold": 0.25}.get(name)
            if value is None:
                default = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}[name]
                value = default + 1 if not isinstance(default, float) else default / 2
            with pytest.raises(ValueError, match=f"'{name}' is not used by method '{method}'"):
                SpeculativeConfig(method=method, model=model, **{name: value})


def test_model_and_k_policy_rules_come_from_the_registry():
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="hybrid")
    with pytest.raises(ValueError, match="heads directory"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="supports k_policy 'fixed' only"):
        SpeculativeConfig(method="medusa", model="h", k_policy="auto")
    assert SpeculativeConfig(method="suffix", k_policy="auto").k_policy == "auto"
    assert SpeculativeConfig(method="hybrid", model="d", k_policy="auto").k_policy == "auto"


def test_catch_up_is_a_choice_of_the_auto_k_policy():
    """Deferred is the default (ski rental); the other mode is AutoK's choice only."""
    assert SpeculativeConfig(method="draft_model", model="d", k_policy="auto").catch_up == "deferred"
    assert SpeculativeConfig(method="draft_model", model="d").catch_up == "deferred"  # the default, unused
    config = SpeculativeConfig(method="draft_model", model="d", k_policy="auto", catch_up="eager")
    assert config.catch_up == "eager"
    with pytest.raises(ValueError, match="catch_up 'eager' is a choice of k_policy 'auto'"):
        SpeculativeConfig(method="draft_model", model="d", catch_up="eager")
    with pytest.raises(ValueError, match="catch_up must be one of 'eager', 'deferred', got 'lazy'"):
        SpeculativeConfig(method="hybrid", model="d", k_policy="auto", catch_up="lazy")


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_model_on_a_method_without_one_is_refused(method):
    """Regression: 'model' on ngram/suffix was silently ignored (a user meaning draft_model got no draft)."""
    with pytest.raises(ValueError, match="uses no model.*draft_model"):
        SpeculativeConfig(method=method, model="x")
