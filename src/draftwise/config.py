"""Validated, frozen configuration objects shared by the engine, CLI and server."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from draftwise.methods import BACKENDS, DEFAULT_CATCH_UP, DEFAULT_DRAFT_CONFIDENCE, validate_config

__all__ = ["SamplingParams", "SpeculativeConfig", "GREEDY_TEMPERATURE", "SAMPLING_RULES", "BACKENDS",
           "MAX_SPECULATIVE_TOKENS", "DEFAULT_DRAFT_CONFIDENCE", "MAX_PENALTY", "MAX_LOGIT_BIAS", "MAX_LOGPROBS"]

#: Temperatures below this are greedy decoding (as vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE = 1e-5
#: How temperature > 0 draws tokens and verifies drafts (:attr:`SamplingParams.sampling`).
SAMPLING_RULES = ("coupled", "rejection")
#: The largest ``num_speculative_tokens`` (K) accepted anywhere (config, server, ``bench --ks``).
MAX_SPECULATIVE_TOKENS = 64
#: ``presence_penalty`` and ``frequency_penalty`` lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range).
MAX_PENALTY = 2.0
#: A ``logit_bias`` value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range).
MAX_LOGIT_BIAS = 100.0
#: The most alternatives per token ``logprobs`` / ``prompt_logprobs`` may ask for (OpenAI's ``top_logprobs``
#: limit, vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into tokens.

    Attributes:
        temperature: 0 (or anything below 1e-5) means greedy (argmax); otherwise it divides the logits before
            the softmax.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it. The most likely token is always kept, so a
            tiny ``top_p`` (even one that underflows float32) is greedy sampling, never an empty distribution.
        top_k: keep only the k most likely tokens; 0 disables it.
        max_tokens: maximum number of new tokens to generate (>= 1).
        seed: seed of the request's randomness; ``None`` draws a fresh seed. With a seed, the same request
            gives the same text: on any speculative configuration under coupled sampling (the default with a
            seed), on the same configuration under rejection sampling.
        stop_token_ids: extra token ids that end generation (the model's EOS ids always do, unless
            ``ignore_eos``). The stop token itself is not part of the output.
        ignore_eos: keep generating past EOS (benchmarks use it to get fixed-length runs).
        sampling: the rule at temperature > 0 (ignored when greedy), one of :data:`SAMPLING_RULES`:
            ``"coupled"``: Gumbel-max sampling with noise keyed by (seed, position), so the same seed gives
            the same text with or without speculation, whatever the proposer, K or tree (Daliri et al. 2024,
            "Coupling without communication and drafter-invariant speculative decoding");
            ``"rejection"``: Leviathan et al. 2023 rejection sampling, whose acceptance rate with a sampled
            draft can be higher (``sum(min(p, q))``, the best any coupling reaches) but whose text for a seed
            depends on the configuration. ``None`` (default): coupled when ``seed`` is set, else rejection.
            Both emit exactly the target's distribution. See :mod:`draftwise.sampling`.
        presence_penalty: subtracted from the logit of every token that occurs in the output so far, in
            [-2, 2] (OpenAI's definition; 0 disables it). The output is the generated tokens, not the prompt.
        frequency_penalty: subtracted from a token's logit once per occurrence in the output so far, in [-2, 2]
            (OpenAI's definition; 0 disables it).
        repetition_penalty: > 0; the logit of every token in the prompt or the output so far is divided by it
            when positive and multiplied by it otherwise (CTRL, Keskar et al. 2019, as transformers and vLLM
            apply it); 1 disables it, above 1 discourages repeats.
        logit_bias: ``(token_id, bias)`` pairs (a mapping is accepted and stored as pairs sorted by id): the
            bias, in [-100, 100], is added to the token's logit at every position (OpenAI's ``logit_bias``).
            Token ids must be below the model's vocabulary size, which the engine checks.
        min_tokens: the stop tokens (``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS ids) are
            forbidden until this many tokens were generated (vLLM's ``min_tokens``), 0..``max_tokens``; where a
            grammar allows nothing but a stop token, it stays allowed (:mod:`draftwise.processors.min_tokens`).
        min_p: after temperature, tokens whose probability is below ``min_p`` times the most likely token's
            are dropped (vLLM's ``min_p``), in [0, 1]; 0 disables it. Greedy decoding ignores it.
        logprobs: None: no log-probabilities; k in 0..20: each committed token's log-probability and its k most
            likely alternatives (:mod:`draftwise.logprobs`, which defines the values), computed only when set.
        prompt_logprobs: None: none; k in 0..20: each prompt token's log-probability under the target's raw
            distribution and k alternatives (vLLM's ``prompt_logprobs``); the prompt is then prefilled whole,
            never taken from the prefix cache.

        The penalties, ``logit_bias`` and ``min_tokens`` act as the request's logits processors
        (:func:`draftwise.processors.request.request_processors`), before temperature, in vLLM's order.

    Raises:
        ValueError: on any out-of-range field.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    sampling: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.sampling is not None and self.sampling not in SAMPLING_RULES:
            raise ValueError(f"sampling must be one of {SAMPLING_RULES} (or unset), got {self.sampling!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS} (or unset), got {value}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._check_penalties()
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), "
                             f"got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: temperature 0, or below :data:`GREEDY_TEMPERATURE` (1e-5, vLLM's
        threshold), where dividing the logits would overflow to inf / nan."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def coupled(self) -> bool:
        """True when tokens are drawn by coupled (Gumbel-max) sampling: temperature > 0 and ``sampling`` is
        ``"coupled"``, or unset with a ``seed``."""
        if self.greedy:
            return False
        return self.sampling == "coupled" or (self.sampling is None and self.seed is not None)


def _logit_bias_pairs(bias: Mapping[int, float] | tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token_id, bias)`` pairs sorted by id.

    Raises:
        ValueError: (naming ``logit_bias``) a negative or repeated id, or a bias outside [-100, 100].
    """
    pairs = sorted((int(token), float(value)) for token, value in
                   (bias.items() if isinstance(bias, Mapping) else bias))
    for index, (token, value) in enumerate(pairs):
        if token < 0 or (index and pairs[index - 1][0] == token):
            raise ValueError(f"logit_bias token ids must be distinct and >= 0, got {token}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {value} for token {token}")
    return tuple(pairs)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which proposer to use and how far to speculate.

    Field names follow vLLM's ``--speculative-config``. The methods, what ``model`` names for each and which
    fields each reads are listed in :mod:`draftwise.methods`; setting a field that only other
    methods read is an error.

    Attributes:
        method: ``"draft_model"`` (a second, smaller causal LM with the same tokenizer), ``"ngram"``,
            ``"suffix"`` (SuffixDecoding), ``"medusa"`` / ``"eagle"`` (heads trained on the target by
            ``draftwise train-heads``) or ``"hybrid"`` (suffix decoding or a draft model, chosen per step).
        model: path, hub id or registry name of the draft model (``draft_model``, ``hybrid``), or the heads
            directory (``medusa``, ``eagle``).
        num_speculative_tokens: K, the maximum number of draft tokens verified per target pass (>= 1).
        prompt_lookup_min: shortest suffix n-gram to look up (``ngram`` only).
        prompt_lookup_max: longest suffix n-gram to look up (``ngram`` only).
        k_policy: ``"fixed"`` (default: always K = ``num_speculative_tokens``) or ``"auto"`` (a cost-model
            controller picks K in 0..``num_speculative_tokens`` before every step; see
            :class:`draftwise.speculation.controller.AutoK`). Not a vLLM field. Medusa and EAGLE use fixed K (the tree depth).
        tree_width: ``medusa`` / ``eagle`` / ``draft_model`` / ``hybrid``: candidates per expanded tree node
            (top-k) and, for the draft model and EAGLE, frontier nodes expanded per depth (one batched draft pass
            per depth, EAGLE-2's dynamic tree); 1 drafts a single chain of K tokens. Draft-model trees need the
            lean runtime for the draft and a target that verifies trees. Not a vLLM field.
        tree_budget: the same methods: at most this many draft nodes per step (default ``K * tree_width``).
        draft_window: ``draft_model`` / ``hybrid``: W (>= 32 tokens): the draft model reads only the first 4
            tokens (attention sinks) and the most recent W to 2W of a context longer than 2W + 4 (StreamingLLM,
            Xiao et al. 2023). A long prompt then costs the draft a prefill of W tokens instead of the whole
            prompt; the output is unchanged (the target verifies), acceptance may fall where the draft needs the
            cut part (summarization). None (default): the whole context. Not a vLLM field.
        catch_up: ``draft_model`` / ``hybrid`` with ``k_policy`` ``"auto"``: how the draft model's catch-up
            prefill of the prompt is priced: ``"deferred"`` (default, :data:`DEFAULT_CATCH_UP`) against the tokens
            generated so far (ski rental: plain decoding until the saving given up would have paid the catch-up; a
            short answer never pays it, a long one loses at most one catch-up's worth), ``"eager"`` against the
            remaining ``max_tokens`` (a long answer repays it at once; a short answer after a long prompt loses
            it). Where a per-request K controller runs (not the batched server's load-aware K). Not a vLLM field.
        draft_confidence_threshold: ``draft_model`` / ``hybrid``: a draft chain stops growing once the draft's
            probability of its whole path falls below a threshold (the token that crossed it is still proposed),
            so K is the longest chain, drawn only as deep as the draft is confident (EAGLE-2's reading of draft
            confidence; Hugging Face's ``assistant_confidence_threshold`` is a per-token form). ``"auto"``
            (default, :data:`DEFAULT_DRAFT_CONFIDENCE`): one threshold per depth from the calibrated costs,
            1.5 x the next token's cost (a draft pass and one more verify row) in one-token target passes
            (:func:`draftwise.speculation.cost_model.draft_stop_thresholds`; measured once per model and machine, cached); a
            number in [0, 1): that threshold at every depth; 0 drafts every chain K deep. Chains only: with
            ``tree_width`` > 1 the tree is sized by the verify cost, and setting a number is an error. The output
            is unchanged. Not a vLLM field.
        tree: ``medusa``: an explicit static tree as Medusa "choices", a list of top-k rank paths such as
            ``[[0], [1], [0, 0]]`` (overrides ``tree_width`` / ``tree_budget``; see
            :class:`draftwise.tree.TreeTemplate`).
        suffix_decoding_max_tree_depth: ``suffix`` / ``hybrid``: the suffix index keeps every substring of up
            to this many tokens (2..1024); a match of p tokens leaves room for at most ``depth - p`` draft
            tokens. Index updates cost O(depth) per token, its memory at most depth nodes per indexed token.
        suffix_decoding_max_spec_factor: ``suffix`` / ``hybrid``: a match of p tokens drafts at most
            ``floor(factor * p)`` tokens (and at most K): longer matches earn longer drafts (> 0).
        suffix_decoding_min_token_prob: ``suffix`` / ``hybrid``: a draft token is offered only while the
            empirical probability of its whole path (product of frequency ratios) stays >= this (0..1). This
            threshold sets the draft length per step; no fixed K is needed.
        suffix_decoding_max_cached_requests: ``suffix`` / ``hybrid``: how many earlier outputs (all scopes
            together) the cross-request index keeps, oldest evicted first; 0 uses the current request only.
        suffix_decoding_max_cached_tokens: ``suffix`` / ``hybrid``: the cross-request index holds at most this
            many tokens (all scopes together), oldest outputs evicted first. Its memory is at most
            ``suffix_decoding_max_tree_depth`` trie nodes per token (about 250 bytes each in CPython; measured
            21 nodes per token at depth 24 on code-like text with many fresh tokens, far fewer on repeated
            text), so the default 50,000 tokens stay below about 300 MB. Not a vLLM field.
        suffix_decoding_tree_width: ``suffix`` / ``hybrid``: 1 drafts one chain (the most frequent path); w > 1
            drafts a tree of up to w children per node and w * (chain length) nodes, verified in one pass
            when the target backend runs trees (a chain otherwise). Not a vLLM field.
        draft_vocab_size: ``draft_model`` / ``hybrid``: FR-Spec (Zhao et al. 2025): the draft's LM head computes
            only the logits of this many most frequent tokens (plus EOS and special tokens); the others are
            never proposed. The target's verification is unchanged, so the output is too. None (default): the
            full vocabulary. PyTorch draft backend only. See :mod:`draftwise.frspec`. Not a vLLM field.
        token_map: ``draft_model`` / ``hybrid``: a ranked token map (``.npy`` or text of ids, most frequent
            first; ``scripts/build_token_map.py``; SGLang's ``--speculative-token-map``). With
            ``draft_vocab_size`` its top ids are kept, alone all of its ids. None: a map shipped for the
            tokenizer (``data/token_maps/``), else a ranking counted over local files at load time.
        backend: ``draft_model`` / ``hybrid``: the backend of the draft model alone, one of :data:`BACKENDS`
            (``"torch"``, ``"llama.cpp"`` or ``"auto"``); None (default) loads it like the target. A draft on
            llama.cpp beside a PyTorch target (``--quantization int8``) runs llama.cpp's quantized kernels, gets
            the target's ``threads``, and ignores the PyTorch-only options (dtype, int8), which then apply to
            the target only. Its token table must agree with the target's on every target id (see
            :func:`draftwise.builder.check_same_tokenizer`). Not a vLLM field.

    Raises:
        ValueError: on an unknown method, a missing draft model or heads directory, a field the method does
            not read (``backend`` on a method without a draft model), an unknown backend, or out-of-range sizes.
    """

    method: str = "draft_model"
    model: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    k_policy: str = "fixed"
    tree_width: int = 1
    tree_budget: int | None = None
    draft_window: int | None = None
    catch_up: str = DEFAULT_CATCH_UP
    draft_confidence_threshold: float | str = DEFAULT_DRAFT_CONFIDENCE
    tree: tuple[tuple[int, ...], ...] | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_cached_tokens: int = 50_000
    suffix_decoding_tree_width: int = 1
    draft_vocab_size: int | None = None
    token_map: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        _check_field_types(self)
        if not (1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        validate_config(self)


_SCALAR_TYPES = {"int": (int,), "float": (int, float), "str": (str,)}


def _check_field_types(config) -> None:
    """Scalar fields must hold their annotated type (JSON gives floats, strings and booleans where an int
    belongs; ``True`` is not an int here), so a bad value is a clear error, not a crash deep in a proposer.

    Raises:
        ValueError: naming the field, the expected type and the value.
    """
    for spec in dataclasses.fields(config):
        names = [part.strip() for part in str(spec.type).split("|")]
        optional = "None" in names
        wanted = [name for name in names if name != "None"]
        if len(wanted) != 1 or wanted[0] not in _SCALAR_TYPES:
            continue  # containers (tree) are checked by their own parser
        value = getattr(config, spec.name)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, _SCALAR_TYPES[wanted[0]]):
            kind = {"int": "an integer", "float": "a number", "str": "a string"}[wanted[0]]
            raise ValueError(f"{spec.name} must be {kind}{' or null' if optional else ''}, got {value!r}")
