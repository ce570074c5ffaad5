"""A llama.cpp draft model for a PyTorch target (issue 14): the speculative config's own ``backend`` field and
``--speculative-backend``, the token-table rule across backends, vocabulary widths, greedy exactness for fp32 and
int8 targets, the hybrid method, and prefix reuse when the draft cannot export its cache.

The first part needs no llama.cpp (configuration, CLI, the draft's load options and the table rule on fake
models); the rest runs stories260K on both backends and is gated by :mod:`llama_cpp_gate` like the other
llama.cpp tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM
from draftwise.builder import (
    TokenizerMismatchError,
    build_engine,
    build_proposer,
    check_same_tokenizer,
    draft_load_options,
)
from draftwise.cli import build_parser, main
from draftwise.commands.common import CliError, speculative_config_from_args
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import LoadedModel, load_model
from draftwise.proposers.draft_model import fit_vocab
from draftwise.builder import BuildOptions
from conftest import tiny_llama
from gguf_variants import write_gguf_variant
from llama_cpp_gate import needs_llama_cpp

logger = logging.getLogger(__name__)

PROMPTS = ["Once upon a time", "Lily and Ben went to the park. They saw", "Tom had a red ball. He"]
GREEDY = SamplingParams(max_tokens=40)


# ============================================================================ configuration (no llama.cpp)
@pytest.mark.parametrize("method", ["draft_model", "hybrid"])
@pytest.mark.parametrize("backend", ["torch", "llama.cpp", "auto"])
def test_draft_methods_take_a_backend(method, backend):
    config = SpeculativeConfig(method=method, model="d.gguf", backend=backend)
    assert config.backend == backend
    assert SpeculativeConfig(method=method, model="d.gguf").backend is None  # default: the target's


@pytest.mark.parametrize("method, model", [("ngram", None), ("suffix", None), ("medusa", "heads"), ("eagle", "heads")])
def test_backend_on_a_method_without_a_draft_model_is_an_error(method, model):
    with pytest.raises(ValueError, match=f"'backend' is not used by method '{method}' .*draft_model, hybrid"):
        SpeculativeConfig(method=method, model=model, backend="llama.cpp")


@pytest.mark.parametrize("value, message", [("onnx", "unknown speculative backend 'onnx'; choose one of torch, "
                                                      "llama.cpp, auto"),
                                            ("", "unknown speculative backend ''"),
                                            (1, "backend must be a string or null, got 1")])
def test_unknown_or_mistyped_backend_is_an_error(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(method="draft_model", model="d.gguf", backend=value)


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["bench"], ["check", "t", "d"], ["costs", "m"]])
def test_every_model_command_has_the_flag(command):
    args = _parse(*command, "--speculative-backend", "llama.cpp")
    assert args.speculative_backend == "llama.cpp"
    assert _parse(*command).speculative_backend is None
    with pytest.raises(SystemExit):
        _parse(*command, "--speculative-backend", "onnx")


def test_flag_sets_the_config_field_and_wins_over_json():
    args = _parse("generate", "--speculative-model", "d.gguf", "--speculative-backend", "llama.cpp", "hi")
    assert speculative_config_from_args(args) == SpeculativeConfig(model="d.gguf", backend="llama.cpp")
    args = _parse("generate", "--speculative-config", '{"method": "hybrid", "model": "d.gguf", "backend": "torch"}',
                  "--speculative-backend", "auto", "hi")
    config = speculative_config_from_args(args)
    assert (config.method, config.backend) == ("hybrid", "auto")


@pytest.mark.parametrize("argv, message", [
    (["--speculative-backend", "llama.cpp"], "name a draft with --speculative-model"),
    (["--speculative-model", "none", "--speculative-backend", "torch"], "name a draft with --speculative-model"),
    (["--speculative-config", '{"method": "ngram"}', "--speculative-backend", "llama.cpp"],
     "'backend' is not used by method 'ngram'"),
    (["--speculative-config", '{"model": "d.gguf", "backend": "vllm"}'], "unknown speculative backend 'vllm'"),
])
def test_cli_errors_are_one_line_and_come_before_loading(argv, message, capsys):
    with pytest.raises(CliError, match=message):
        speculative_config_from_args(_parse("generate", *argv, "hi"))
    assert main(["generate", "--model", "/nonexistent/t.gguf", *argv, "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "not found" not in err


# ------------------------------------------------------------------ which backend the draft is loaded on
TARGET_OPTIONS = BuildOptions(device="cpu", dtype="fp32", quantization="int8", backend="torch", threads=3)


def _with_llama_cpp(monkeypatch, available: bool = True) -> None:
    import draftwise.backends.llama_cpp_backend as module

    monkeypatch.setattr(module, "llama_cpp_available", lambda: available)


def test_without_a_draft_backend_the_draft_is_loaded_like_the_target():
    config = SpeculativeConfig(model="d.gguf")
    assert draft_load_options(config, TARGET_OPTIONS) == dict(device="cpu", dtype="fp32", quantization="int8",
                                                              backend="torch", threads=3, runtime="auto",
                                                              drafting=True)


@pytest.mark.parametrize("backend", ["llama.cpp", "auto"])
def test_llama_cpp_draft_gets_the_threads_and_none_of_the_torch_options(monkeypatch, backend):
    _with_llama_cpp(monkeypatch)
    config = SpeculativeConfig(model="/models/d.gguf", backend=backend)
    assert draft_load_options(config, TARGET_OPTIONS) == dict(backend="llama.cpp", threads=3, drafting=True)


def test_torch_draft_gets_the_targets_torch_options(monkeypatch):
    _with_llama_cpp(monkeypatch)
    options = BuildOptions(device="cpu", quantization="int8", backend="llama.cpp", threads=2)
    config = SpeculativeConfig(model="/models/d.gguf", backend="torch")
    assert draft_load_options(config, options) == dict(device="cpu", dtype=None, quantization="int8",
                                                       backend="torch", threads=2, runtime="auto",
                                                       drafting=True)


def test_auto_picks_torch_for_a_non_gguf_draft_or_without_llama_cpp(monkeypatch):
    _with_llama_cpp(monkeypatch)
    assert draft_load_options(SpeculativeConfig(model="/models/hf-dir", backend="auto"), TARGET_OPTIONS)["backend"] \
        == "torch"
    _with_llama_cpp(monkeypatch, available=False)
    assert draft_load_options(SpeculativeConfig(model="/models/d.gguf", backend="auto"), TARGET_OPTIONS)["backend"] \
        == "torch"


def test_gpu_target_keeps_its_draft_off_llama_cpp(monkeypatch):
    _with_llama_cpp(monkeypatch)
    with pytest.raises(ValueError, match="a llama.cpp draft runs on the CPU; the target runs on 'cuda'"):
        draft_load_options(SpeculativeConfig(model="/models/d.gguf", backend="llama.cpp"), TARGET_OPTIONS,
                           target_device="cuda")
    options = draft_load_options(SpeculativeConfig(model="/models/d.gguf", backend="auto"), TARGET_OPTIONS,
                                 target_device="cuda")
    assert options["backend"] == "torch"


def test_llama_cpp_draft_needs_a_gguf_file(monkeypatch):
    from draftwise.models.loading import ModelLoadError

    _with_llama_cpp(monkeypatch)
    with pytest.raises(ModelLoadError, match="needs a .gguf file"):
        draft_load_options(SpeculativeConfig(model="/models/hf-dir", backend="llama.cpp"), TARGET_OPTIONS)


# ------------------------------------------------------------------ the token-table rule across backends
class TableTokenizer:
    """The tokenizer surface :func:`tokenizer_info_from_hf` reads, over a fixed table."""

    def __init__(self, tokens):
        self.tokens = list(tokens)
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.chat_template = 0, 1, None, None

    def __len__(self) -> int:
        return len(self.tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tokens[i] for i in ids]


TABLE = [f"tok{i}" for i in range(96)]


def _torch_model(tokens) -> LoadedModel:
    return LoadedModel(backend=tiny_llama(seed=0), tokenizer=TableTokenizer(tokens), name="torch-target")


def _other_backend_model(tokens, width: int = 96) -> LoadedModel:
    backend = SimpleNamespace(vocab_size=width, name="llama-draft")  # not a TorchCausalLM: "llama.cpp"
    return LoadedModel(backend=backend, tokenizer=TableTokenizer(tokens), name="llama-draft")


def test_identical_tables_pass_across_backends():
    check_same_tokenizer(_torch_model(TABLE), _other_backend_model(TABLE))


def test_draft_with_extra_tokens_passes_across_backends():
    """The draft holds every target id, with the target's token, and 8 more (its logits are cut)."""
    check_same_tokenizer(_torch_model(TABLE), _other_backend_model(TABLE + [f"x{i}" for i in range(8)], width=104))


def test_draft_lacking_target_ids_is_refused_across_backends_naming_them():
    target = _torch_model(TABLE)
    with pytest.raises(TokenizerMismatchError, match=r"lacks 6 of the 96 token ids .*ids 90\.\.95 \(first 'tok90'\)"):
        check_same_tokenizer(target, _other_backend_model(TABLE[:90]))
    check_same_tokenizer(target, LoadedModel(backend=tiny_llama(seed=1), tokenizer=TableTokenizer(TABLE[:90]),
                                             name="same-backend"))  # one backend: a warning, as before


def test_differing_token_is_refused_naming_the_first_differing_ids():
    swapped = list(TABLE)
    swapped[40], swapped[41] = swapped[41], swapped[40]
    with pytest.raises(TokenizerMismatchError, match="2 of 96 shared ids differ; first: id 40: target 'tok40' vs "
                                                     "draft 'tok41', id 41: target 'tok41' vs draft 'tok40'"):
        check_same_tokenizer(_torch_model(TABLE), _other_backend_model(swapped))


# ============================================================================ stories260K on both backends
@pytest.fixture(scope="module")
def int8_stories(draftwise_home, stories_path):
    from draftwise.backends.quantization import int8_kernels_available

    if not int8_kernels_available():
        pytest.skip("torch build without fbgemm int8 kernels")
    return load_model(str(stories_path), device="cpu", quantization="int8")


@pytest.fixture(scope="module")
def variants(stories_path, tmp_path_factory):
    """stories260K with ids 300 and 301 swapped, and with 8 extra tokens (zero rows)."""
    folder = tmp_path_factory.mktemp("draft_variants")
    paths = {"swapped": folder / "stories-swapped.gguf", "extra": folder / "stories-extra.gguf"}
    write_gguf_variant(stories_path, paths["swapped"], swap_tokens=(300, 301))
    write_gguf_variant(stories_path, paths["extra"], extra_tokens=8)
    return paths


def _llama_draft(stories_path, k: int, method: str = "draft_model") -> SpeculativeConfig:
    return SpeculativeConfig(method=method, model=str(stories_path), num_speculative_tokens=k, backend="llama.cpp")


def _plain(target: LoadedModel, prompt, params=GREEDY):
    return SpeculativeEngine(target.backend, eos_token_ids=target.eos_token_ids).generate(prompt, params)


def _exact_over_ks(target: LoadedModel, stories_path, quantization: str) -> dict[int, float]:
    """Greedy output with a llama.cpp draft of the same GGUF equals plain decoding for K = 1..5 on every prompt;
    returns the acceptance rate per K (all prompts together)."""
    from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM

    oracles = {text: _plain(target, target.encode(text)) for text in PROMPTS}
    proposer, draft = build_proposer(_llama_draft(stories_path, 5), target, device="cpu", dtype=None,
                                     quantization=quantization, backend="torch", threads=1)
    assert isinstance(draft.backend, LlamaCppCausalLM) and not draft.backend.batch_invariant
    rates = {}
    for k in range(1, 6):
        drafted = accepted = 0
        for text, oracle in oracles.items():
            engine = SpeculativeEngine(target.backend, proposer, k, eos_token_ids=target.eos_token_ids)
            result = engine.generate(target.encode(text), GREEDY)
            assert result.token_ids == oracle.token_ids, (quantization, k, text)
            assert result.finish_reason == oracle.finish_reason
            drafted += result.stats.num_draft_tokens
            accepted += result.stats.num_accepted_tokens
        rates[k] = accepted / drafted
    logger.info("llama.cpp draft for a %s PyTorch target: acceptance by K %s", quantization, rates)
    return rates


@needs_llama_cpp
def test_fp32_target_with_llama_cpp_draft_is_exact_for_k_1_to_5(stories, stories_path):
    rates = _exact_over_ks(stories, stories_path, "none")
    assert min(rates.values()) > 0.95, rates  # same weights, two implementations: F32 logits differ by ~1e-5


@needs_llama_cpp
def test_int8_target_with_llama_cpp_draft_is_exact_for_k_1_to_5(int8_stories, stories_path):
    rates = _exact_over_ks(int8_stories, stories_path, "int8")
    assert min(rates.values()) > 0.7, rates  # the draft is the F32 model: int8 moves some argmaxes


@needs_llama_cpp
def test_build_engine_int8_target_llama_cpp_draft(stories_path, draftwise_home):
    from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM
    from draftwise.builder import backend_kind

    bundle = build_engine(str(stories_path), _llama_draft(stories_path, 4), device="cpu", quantization="int8",
                          threads=1)
    assert backend_kind(bundle.target) == "torch" and "+int8" in bundle.target.backend.name
    assert isinstance(bundle.draft.backend, LlamaCppCausalLM) and bundle.draft.backend.n_threads == 1
    prompt = bundle.target.encode(PROMPTS[0])
    assert bundle.engine.generate(prompt, GREEDY).token_ids == _plain(bundle.target, prompt).token_ids


@needs_llama_cpp
def test_hybrid_with_a_llama_cpp_draft_is_exact(stories, stories_path, draftwise_home):
    from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM
    from draftwise.proposers.hybrid import HybridProposer

    bundle = build_engine(str(stories_path), _llama_draft(stories_path, 3, method="hybrid"), device="cpu", threads=1)
    assert isinstance(bundle.engine.proposer, HybridProposer)
    assert isinstance(bundle.draft.backend, LlamaCppCausalLM)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    for text in PROMPTS[:2] + ["One two three. One two three. One two three. One two"]:
        prompt = stories.encode(text)
        result = bundle.engine.generate(prompt, params)
        assert result.token_ids == _plain(stories, prompt, params).token_ids, text
        assert result.stats.num_accepted_tokens > 0


@needs_llama_cpp
def test_gguf_tokenizer_of_llama_cpp_agrees_with_the_transformers_one(stories, stories_path):
    """The same GGUF through llama.cpp's tokenizer and through transformers: identical tables, same specials."""
    from draftwise.check.tokenizer import compare_tokenizers, tokenizer_info_from_hf

    lc = load_model(str(stories_path), backend="llama.cpp", threads=1)
    report = compare_tokenizers(tokenizer_info_from_hf(stories.tokenizer), tokenizer_info_from_hf(lc.tokenizer),
                                target_vocab_width=stories.backend.vocab_size, draft_vocab_width=lc.backend.vocab_size)
    assert report.ok and report.num_differing == 0 and report.target_tokens == report.draft_tokens == 512
    assert report.special_tokens["bos"]["match"] and report.special_tokens["eos"]["match"]
    # transformers' loader pads with EOS where the GGUF sets no pad token; llama.cpp reports none
    assert report.warnings == ["PAD differs: target 2 ('</s>') vs draft None (None); the target's is used, the "
                               "draft may accept fewer tokens"]


@needs_llama_cpp
def test_mismatched_llama_cpp_draft_names_the_first_differing_ids(stories, variants):
    config = SpeculativeConfig(model=str(variants["swapped"]), num_speculative_tokens=2, backend="llama.cpp")
    with pytest.raises(TokenizerMismatchError, match="first: id 300: target '.*' vs draft '.*', id 301"):
        build_proposer(config, stories, device="cpu", dtype=None, backend="torch", threads=1)


@needs_llama_cpp
def test_llama_cpp_draft_too_narrow_for_the_targets_tokens_is_refused(variants, stories_path, draftwise_home):
    """A PyTorch target with 8 more tokens than its 512-wide llama.cpp draft (the rule for a draft table shorter
    than the target's over a wide enough embedding is tested on fake models above)."""
    target = load_model(str(variants["extra"]), device="cpu")
    config = SpeculativeConfig(model=str(stories_path), num_speculative_tokens=2, backend="llama.cpp")
    with pytest.raises(TokenizerMismatchError, match="the draft's embedding has 512 rows but the target's tokenizer "
                                                     "has 520 tokens"):
        build_proposer(config, target, device="cpu", dtype=None, backend="torch", threads=1)


# ------------------------------------------------------------------ vocabulary widths
def _spy_proposals(proposer, seen: list[int]):
    original = proposer.propose

    def propose(*args, **kwargs):
        proposals = original(*args, **kwargs)
        for proposal in proposals:
            seen.extend(proposal.token_ids)
        return proposals

    proposer.propose = propose


@needs_llama_cpp
def test_wider_llama_cpp_draft_is_cut_to_the_targets_width(stories, variants):
    """Draft logits 520 wide (8 extra tokens) for a 512-wide target: cut, exact, nothing past 511 proposed."""
    config = SpeculativeConfig(model=str(variants["extra"]), num_speculative_tokens=3, backend="llama.cpp")
    proposer, draft = build_proposer(config, stories, device="cpu", dtype=None, backend="torch", threads=1)
    assert (draft.backend.vocab_size, stories.backend.vocab_size) == (520, 512)
    logits = draft.backend.forward([1, 403], num_logits=1).logits[-1]
    assert fit_vocab(logits, proposer.target_vocab_size).shape == (512,)
    proposed: list[int] = []
    _spy_proposals(proposer, proposed)
    for text in PROMPTS:
        prompt = stories.encode(text)
        result = SpeculativeEngine(stories.backend, proposer, 3, eos_token_ids=stories.eos_token_ids).generate(
            prompt, GREEDY)
        assert result.token_ids == _plain(stories, prompt).token_ids
        assert result.stats.acceptance_rate > 0.95
    assert proposed and max(proposed) < 512


@needs_llama_cpp
def test_narrower_llama_cpp_draft_is_padded_to_a_padded_target(stories_path, draftwise_home):
    """A PyTorch target whose embedding is padded to 520 rows (as Qwen's 151936 over 151665 tokens) with the
    512-wide llama.cpp draft: draft logits padded with -inf, exact output, no padded id proposed."""
    import torch

    from draftwise.backends.torch_backend import TorchCausalLM

    loaded = load_model(str(stories_path), device="cpu")
    loaded.backend.model.resize_token_embeddings(520, mean_resizing=False)
    target = LoadedModel(backend=TorchCausalLM(loaded.backend.model, name="stories-padded"), tokenizer=loaded.tokenizer,
                         name="stories-padded", eos_token_ids=loaded.eos_token_ids)
    assert target.backend.vocab_size == 520
    config = SpeculativeConfig(model=str(stories_path), num_speculative_tokens=4, backend="llama.cpp")
    proposer, draft = build_proposer(config, target, device="cpu", dtype=None, backend="torch", threads=1)
    padded = fit_vocab(draft.backend.forward([1, 403], num_logits=1).logits[-1], proposer.target_vocab_size)
    assert padded.shape == (520,) and torch.isneginf(padded[512:]).all() and torch.isfinite(padded[:512]).all()
    proposed: list[int] = []
    _spy_proposals(proposer, proposed)
    for text in PROMPTS:
        prompt = target.encode(text)
        result = SpeculativeEngine(target.backend, proposer, 4, eos_token_ids=target.eos_token_ids).generate(
            prompt, GREEDY)
        assert result.token_ids == _plain(target, prompt).token_ids
    assert proposed and max(proposed) < 512


# ------------------------------------------------------------------ prefix reuse with a draft that cannot export
def _words(model: LoadedModel, text: str) -> list[int]:
    """``text``'s ids without BOS: a follow-up turn appended to a conversation."""
    return list(model.tokenizer.encode(text, add_special_tokens=False))


def _count_fed_tokens(backend, monkeypatch) -> list[int]:
    """Record the length of every forward pass the draft backend runs."""
    fed: list[int] = []
    original = backend.forward

    def forward(token_ids, **kwargs):
        fed.append(len(token_ids))
        return original(token_ids, **kwargs)

    monkeypatch.setattr(backend, "forward", forward)
    return fed


@needs_llama_cpp
def test_prefix_reuse_with_a_llama_cpp_draft(stories, stories_path, draftwise_home, monkeypatch):
    """The PyTorch target reuses kept KV states; the llama.cpp draft cannot export its cache, so it keeps what its
    live cache shares with the request and prefills the rest (all of it after an unrelated request)."""
    bundle = build_engine(str(stories_path), _llama_draft(stories_path, 4), device="cpu", threads=1,
                          kv_cache_memory=64 << 20)
    engine, target, draft = bundle.engine, bundle.target, bundle.draft.backend
    assert target.backend.supports_cache_export and not draft.supports_cache_export
    fed = _count_fed_tokens(draft, monkeypatch)
    params = SamplingParams(max_tokens=24)

    def request(prompt):
        fed.clear()
        result = engine.generate(prompt, params)
        assert result.token_ids == _plain(target, prompt, params).token_ids
        return result

    first_prompt = target.encode(PROMPTS[0])
    first = request(first_prompt)
    kept = engine.prefix_cache.lookup("", first_prompt).entry
    assert kept.proposer_state.kv is None and kept.proposer_state.nbytes == 0  # tokens only: nothing to count
    assert fed[0] == len(first_prompt) + 1  # a cold draft prefills the prompt and the target's first token

    conversation = first_prompt + first.token_ids + _words(target, " The dog ran.")
    warm = request(conversation)
    assert warm.stats.num_cached_prompt_tokens == len(first_prompt) + len(first.token_ids) - 1
    assert fed[0] < len(conversation) - len(first_prompt)  # the draft's live cache was reused too
    assert warm.stats.acceptance_rate > 0.9

    request(target.encode(PROMPTS[1]))  # an unrelated request replaces the draft's live cache
    again = conversation + warm.token_ids + _words(target, " Then")
    third = request(again)
    assert third.stats.num_cached_prompt_tokens == len(conversation) + len(warm.token_ids) - 1
    assert fed[0] >= len(again)  # the draft re-prefilled the conversation (past BOS), the target did not
    assert third.stats.acceptance_rate > 0.9


@needs_llama_cpp
def test_draft_cache_changed_by_someone_else_is_prefilled_again(stories, stories_path, draftwise_home):
    """Another user of the draft backend (a calibration) shortens its cache between requests: the proposer
    notices the length mismatch, starts the draft afresh and stays exact."""
    bundle = build_engine(str(stories_path), _llama_draft(stories_path, 3), device="cpu", threads=1,
                          kv_cache_memory=64 << 20)
    prompt = stories.encode(PROMPTS[2])
    first = bundle.engine.generate(prompt, GREEDY)
    bundle.draft.backend.rollback(2)
    follow_up = prompt + first.token_ids + _words(stories, " Then")
    result = bundle.engine.generate(follow_up, GREEDY)
    assert result.token_ids == _plain(stories, follow_up).token_ids
    assert result.stats.acceptance_rate > 0.9


def test_auto_keeps_draft_trees_and_an_frspec_head_on_pytorch():
    """`auto` (the command line's default) with a draft tree, an FR-Spec head or several slots loads the PyTorch
    draft: the one runtime that grows trees, cuts the LM head and batches a draft here (llama.cpp would draft
    chains, fail on the head, or be refused by the batched engine)."""
    options = BuildOptions(quantization="int8", threads=2)
    for fields in ({"tree_width": 2}, {"draft_vocab_size": 64}):
        config = SpeculativeConfig(method="draft_model", model="d.gguf", backend="auto", **fields)
        assert draft_load_options(config, options)["backend"] == "torch", fields


# ------------------------------------------------------------------ auto: what it measures, where it stays lean
@needs_llama_cpp
def test_auto_measures_once_for_quantization_auto_and_int8(stories_path, draftwise_home, monkeypatch):
    """The draft-runtime cache is keyed by the quantization the target resolved to: `--quantization auto` (which
    is int8 here) and `int8` share one measurement (a new-user test saw serve measure again for a minute)."""
    from draftwise import draft_backend

    calls = []
    original = draft_backend.choose_draft_backend

    def recording(path, load, **kwargs):
        calls.append(kwargs["quantization"])
        return original(path, load, **kwargs)

    monkeypatch.setattr(draft_backend, "choose_draft_backend", recording)
    config = SpeculativeConfig(method="draft_model", model=str(stories_path), num_speculative_tokens=3, backend="auto")
    for quantization in ("auto", "int8"):
        build_engine(str(stories_path), config, quantization=quantization, runtime="lean", threads=1)
    assert calls == ["int8", "int8"]


# ------------------------------------------------------------------ the batched engine with a llama.cpp draft
@pytest.fixture(scope="module")
def llama_slots(stories_path):
    """stories260K on llama.cpp with three sequences (a draft's context), and the same file with one."""
    from draftwise.backends.llama_cpp_backend import load_llama_cpp

    multi, _, _ = load_llama_cpp(stories_path, max_context=128, batch_invariant=False, num_slots=3, n_threads=1)
    single, _, _ = load_llama_cpp(stories_path, max_context=128, batch_invariant=False, n_threads=1)
    return multi, single


@needs_llama_cpp
def test_llama_cpp_slots_run_several_sequences_in_one_pass(llama_slots, stories, stories_path):
    """Pieces of two sequences in one llama_decode give each sequence what it gets alone (llama.cpp's kernels are
    not row-invariant: close, same argmax), lengths move per slot, and an exported slot imported into another
    one continues like the original."""
    from draftwise.backends.slots import LOGITS_LAST, LOGITS_NONE, LlamaCppSlots, Piece, as_slot_backend

    multi, single = llama_slots
    slots = as_slot_backend(multi)
    assert isinstance(slots, LlamaCppSlots) and slots.num_slots == slots.max_pieces == 3 and slots.supports_export
    for slot in range(3):
        slots.set_length(slot, 0)
    a, b = stories.encode(PROMPTS[0]), stories.encode(PROMPTS[1])
    out = slots.forward([Piece(0, 0, a), Piece(1, 0, b, logits=LOGITS_LAST)])
    assert out.logits.shape == (len(a) + 1, multi.vocab_size) and out.hidden is None
    assert [slots.length(s) for s in range(3)] == [len(a), len(b), 0] and multi.num_cached == len(a)
    single.reset()
    alone_a = single.forward(a).logits
    single.reset()
    alone_b = single.forward(b, num_logits=1).logits
    torch.testing.assert_close(out.logits[:len(a)], alone_a, atol=2e-2, rtol=0)
    torch.testing.assert_close(out.logits[len(a):], alone_b, atol=2e-2, rtol=0)
    assert out.logits[len(a):].argmax(-1).tolist() == alone_b.argmax(-1).tolist()

    state = slots.export_slot(1, len(b))
    assert state.length == len(b) and state.nbytes > 0
    slots.import_slot(2, state, len(b) - 2)  # a prefix of it, into another slot
    assert slots.length(2) == len(b) - 2
    resumed = slots.forward([Piece(2, len(b) - 2, b[-2:]), Piece(0, 3, a[3:], logits=LOGITS_NONE)])
    assert resumed.logits.shape == (2, multi.vocab_size)
    torch.testing.assert_close(resumed.logits[-1:], alone_b, atol=2e-2, rtol=0)
    assert [slots.length(s) for s in range(3)] == [len(a), len(b), len(b)]

    slots.compact(2, 3, [0, 1])  # a chain's accepted prefix: a rollback
    assert slots.length(2) == 5
    with pytest.raises(ValueError, match="prefix"):
        slots.compact(2, 2, [0, 2])
    with pytest.raises(ValueError, match="distinct slots"):
        slots.forward([Piece(0, len(a), [5]), Piece(0, len(a), [6])])
    with pytest.raises(ValueError, match="do not fit"):
        slots.forward([Piece(1, len(b), [5] * 200)])
    with pytest.raises(ValueError, match="chains"):
        slots.forward([Piece(1, len(b), [5, 6], parents=(-1,))])
    with pytest.raises(ValueError, match="outside"):
        slots.forward([Piece(1, len(b) + 1, [5])])
    with pytest.raises(ValueError, match="cannot keep"):
        slots.set_length(0, len(a) + 1)
    with pytest.raises(ValueError, match="not a KV state"):
        slots.import_slot(0, dataclasses.replace(state, payload=("other.gguf",) + state.payload[1:]), 1)
    assert [slots.length(s) for s in range(3)] == [len(a), len(b), 5]  # refusals changed nothing
    with pytest.raises(ValueError, match="batch-invariant"):
        LlamaCppCausalLM(stories_path, max_context=64, num_slots=2)


@needs_llama_cpp
@pytest.mark.parametrize("speculative_backend", ["llama.cpp", "auto"])
def test_batched_engine_with_a_llama_cpp_draft_equals_plain(stories_path, draftwise_home, int8_stories,
                                                            speculative_backend):
    """`serve --speculative-backend llama.cpp` (or auto) with several slots: the batched engine drafts with a
    llama.cpp context of as many sequences (it refused such a draft before), every output equals plain decoding,
    and a follow-up turn reuses the draft's kept state through the prefix cache (the draft catches up on the new
    tokens only)."""
    from draftwise.engine import EngineCore

    config = SpeculativeConfig(method="draft_model", model=str(stories_path), num_speculative_tokens=4,
                               backend=speculative_backend)
    bundle = build_engine(str(stories_path), config, quantization="int8", runtime="lean", threads=1, max_num_seqs=3,
                          kv_cache_memory=64 << 20)
    engine = bundle.core
    assert isinstance(engine, EngineCore) and engine.max_num_seqs == 3
    if speculative_backend == "llama.cpp":
        assert isinstance(bundle.draft.backend, LlamaCppCausalLM) and bundle.draft.backend.num_slots == 3
    prompts = [int8_stories.encode(text) for text in PROMPTS + ["The little dog", "One day, Tom"]]
    params = SamplingParams(max_tokens=32)
    results = engine.generate(prompts, params)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _plain(int8_stories, prompt, params).token_ids
    assert sum(r.stats.num_accepted_tokens for r in results) > 0.7 * sum(r.stats.num_draft_tokens for r in results)

    follow_up = prompts[0] + results[0].token_ids + _words(int8_stories, " Then the dog")
    kept = engine.prefix_cache.lookup("", follow_up).entry
    assert kept is not None and kept.proposer_state.kv is not None and kept.proposer_state.kv.nbytes > 0
    [again] = engine.generate([follow_up], params)
    assert again.token_ids == _plain(int8_stories, follow_up, params).token_ids
    assert again.stats.num_cached_prompt_tokens >= len(prompts[0]) + len(results[0].token_ids) - 1
    assert again.stats.acceptance_rate > 0.7


# ------------------------------------------------------------------ the command line end to end
@needs_llama_cpp
def test_generate_int8_target_with_llama_cpp_draft_prints_the_plain_text(stories, stories_path, capsys):
    args = ["generate", "--model", str(stories_path), "--quantization", "int8", "--max-tokens", "24", "--chat", "off",
            "--threads", "1", "Once upon a time"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative-model", str(stories_path), "--speculative-backend", "llama.cpp",
                        "--num-speculative-tokens", "3", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)  # --json: one JSON object, the text in it
    text = stats["text"]
    assert text.strip() == plain.strip() and text.strip()
    # the int8 target (lean runtime) and the fp32 llama.cpp draft of the same weights part ways where the tiny
    # model's top logits are close: 0.65 measured at K=3 (1.0 against the transformers int8 path)
    assert stats["method"] == "draft_model" and stats["acceptance_rate"] > 0.5


@needs_llama_cpp
def test_bench_with_a_llama_cpp_draft_for_a_torch_target(stories, stories_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question_id": 1, "category": "a", "turns": ["Once upon a time"]}\n')
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(stories_path), "--draft", str(stories_path), "--prompts", str(prompts),
                 "--ks", "2", "--max-tokens", "24", "--chat", "off", "--speculative-backend", "llama.cpp",
                 "--threads", "1", "--output", str(out), "--no-plots"])
    assert code == 0
    data = json.loads(out.read_text())
    assert (data["config"]["backend"], data["config"]["draft_backend"]) == ("torch", "llama.cpp")
    assert all(run["identical_to_plain"] for run in data["runs"])
    assert data["calibration"]["cost_ratio_c"] > 0


@needs_llama_cpp
def test_bench_hf_anchors_run_transformers_copies_beside_a_llama_cpp_draft(stories_path, tmp_path, capsys):
    """transformers' assisted generation needs transformers models: bench loads copies for the anchors."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question_id": 1, "category": "a", "turns": ["Once upon a time"]}\n')
    code = main(["bench", "--model", str(stories_path), "--draft", str(stories_path), "--prompts", str(prompts),
                 "--methods", "plain,hf", "--speculative-backend", "llama.cpp", "--threads", "1", "--no-calibrate",
                 "--quantization", "none",
                 "--ks", "2", "--max-tokens", "16", "--chat", "off", "--output", str(tmp_path / "b.json"), "--no-plots"])
    assert code == 0
    labels = json.loads((tmp_path / "b.json").read_text())["config"]["methods"]
    assert "hf-assisted K=2" in labels and "hf-lookup K=2" in labels
