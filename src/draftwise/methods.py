"""The speculative methods draftwise knows: method name -> its proposer module, what ``model`` names and which
config fields it reads.

Adding a method means one proposer module (under :mod:`draftwise.proposers`), one :class:`MethodSpec` entry in
:data:`METHODS`, and one build function in :data:`draftwise.builder.PROPOSER_BUILDERS`.
:class:`draftwise.config.SpeculativeConfig` validates through this table (method name, ``model``, K policy,
method-specific fields), so it does not branch on method names.

A leaf module: it imports nothing of draftwise at module level (:mod:`draftwise.config` imports it), and the
``config`` the validators take is a :class:`draftwise.config.SpeculativeConfig`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["BACKENDS", "MethodSpec", "METHODS", "K_POLICIES", "method_names", "get_method", "validate_config",
           "SUFFIX_FIELDS", "DRAFT_FIELDS", "DRAFT_VOCAB_FIELDS"]

#: The K policies: ``fixed`` (always K) and ``auto`` (a cost-model controller picks K per step); the one list.
K_POLICIES = ("fixed", "auto")

#: Model backends: ``--backend`` and the draft's own ``backend`` field (see
#: :func:`draftwise.models.loading.select_backend`).
BACKENDS = ("torch", "llama.cpp", "auto")

#: A :class:`draftwise.config.SpeculativeConfig` (not imported: that module imports this one).
SpeculativeConfig = Any

#: What ``model`` names for a method.
MODEL_KINDS = ("draft", "heads")


@dataclass(frozen=True)
class MethodSpec:
    """One speculative method.

    Attributes:
        name: the ``method`` value in ``--speculative-config``.
        summary: one line for help texts.
        module: the proposer module (its build function is :data:`draftwise.builder.PROPOSER_BUILDERS` ``[name]``).
        model: what ``config.model`` names: ``"draft"`` (a draft model, required), ``"heads"`` (a heads
            directory, required) or None (not used).
        fields: the method-specific :class:`~draftwise.config.SpeculativeConfig` fields the method reads;
            setting another method's field to a non-default value is an error.
        k_policies: the K policies the method supports.
        validate: extra checks of the config (ranges of its fields); raises ``ValueError``.
    """

    name: str
    summary: str
    module: str
    model: str | None = None
    fields: tuple[str, ...] = ()
    k_policies: tuple[str, ...] = K_POLICIES
    validate: Callable[[SpeculativeConfig], None] | None = None

    def __post_init__(self) -> None:
        if self.model is not None and self.model not in MODEL_KINDS:
            raise ValueError(f"method {self.name!r}: model must be one of {MODEL_KINDS} or None, got {self.model!r}")


# ---------------------------------------------------------------------------------------------- validators
def _in_range(name: str, value, low, high) -> None:
    if not (low <= value <= high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_ngram(config: SpeculativeConfig) -> None:
    if not (1 <= config.prompt_lookup_min <= config.prompt_lookup_max):
        raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                         f"{config.prompt_lookup_min}, {config.prompt_lookup_max}")


def _check_heads(config: SpeculativeConfig) -> None:
    _check_tree_shape(config)
    if config.tree is not None:
        from draftwise.tree import TreeTemplate

        try:
            paths = TreeTemplate(tuple(tuple(p) for p in config.tree)).paths
        except TypeError as exc:
            raise ValueError(f"tree must be a list of lists of non-negative ints: {exc}") from exc
        object.__setattr__(config, "tree", paths)


def _check_draft_backend(config: SpeculativeConfig) -> None:
    """``backend`` (the draft model's own backend) must be a known backend or None."""
    if config.backend is not None and config.backend not in BACKENDS:
        raise ValueError(f"unknown speculative backend {config.backend!r}; choose one of {', '.join(BACKENDS)} "
                         "(or leave it unset to load the draft like the target)")


def _check_hybrid(config: SpeculativeConfig) -> None:
    _check_suffix(config)
    _check_draft(config)


def _check_suffix(config: SpeculativeConfig) -> None:
    _in_range("suffix_decoding_max_tree_depth", config.suffix_decoding_max_tree_depth, 2, 1024)
    _in_range("suffix_decoding_max_spec_factor", config.suffix_decoding_max_spec_factor, 1e-6, 1024.0)
    _in_range("suffix_decoding_min_token_prob", config.suffix_decoding_min_token_prob, 0.0, 1.0)
    _in_range("suffix_decoding_max_cached_requests", config.suffix_decoding_max_cached_requests, 0, 1_000_000)
    _in_range("suffix_decoding_max_cached_tokens", config.suffix_decoding_max_cached_tokens, 0, 100_000_000)
    _in_range("suffix_decoding_tree_width", config.suffix_decoding_tree_width, 1, 16)


def _check_draft_vocab(config: SpeculativeConfig) -> None:
    """FR-Spec fields: ``draft_vocab_size`` >= 1, ``token_map`` a non-empty path (the file is read when the draft
    loads)."""
    if config.draft_vocab_size is not None and config.draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1 (or null for the full vocabulary), got {config.draft_vocab_size}")
    if config.token_map is not None and not config.token_map.strip():
        raise ValueError("token_map must be a path to a ranked token map file (or null)")


def _check_tree_shape(config: SpeculativeConfig) -> None:
    _in_range("tree_width", config.tree_width, 1, 16)
    if config.tree_budget is not None:
        _in_range("tree_budget", config.tree_budget, 1, 256)


def _check_draft(config: SpeculativeConfig) -> None:
    """Fields of a method running a draft model: its own backend, FR-Spec and the draft tree's shape."""
    _check_draft_backend(config)
    _check_draft_vocab(config)
    _check_tree_shape(config)
    if config.draft_window is not None:
        _in_range("draft_window", config.draft_window, MIN_DRAFT_WINDOW, 1 << 20)
    check_draft_confidence(config.draft_confidence_threshold)
    if config.tree_width > 1 and config.draft_confidence_threshold not in (DEFAULT_DRAFT_CONFIDENCE, 0):
        raise ValueError("draft_confidence_threshold stops draft chains; with tree_width > 1 the draft tree is "
                         "sized by the verify cost instead: leave draft_confidence_threshold out or set tree_width 1")
    if config.catch_up not in CATCH_UP_MODES:
        raise ValueError(f"catch_up must be one of {', '.join(map(repr, CATCH_UP_MODES))}, got {config.catch_up!r}")
    if config.catch_up != DEFAULT_CATCH_UP and config.k_policy != "auto":
        raise ValueError(f"catch_up {config.catch_up!r} is a choice of k_policy 'auto' (AutoK decides when the draft "
                         "catches up); set k_policy 'auto'")


#: The smallest ``draft_window`` (tokens) accepted.
MIN_DRAFT_WINDOW = 32
#: ``draft_confidence_threshold``'s default (:class:`~draftwise.config.SpeculativeConfig`): ``"auto"``, thresholds
#: per chain depth from the calibrated costs (:func:`draftwise.speculation.cost_model.draft_stop_thresholds`:
#: a chain grows while its path probability is at least 1.5 x the next token's cost in target passes; how it compares with
#: constant thresholds: docs/benchmarks/draft_model.md).
DEFAULT_DRAFT_CONFIDENCE = "auto"
#: The constant threshold of a draft-model proposer built without costs (library use; ``"auto"`` where no
#: calibration can run): a chain stops once the draft's path probability falls below 0.3 (measurements:
#: docs/benchmarks/draft_model.md).
FIXED_DRAFT_CONFIDENCE = 0.3


def is_confidence_threshold(value: object) -> bool:
    """Whether ``value`` is one draft confidence threshold: a number (not a bool) in [0, 1)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 <= value < 1.0


def check_draft_confidence(threshold: float | str) -> None:
    """Raise ``ValueError`` unless the draft confidence threshold is ``"auto"`` or a number in [0, 1) (0: no early
    stop)."""
    if threshold != "auto" and not is_confidence_threshold(threshold):
        raise ValueError(f"draft_confidence_threshold must be 'auto' or a number in [0, 1) (0 drafts every chain K "
                         f"deep), got {threshold!r}")

#: The FR-Spec fields (methods running a draft model): the draft's LM head over a frequency-ranked subset.
DRAFT_VOCAB_FIELDS = ("draft_vocab_size", "token_map")

#: The draft model's own backend and its draft tree's shape (methods that run a draft model).
DRAFT_FIELDS = ("backend", "tree_width", "tree_budget", "draft_window", "catch_up", "draft_confidence_threshold")
#: How AutoK prices a draft model's catch-up (``catch_up``; draftwise.speculation.controller.AutoK): against the remaining
#: ``max_tokens`` ("eager") or the tokens generated so far ("deferred", ski rental).
CATCH_UP_MODES = ("eager", "deferred")
#: ``catch_up``'s default: "deferred" (why: docs/benchmarks/draft_model.md, eager vs deferred catch-up).
DEFAULT_CATCH_UP = "deferred"
#: The suffix-decoding fields (method ``suffix``, and ``hybrid``'s suffix side).
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
                 "suffix_decoding_max_cached_requests", "suffix_decoding_max_cached_tokens",
                 "suffix_decoding_tree_width")

METHODS: Mapping[str, MethodSpec] = MappingProxyType({spec.name: spec for spec in (
    MethodSpec("draft_model", "a smaller causal LM with the target's tokenizer", "draftwise.proposers.draft_model",
               model="draft", fields=DRAFT_FIELDS + DRAFT_VOCAB_FIELDS, validate=_check_draft),
    MethodSpec("ngram", "prompt lookup: copy what followed the latest match of the context's suffix",
               "draftwise.proposers.ngram", fields=("prompt_lookup_min", "prompt_lookup_max"), validate=_check_ngram),
    MethodSpec("suffix", "SuffixDecoding: a frequency-scored suffix index over the request and earlier outputs",
               "draftwise.proposers.suffix", fields=SUFFIX_FIELDS, validate=_check_suffix),
    MethodSpec("medusa", "Medusa heads on the target's hidden states (draftwise train-heads)",
               "draftwise.proposers.medusa", model="heads", fields=("tree_width", "tree_budget", "tree"),
               k_policies=("fixed",), validate=_check_heads),
    MethodSpec("eagle", "an EAGLE feature-level draft head on the target (draftwise train-heads)",
               "draftwise.proposers.eagle", model="heads", fields=("tree_width", "tree_budget"),
               k_policies=("fixed",), validate=_check_heads),
    MethodSpec("hybrid", "suffix decoding when its match is confident, the draft model otherwise (per step, by "
               "expected tokens per second)", "draftwise.proposers.hybrid", model="draft",
               fields=SUFFIX_FIELDS + DRAFT_FIELDS + DRAFT_VOCAB_FIELDS, validate=_check_hybrid),
)})


def method_names() -> tuple[str, ...]:
    """Every registered method name, in registry order."""
    return tuple(METHODS)


def get_method(name: str) -> MethodSpec:
    """The registered method ``name``.

    Raises:
        ValueError: no such method (the message lists the known ones).
    """
    spec = METHODS.get(name)
    if spec is None:
        raise ValueError(f"unknown speculative method {name!r}; choose one of {method_names()}")
    return spec


def validate_config(config: SpeculativeConfig) -> None:
    """Check a config against its method's entry: ``model`` present when the method needs one (and absent when
    it needs none), a supported K
    policy, no other method's field set, and the method's own field checks.

    Raises:
        ValueError: naming the offending field.
    """
    spec = get_method(config.method)
    if spec.model is not None and not config.model:
        what = "a draft model (speculative model path or name)" if spec.model == "draft" else \
            "its heads directory as 'model' (draftwise train-heads)"
        raise ValueError(f"method {spec.name!r} needs {what}")
    if spec.model is None and config.model:
        users = ", ".join(m.name for m in METHODS.values() if m.model is not None)
        raise ValueError(f"method {spec.name!r} uses no model, but 'model' is {config.model!r} (a model is for "
                         f"{users}; for a draft model use method 'draft_model')")
    if config.k_policy not in K_POLICIES:
        raise ValueError(f"unknown k_policy {config.k_policy!r}; choose one of {K_POLICIES}")
    if config.k_policy not in spec.k_policies:
        raise ValueError(f"method {spec.name!r} supports k_policy {' or '.join(map(repr, spec.k_policies))} only")
    _reject_foreign_fields(config, spec)
    if spec.validate is not None:
        spec.validate(config)


def _reject_foreign_fields(config: SpeculativeConfig, spec: MethodSpec) -> None:
    """A field that only other methods read, set to a non-default value, is a mistake the user should hear of."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for other in METHODS.values():
        for name in other.fields:
            if name in spec.fields or getattr(config, name) == defaults[name]:
                continue
            users = [m.name for m in METHODS.values() if name in m.fields]
            raise ValueError(f"{name!r} is not used by method {spec.name!r} (it is for {', '.join(users)})")
