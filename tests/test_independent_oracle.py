"""Greedy exactness against oracles that share no code with the engine (issue 22).

The other exactness tests compare speculative decoding with the same engine loop run without a proposer, so
a bug in the code both sides share (the first token after the prefill, the bonus token, stop handling,
``commit_tokens``, ``compact``/``rollback``, prefix reuse) hits the oracle too. The oracles here never touch
:mod:`draftwise.engine`, :mod:`draftwise.engine.core`, a backend adapter's cache or the samplers:

- oracle A, *full recompute*: for every new token, the model runs over the whole sequence from an empty
  cache and the argmax of the last row is taken. A transformers model is called directly
  (``model(input_ids=..., use_cache=False)``); the lean runtime through ``LeanLlama.forward_rows`` with the
  slot's length reset to 0 before and after, on its own model instance;
- oracle B, transformers' own ``model.generate(do_sample=False, ...)`` on the fp32 transformers models.

Stops mirror :class:`draftwise.config.SamplingParams`: a stop token (``stop_token_ids``, and the EOS ids
unless ``ignore_eos``) ends generation and is not part of the output; ``max_tokens`` and the context length
end it with ``"length"``. stories260K never picks its EOS (id 2) greedily (its EOS logit ranks 260th or lower
over 300 tokens of several prompts), so the stop cases name a token the model does emit as EOS or as a stop
token id; the tiny random Llamas stop on their configured EOS (id 1) whenever they emit it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from conftest import tiny_llama
from draftwise.backends.base import CausalLM
from draftwise.backends.lean import LeanCausalLM, build_lean
from draftwise.backends.lean.rows import chain_rows
from draftwise.backends.quantization import int8_kernels_available
from draftwise.backends.torch_backend import TorchCausalLM
from draftwise.engine import EngineCore
from draftwise.proposers.base import PerSequenceProposers
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import LoadedModel, derive_layer_draft, load_model
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer
from draftwise.proposers.suffix import SuffixProposer

MODE = "int8" if int8_kernels_available() else "none"
KS = (1, 2, 4, 8)
NEW_TOKENS = 32
SLOTS = 4

STORY_TEXTS = {
    "once": "Once upon a time",
    "lily": "Lily and Ben went to the park. They saw",
    "repeat": "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom had a",
}
MORE_STORY_TEXTS = ["The little dog", "One day, Tom", "The sun was shining and the birds"]
STORY_EXTENSION = " Then Tom said"  # appended (without BOS) after a turn's prompt and output

TINY_PROMPTS = {
    "once": [3, 17, 42, 5, 9, 60],
    "lily": [88, 4, 31, 31, 70, 12, 6, 54, 23],
    "repeat": [7, 21, 33, 8, 50] * 4,
}
TINY_EXTENSION = [11, 12, 13]


# ---------------------------------------------------------------------------------------------- the oracles
def stop_ids(params: SamplingParams, eos_ids) -> frozenset[int]:
    """The tokens that end a request (SamplingParams: stop_token_ids, plus the EOS ids unless ignore_eos)."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def decode_loop(next_token: Callable[[list[int]], int], prompt: list[int], params: SamplingParams, eos_ids,
                max_context: int) -> tuple[list[int], str]:
    """Plain greedy decoding written from the SamplingParams contract alone: (output, finish reason)."""
    stops = stop_ids(params, eos_ids)
    sequence, output = list(prompt), []
    while True:
        token = next_token(sequence)
        if token in stops:
            return output, "stop"  # the stop token is not part of the output
        output.append(token)
        sequence.append(token)
        if len(output) >= params.max_tokens or len(sequence) >= max_context:
            return output, "length"


def hf_full_recompute(hf_model) -> Callable[[list[int]], int]:
    """Oracle A on a transformers model: the whole sequence from an empty cache, argmax of the last row."""

    def next_token(sequence: list[int]) -> int:
        with torch.inference_mode():
            logits = hf_model(input_ids=torch.tensor([sequence]), use_cache=False).logits
        return int(logits[0, -1].argmax())

    return next_token


def lean_full_recompute(lean_model) -> Callable[[list[int]], int]:
    """Oracle A on the lean runtime: one ``forward_rows`` pass over the whole sequence into slot 0 of a model
    instance of its own, its length set to 0 before and after (nothing is ever reused)."""

    def next_token(sequence: list[int]) -> int:
        lean_model.cache.lengths[0] = 0
        logits, _ = lean_model.forward_rows(chain_rows(sequence, 0, 0), logit_rows=torch.tensor([len(sequence) - 1]))
        lean_model.cache.lengths[0] = 0
        return int(logits[0].argmax())

    return next_token


def hf_generate(hf_model, prompt: list[int], params: SamplingParams, eos_ids, pad_id: int) -> tuple[list[int], str]:
    """Oracle B: transformers' greedy ``generate``. Its EOS list is the request's stop set (``eos_token_id=None``
    keeps it from stopping at all, for ignore_eos); a stop token it emits last is dropped, as SamplingParams
    says."""
    stops = sorted(stop_ids(params, eos_ids))
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=params.max_tokens,
                                eos_token_id=stops or None, pad_token_id=pad_id)
    new = out[0, len(prompt):].tolist()
    if new and new[-1] in stops:
        return new[:-1], "stop"
    return new, "length"


def first_new_token_at(tokens: list[int], start: int) -> int:
    """The first index >= start whose token does not occur earlier (a stop there cuts the output there)."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no new token after {start} in {tokens}")


@dataclass
class Setup:
    """A target for the engines, the independent oracles of its model, its drafts and prompts."""

    name: str
    target: CausalLM
    eos: tuple[int, ...]
    next_token: Callable[[list[int]], int]  # oracle A
    prompts: dict[str, list[int]]
    extension: list[int]
    drafts: dict[str, CausalLM]
    cold_labels: tuple[str, ...] = ("once", "lily")  # prompts run without a prefix cache
    hf: object = None  # the fp32 transformers model, for oracle B (None: lean)
    pad_id: int = 0
    memo: dict = field(default_factory=dict)

    def oracle(self, prompt, params: SamplingParams, eos=None) -> tuple[list[int], str]:
        eos = self.eos if eos is None else tuple(eos)
        key = ("A", tuple(prompt), params.max_tokens, stop_ids(params, eos))
        if key not in self.memo:
            self.memo[key] = decode_loop(self.next_token, list(prompt), params, eos, self.target.max_context)
        return self.memo[key]

    def oracle_b(self, prompt, params: SamplingParams, eos=None) -> tuple[list[int], str] | None:
        if self.hf is None:
            return None
        eos = self.eos if eos is None else tuple(eos)
        key = ("B", tuple(prompt), params.max_tokens, stop_ids(params, eos))
        if key not in self.memo:
            self.memo[key] = hf_generate(self.hf, list(prompt), params, eos, self.pad_id)
        return self.memo[key]

    def check(self, result, prompt, params: SamplingParams, what: str, eos=None) -> None:
        """The engine's result equals oracle A (and B where there is one), tokens and finish reason."""
        tokens, reason = self.oracle(prompt, params, eos)
        assert (result.token_ids, result.finish_reason) == (tokens, reason), f"{self.name} {what}: oracle A"
        b = self.oracle_b(prompt, params, eos)
        if b is not None:
            assert (result.token_ids, result.finish_reason) == b, f"{self.name} {what}: oracle B (transformers)"


def _lean_stories(stories_path, num_slots: int = 1) -> LoadedModel:
    return load_model(str(stories_path), quantization=MODE, runtime="lean", num_slots=num_slots)


def _stories_hf(request) -> Setup:
    stories = request.getfixturevalue("stories")
    hf = stories.backend.model
    assert isinstance(stories.backend, TorchCausalLM)
    self_draft = TorchCausalLM(copy.deepcopy(hf), name="stories-self")
    return Setup(
        name="stories-hf", target=stories.backend, eos=tuple(stories.eos_token_ids),
        next_token=hf_full_recompute(hf), prompts={k: stories.encode(t) for k, t in STORY_TEXTS.items()},
        extension=stories.encode(STORY_EXTENSION)[1:],
        drafts={"derived": request.getfixturevalue("stories_draft").backend,
                "random": tiny_llama(seed=5, vocab=512), "self": self_draft},
        hf=hf, pad_id=int(stories.eos_token_ids[0]),
    )


def _stories_lean(request) -> Setup:
    path = request.getfixturevalue("stories_path")
    request.getfixturevalue("draftwise_home")
    target = _lean_stories(path)
    oracle_model = _lean_stories(path).backend.model  # an instance of its own: no shared cache
    assert isinstance(target.backend, LeanCausalLM)
    return Setup(
        name="stories-lean", target=target.backend, eos=tuple(target.eos_token_ids),
        next_token=lean_full_recompute(oracle_model), prompts={k: target.encode(t) for k, t in STORY_TEXTS.items()},
        extension=target.encode(STORY_EXTENSION)[1:],
        drafts={"derived": derive_layer_draft(target, 2).backend, "random": tiny_llama(seed=5, vocab=512),
                "self": _lean_stories(path).backend},
    )


def _tiny_hf(request) -> Setup:
    target = tiny_llama(seed=0)
    return Setup(
        name="tiny-hf", target=target, eos=(1,), next_token=hf_full_recompute(target.model),
        prompts=dict(TINY_PROMPTS), extension=list(TINY_EXTENSION),
        drafts={"derived": derive_layer_draft(LoadedModel(backend=target, tokenizer=None, name="tiny"), 1).backend,
                "random": tiny_llama(seed=1), "self": tiny_llama(seed=0)},
        cold_labels=("once",), hf=target.model, pad_id=0,
    )


def _tiny_lean(request) -> Setup:
    target = build_lean(tiny_llama(seed=0).model, quantization=MODE, name="tiny-lean")
    oracle_model = build_lean(tiny_llama(seed=0).model, quantization=MODE, name="tiny-lean-oracle").model
    return Setup(
        name="tiny-lean", target=target, eos=(1,), next_token=lean_full_recompute(oracle_model),
        prompts=dict(TINY_PROMPTS), extension=list(TINY_EXTENSION),
        drafts={"derived": derive_layer_draft(LoadedModel(backend=target, tokenizer=None, name="tiny"), 1).backend,
                "random": tiny_llama(seed=1),
                "self": build_lean(tiny_llama(seed=0).model, quantization=MODE, name="tiny-lean-self")},
        cold_labels=("once",),
    )


BUILDERS = {"stories-hf": _stories_hf, "stories-lean": _stories_lean, "tiny-hf": _tiny_hf, "tiny-lean": _tiny_lean}
SETUPS = tuple(BUILDERS)


@pytest.fixture(scope="module")
def setups():
    """``setups(name, request)``: the named :class:`Setup`, built once per module."""
    built: dict[str, Setup] = {}

    def get(name: str, request) -> Setup:
        if name not in built:
            built[name] = BUILDERS[name](request)
        return built[name]

    return get


METHODS = ("draft-self", "draft-derived", "draft-random", "ngram", "suffix", "suffix-tree")


def make_proposer(setup: Setup, method: str):
    if method.startswith("draft-"):
        # the self-draft drafts every chain K deep (its tests count full drafts); the others stop where unsure
        kind = method.split("-", 1)[1]
        return DraftModelProposer(setup.drafts[kind], setup.target.vocab_size,
                                  **({"confidence_threshold": 0.0} if kind == "self" else {}))
    if method == "ngram":
        return NgramProposer(1, 3)
    if method == "suffix":
        return SuffixProposer()
    if method == "suffix-tree":
        assert setup.target.supports_tree
        return SuffixProposer(tree_width=3)
    raise AssertionError(method)


# ---------------------------------------------------------------------------------------------- the oracles agree
@pytest.mark.parametrize("setup_name", ["stories-hf", "tiny-hf"])
def test_full_recompute_equals_transformers_generate(setups, request, setup_name):
    """Oracle A and oracle B agree (so neither is vacuous), including a stop token they both emit."""
    setup = setups(setup_name, request)
    for label, prompt in setup.prompts.items():
        for params in (SamplingParams(max_tokens=NEW_TOKENS), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)):
            a = setup.oracle(prompt, params)
            assert a == setup.oracle_b(prompt, params), label
            assert len(a[0]) == NEW_TOKENS or a[1] == "stop"
        full = setup.oracle(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
        stop = full[len(full) // 2]
        params = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=(stop,))
        a = setup.oracle(prompt, params)
        assert a == setup.oracle_b(prompt, params) and a == (full[:full.index(stop)], "stop"), label


# ---------------------------------------------------------------------------------------------- the single engine
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("setup_name", SETUPS)
def test_single_engine_matches_the_oracles(setups, request, setup_name, method, k):
    """Every proposer, K in 1..8, EOS not ignored: prompts without a prefix cache; then, on an engine with a
    prefix cache, the repetitive prompt cold, the same prompt again (a full hit) and a prompt extending the
    previous prompt and output (a hit of all of it but the last output token)."""
    setup = setups(setup_name, request)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    results = []
    plain = SpeculativeEngine(setup.target, make_proposer(setup, method), k, eos_token_ids=setup.eos)
    for label in setup.cold_labels:
        prompt = setup.prompts[label]
        results.append(plain.generate(prompt, params))
        setup.check(results[-1], prompt, params, f"{method} k={k} {label} (no prefix cache)")

    warm = SpeculativeEngine(setup.target, make_proposer(setup, method), k, eos_token_ids=setup.eos,
                             prefix_cache=PrefixCache(1 << 30))
    prompt = setup.prompts["repeat"]
    cold = warm.generate(prompt, params)
    setup.check(cold, prompt, params, f"{method} k={k} repeat (cold prefix cache)")
    assert cold.stats.num_cached_prompt_tokens == 0
    again = warm.generate(prompt, params)
    setup.check(again, prompt, params, f"{method} k={k} repeat (warm, same prompt)")
    assert again.stats.num_cached_prompt_tokens == len(prompt) - 1
    extended = prompt + again.token_ids + setup.extension
    turn = warm.generate(extended, params)
    setup.check(turn, extended, params, f"{method} k={k} repeat (warm, extended prompt)")
    if again.finish_reason == "length":  # the cache holds prompt + output but the last output token
        assert turn.stats.num_cached_prompt_tokens == len(prompt) + len(again.token_ids) - 1
    results += [cold, again, turn]

    assert sum(r.stats.num_draft_tokens for r in results) > 0, "no speculation ran"
    if method == "suffix-tree":
        assert sum(r.stats.num_tree_nodes for r in results) > 0, "no draft tree was verified"
    if method == "draft-self":
        assert sum(r.stats.num_accepted_tokens for r in results) > 0
        if isinstance(setup.target, LeanCausalLM):  # row-invariant: the target drafting for itself never misses
            assert all(r.stats.num_accepted_tokens == r.stats.num_draft_tokens for r in results)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("setup_name", SETUPS)
def test_prefix_cache_partial_hits_and_stopped_sequences(setups, request, setup_name, method):
    """K = 4 on a prefix cache: a prompt that is a strict prefix of a kept sequence (a partial import), a
    request ended by a stop token, and a prompt extending that request's prompt and output."""
    setup = setups(setup_name, request)
    engine = SpeculativeEngine(setup.target, make_proposer(setup, method), 4, eos_token_ids=setup.eos,
                               prefix_cache=PrefixCache(1 << 30))
    params = SamplingParams(max_tokens=NEW_TOKENS)
    prompt = setup.prompts["repeat"]
    first = engine.generate(prompt + setup.extension, params)
    setup.check(first, prompt + setup.extension, params, f"{method} long prompt (cold)")
    half = prompt[: len(prompt) // 2 + 1]
    partial = engine.generate(half, params)
    setup.check(partial, half, params, f"{method} a prefix of the kept sequence")
    assert partial.stats.num_cached_prompt_tokens == len(half) - 1
    full = setup.oracle(prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    stopping = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=(full[first_new_token_at(full, 6)],))
    stopped = engine.generate(prompt, stopping)
    setup.check(stopped, prompt, stopping, f"{method} stopped")
    assert stopped.finish_reason == "stop"
    extended = prompt + stopped.token_ids + setup.extension
    turn = engine.generate(extended, params)
    setup.check(turn, extended, params, f"{method} extending the stopped request")
    assert turn.stats.num_cached_prompt_tokens >= len(prompt)
    assert sum(r.stats.num_draft_tokens for r in (first, partial, stopped, turn)) > 0


# ---------------------------------------------------------------------------------------------- stops
@pytest.mark.parametrize("method", ["draft-self", "ngram", "suffix-tree"])
@pytest.mark.parametrize("setup_name", SETUPS)
def test_stops_inside_accepted_drafts(setups, request, setup_name, method):
    """K = 8 on the repetitive prompt: a stop (as an EOS id of the engine, as a request's stop token id, at
    the first token and mid-way), the same EOS ignored, and max_tokens 1, 2, 3, 5 (shorter than K + 1)."""
    setup = setups(setup_name, request)
    prompt = setup.prompts["repeat"]
    k = 8
    free = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    full, _ = setup.oracle(prompt, free)
    stop = full[first_new_token_at(full, 6)]

    def run(params, eos):
        engine = SpeculativeEngine(setup.target, make_proposer(setup, method), k, eos_token_ids=eos)
        return engine.generate(prompt, params)

    # the engine's EOS ids: the stop token mid-way, and the very first token
    for eos in ((stop,), (full[0],)):
        params = SamplingParams(max_tokens=NEW_TOKENS)
        result = run(params, eos)
        setup.check(result, prompt, params, f"{method} eos={eos}", eos=eos)
        assert result.finish_reason == "stop" and result.token_ids == full[:full.index(eos[0])]
        if method == "draft-self" and eos == (stop,):
            stats = result.stats
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # the target drafting for itself
            # the last step's stop came inside the accepted drafts: drafted = committed + the stop token
            assert stats.k_history[-1] == stats.step_tokens[-1] + 1, (stats.k_history, stats.step_tokens)
    # a request's stop token id, the model's EOS kept
    params = SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=(stop,))
    result = run(params, setup.eos)
    setup.check(result, prompt, params, f"{method} stop_token_ids")
    assert result.finish_reason == "stop"
    # the same token as EOS, ignored
    result = run(free, (stop,))
    setup.check(result, prompt, free, f"{method} ignore_eos", eos=(stop,))
    assert result.token_ids == full and stop in result.token_ids
    # max_tokens below K + 1: the draft is clamped and the output cut exactly there
    for max_tokens in (1, 2, 3, 5):
        params = SamplingParams(max_tokens=max_tokens)
        result = run(params, setup.eos)
        setup.check(result, prompt, params, f"{method} max_tokens={max_tokens}")
        assert result.token_ids == full[:max_tokens] and result.finish_reason == "length"
        assert result.stats.num_generated_tokens == max_tokens
        if max_tokens == 5 and method == "draft-self":
            assert result.stats.num_draft_tokens > 0  # drafts of at most 4 (K = 8 clamped), one bonus token


@pytest.mark.parametrize("method", ["draft-self", "ngram", "suffix-tree"])
@pytest.mark.parametrize("lean", [False, True], ids=["hf", "lean"])
def test_context_length_ends_generation(method, lean):
    """A 40-token context: the 20-token prompt gets exactly 20 new tokens ("length"), K = 8."""
    context = 40

    def model():
        torch_model = tiny_llama(seed=0, max_context=context)
        return build_lean(torch_model.model, quantization=MODE, max_context=context) if lean else torch_model

    target = model()
    next_token = lean_full_recompute(model().model) if lean else hf_full_recompute(target.model)
    prompt = TINY_PROMPTS["repeat"]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    expected = decode_loop(next_token, prompt, params, (1,), context)
    assert len(expected[0]) == context - len(prompt) and expected[1] == "length"
    proposer = {"draft-self": lambda: DraftModelProposer(model(), target.vocab_size, confidence_threshold=0.0),
                "ngram": lambda: NgramProposer(1, 3),
                "suffix-tree": lambda: SuffixProposer(tree_width=3)}[method]()
    result = SpeculativeEngine(target, proposer, 8).generate(prompt, params)
    assert (result.token_ids, result.finish_reason) == expected
    assert result.stats.num_draft_tokens > 0


# ---------------------------------------------------------------------------------------------- the batched engine
@pytest.fixture(scope="module")
def batched(setups, request):
    """The 4-slot lean stories260K target, its lean drafts (4 slots each) and the single-slot oracle setup."""
    setup = setups("stories-lean", request)
    path = request.getfixturevalue("stories_path")
    target = _lean_stories(path, num_slots=SLOTS)
    hf_draft = derive_layer_draft(request.getfixturevalue("stories"), 2).backend.model
    drafts = {
        "derived": build_lean(hf_draft, quantization=MODE, num_slots=SLOTS, name="derived"),
        "random": build_lean(tiny_llama(seed=5, vocab=512).model, quantization=MODE, num_slots=SLOTS, name="random"),
        "self": _lean_stories(path, num_slots=SLOTS).backend,
    }
    return setup, target, drafts


def batch_proposer(method: str, drafts, vocab: int):
    if method == "ngram":
        return PerSequenceProposers(lambda: NgramProposer(1, 3), "ngram")
    if method == "suffix":
        return PerSequenceProposers(SuffixProposer, "suffix")
    return DraftModelProposer(drafts[method.split("-", 1)[1]], vocab, slot_per_sequence=True)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft-derived", "draft-random", "draft-self"])
def test_batched_engine_matches_the_full_recompute(batched, method, k):
    """Six requests through 4 slots (two wait for a slot): EOS kept, a stop token id, max_tokens 5, ignore_eos;
    then, on the engine's warm prefix cache, the first three prompts extended by their outputs."""
    setup, target, drafts = batched
    prompts = [setup.prompts[label] for label in ("once", "lily", "repeat")]
    prompts += [target.encode(text) for text in MORE_STORY_TEXTS]
    full = setup.oracle(prompts[4], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    stop = full[first_new_token_at(full, 5)]
    params = [SamplingParams(max_tokens=NEW_TOKENS)] * 3 + [
        SamplingParams(max_tokens=5), SamplingParams(max_tokens=NEW_TOKENS, stop_token_ids=(stop,)),
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)]
    engine = EngineCore(target.backend, batch_proposer(method, drafts, target.backend.vocab_size), k,
                           eos_token_ids=target.eos_token_ids, prefix_cache=PrefixCache(1 << 30))
    results = engine.generate(prompts, params)
    for i, (prompt, p, result) in enumerate(zip(prompts, params, results)):
        setup.check(result, prompt, p, f"batched {method} k={k} request {i}")
    assert results[4].finish_reason == "stop" and len(results[3].token_ids) == 5
    # a second round on the warm prefix cache: each of the first three prompts extended by its output
    follow_ups = [prompt + result.token_ids + setup.extension for prompt, result in zip(prompts[:3], results[:3])]
    again = engine.generate(follow_ups, SamplingParams(max_tokens=NEW_TOKENS))
    for i, (prompt, result) in enumerate(zip(follow_ups, again)):
        setup.check(result, prompt, SamplingParams(max_tokens=NEW_TOKENS), f"batched {method} k={k} follow-up {i}")
        assert result.stats.num_cached_prompt_tokens > 0
    assert sum(r.stats.num_draft_tokens for r in results + again) > 0, "no speculation ran"
    assert engine.num_running == 0 and engine.num_free_slots == SLOTS


@pytest.mark.parametrize("method", ["ngram", "draft-self"])
def test_batched_engine_context_length_and_first_token_stops(method):
    """The tiny Llama with a 40-token context, 4 slots, K = 8: prompts of 6 to 38 tokens run into the context
    length, a stop token as the first new token, max_tokens 1; twice (the second time on a warm prefix cache)."""
    context = 40

    def lean(slots: int):
        return build_lean(tiny_llama(seed=0, max_context=context).model, quantization=MODE, max_context=context,
                          num_slots=slots)

    target, next_token = lean(SLOTS), lean_full_recompute(lean(1).model)
    proposer = (PerSequenceProposers(lambda: NgramProposer(1, 3), "ngram") if method == "ngram"
                else DraftModelProposer(lean(SLOTS), target.vocab_size, slot_per_sequence=True))
    engine = EngineCore(target, proposer, 8, eos_token_ids=(1,), prefix_cache=PrefixCache(1 << 30))
    prompts = [TINY_PROMPTS["repeat"], TINY_PROMPTS["once"], TINY_PROMPTS["lily"], [5] * 30, list(range(2, 40))]
    free = SamplingParams(max_tokens=100, ignore_eos=True)
    first_token = decode_loop(next_token, prompts[1], SamplingParams(max_tokens=1), (1,), context)[0][0]
    params = [free, SamplingParams(max_tokens=100, stop_token_ids=(first_token,)), SamplingParams(max_tokens=1),
              free, free]
    for round_ in ("cold", "warm"):
        results = engine.generate(prompts, params)
        for i, (prompt, p, result) in enumerate(zip(prompts, params, results)):
            expected = decode_loop(next_token, prompt, p, (1,), context)
            assert (result.token_ids, result.finish_reason) == expected, (round_, i)
        assert results[1].token_ids == [] and results[1].finish_reason == "stop"
        assert len(results[0].token_ids) == context - len(prompts[0]) and results[0].finish_reason == "length"
        assert sum(r.stats.num_draft_tokens for r in results) > 0
