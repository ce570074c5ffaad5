"""The llama.cpp backend on stories260K (all tensors F32): cache rollback, logits shapes, batch invariance,
greedy exactness of speculative decoding (draft model and n-gram proposers), mixed backends, the bench command.

Skipped as a whole only when llama-cpp-python is not installed and DRAFTWISE_REQUIRE_LLAMA_CPP is unset
(``scripts/test.sh`` sets it, so in CI a missing package fails these tests).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from draftwise.backends.llama_cpp_backend import LlamaCppCausalLM
from draftwise.builder import TokenizerMismatchError, build_engine, build_proposer
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import load_model
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer
from gguf_variants import write_gguf_variant
from llama_cpp_gate import needs_llama_cpp

pytestmark = needs_llama_cpp

KS = [1, 2, 4, 8]
PROMPTS = ["Once upon a time", "Lily and Ben went to the park. They saw"]
TOKENS = [1, 17, 33, 8, 21, 40, 12, 5, 9, 30, 77, 3, 101, 64, 200, 18]


@pytest.fixture(scope="module")
def lc_stories(stories_path):
    """stories260K on llama.cpp, one thread."""
    return load_model(str(stories_path), backend="llama.cpp", threads=1)


@pytest.fixture(scope="module")
def lc_same_draft(stories_path):
    """A second llama.cpp instance of the same file: a draft that is always right."""
    return load_model(str(stories_path), backend="llama.cpp", threads=1)


@pytest.fixture(scope="module")
def variants(stories_path, tmp_path_factory):
    """GGUF variants of stories260K: its first 3 of 5 layers (a real, imperfect draft), a swapped token table,
    and a table with 8 extra tokens."""
    folder = tmp_path_factory.mktemp("gguf_variants")
    paths = {"layers3": folder / "stories-3layers.gguf", "swapped": folder / "stories-swapped.gguf",
             "extra": folder / "stories-extra.gguf"}
    write_gguf_variant(stories_path, paths["layers3"], layers=3)
    write_gguf_variant(stories_path, paths["swapped"], swap_tokens=(300, 301))
    write_gguf_variant(stories_path, paths["extra"], extra_tokens=8)
    return paths


@pytest.fixture(scope="module")
def lc_small_draft(variants):
    """The 3-layer draft, running llama.cpp's native (batch-variant) one-token passes, as drafts do."""
    draft = load_model(str(variants["layers3"]), backend="llama.cpp", threads=1, drafting=True)
    assert not draft.backend.batch_invariant
    return draft


def plain(target, prompt, params, eos=()):
    return SpeculativeEngine(target, eos_token_ids=eos).generate(prompt, params)


def speculate(target, proposer, prompt, params, k, eos=()):
    return SpeculativeEngine(target, proposer, k, eos_token_ids=eos).generate(prompt, params)


# ---------------------------------------------------------------------------------------------- the backend
def test_logits_shape_dtype_and_hidden(lc_stories):
    backend = lc_stories.backend
    backend.reset()
    out = backend.forward([1, 2, 3, 4])
    assert out.logits.shape == (4, backend.vocab_size) == (4, 512) and out.logits.dtype == torch.float32
    assert out.hidden is None and backend.num_cached == 4
    out = backend.forward([5, 6, 7], num_logits=2, return_hidden=True)
    assert out.logits.shape == (2, 512) and out.hidden.shape == (2, 64)
    assert backend.forward([8], num_logits=5).logits.shape == (1, 512)
    assert backend.num_cached == 8


def test_rollback_then_refeed_equals_fresh_prefill(lc_stories):
    backend = lc_stories.backend
    backend.reset()
    fresh = backend.forward(TOKENS[:10]).logits  # [10, vocab]
    backend.reset()
    backend.forward(TOKENS[:4])
    backend.forward([44, 45, 46, 47])  # speculative tokens that get rejected
    backend.rollback(4)
    assert backend.num_cached == 4
    again = backend.forward(TOKENS[4:10]).logits  # [6, vocab]
    assert torch.equal(again, fresh[4:])


def test_someone_else_rewriting_the_cache_at_the_same_length_stops_its_reuse(stories_path):
    """The engine reuses a llama.cpp cache (which cannot export) only while it still holds the sequence the engine
    left there; a direct user (a calibration) that rewrites it to the same length must not pass for it."""
    from draftwise.prefix_cache import PrefixCache

    target = load_model(str(stories_path), backend="llama.cpp", threads=1)
    engine = SpeculativeEngine(target.backend, NgramProposer(1, 3), 3, prefix_cache=PrefixCache(1 << 20))
    params = SamplingParams(max_tokens=12)
    prompt = target.encode(PROMPTS[1])
    first = engine.generate(prompt, params)
    conversation = prompt + first.token_ids + list(target.tokenizer.encode(" The", add_special_tokens=False))
    held = target.backend.num_cached
    target.backend.rollback(1)
    target.backend.forward([TOKENS[(i % 15) + 1] for i in range(held - 1)])  # other tokens, the same length
    assert target.backend.num_cached == held
    result = engine.generate(conversation, params)
    assert result.stats.num_cached_prompt_tokens == 0
    assert result.token_ids == plain(target.backend, conversation, params).token_ids


def test_rollback_bounds_and_errors(lc_stories):
    from draftwise.backends.base import ContextOverflowError

    backend = lc_stories.backend
    backend.reset()
    backend.forward([1, 2, 3])
    for bad in (4, -1):
        with pytest.raises(ValueError):
            backend.rollback(bad)
    backend.rollback(0)
    assert backend.num_cached == 0
    with pytest.raises(ValueError, match="out of range"):
        backend.forward([512])
    with pytest.raises(ValueError, match="at least one token"):
        backend.forward([])
    with pytest.raises(ContextOverflowError):
        backend.forward([5] * (backend.max_context + 1))


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8])
def test_logits_do_not_depend_on_batching(lc_stories, chunk):
    """Batch invariance: the same positions decoded one at a time, in chunks, or all at once give
    bit-identical logits, also past 256 cached tokens (llama.cpp pads its attention window to 256 cells)."""
    backend = lc_stories.backend
    tokens = [1] + [int(t) for t in torch.randint(3, 512, (299,), generator=torch.Generator().manual_seed(0))]
    backend.reset()
    whole = backend.forward(tokens).logits  # [300, vocab]
    backend.reset()
    parts = [backend.forward(tokens[i:i + chunk]).logits for i in range(0, len(tokens), chunk)]
    assert torch.equal(torch.cat(parts), whole)


def test_native_one_token_pass_is_not_batch_invariant(stories_path):
    """Why the padding exists: llama.cpp's own one-token pass uses other kernels than batched passes. If this
    starts failing, llama.cpp became batch-invariant and ``batch_invariant=True`` could stop padding."""
    native = LlamaCppCausalLM(stories_path, n_threads=1, batch_invariant=False, max_context=64)
    batched = native.forward(TOKENS).logits
    native.reset()
    one_by_one = torch.cat([native.forward([t]).logits for t in TOKENS])
    assert not torch.equal(batched, one_by_one)
    assert torch.equal(batched.argmax(-1), one_by_one.argmax(-1))  # tiny differences, same greedy tokens here
    torch.testing.assert_close(batched, one_by_one, rtol=0, atol=1e-2)


def test_tokenizer_matches_llama_cpp_and_round_trips(lc_stories, stories):
    tokenizer = lc_stories.tokenizer
    ids = lc_stories.encode("Once upon a time")
    assert ids[0] == tokenizer.bos_token_id == 1
    assert lc_stories.decode(ids) == "Once upon a time"
    assert len(tokenizer) == 512 and lc_stories.eos_token_ids == (2,)
    assert tokenizer.convert_ids_to_tokens(list(range(512))) == stories.tokenizer.convert_ids_to_tokens(list(range(512)))
    assert not lc_stories.has_chat_template


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("k", KS)
def test_same_file_draft_is_exact_and_always_accepted(lc_stories, lc_same_draft, k):
    target = lc_stories
    params = SamplingParams(max_tokens=48)
    for text in PROMPTS:
        prompt = target.encode(text)
        oracle = plain(target.backend, prompt, params, target.eos_token_ids)
        proposer = DraftModelProposer(lc_same_draft.backend, target.backend.vocab_size)
        result = speculate(target.backend, proposer, prompt, params, k, target.eos_token_ids)
        assert result.token_ids == oracle.token_ids, (text, k)
        assert result.finish_reason == oracle.finish_reason
        assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("k", KS)
def test_truncated_draft_is_exact(lc_stories, lc_small_draft, k):
    """A real, imperfect draft (stories260K's first 3 of 5 layers, its own GGUF file) on llama.cpp."""
    target = lc_stories
    params = SamplingParams(max_tokens=48)
    for text in PROMPTS:
        prompt = target.encode(text)
        oracle = plain(target.backend, prompt, params, target.eos_token_ids)
        proposer = DraftModelProposer(lc_small_draft.backend, target.backend.vocab_size)
        result = speculate(target.backend, proposer, prompt, params, k, target.eos_token_ids)
        assert result.token_ids == oracle.token_ids, (text, k)
        assert 0.0 < result.stats.acceptance_rate < 1.0


@pytest.mark.parametrize("k", KS)
def test_ngram_is_exact(lc_stories, k):
    target = lc_stories
    params = SamplingParams(max_tokens=64, ignore_eos=True)  # long enough to repeat itself
    drafted = 0
    for text in PROMPTS:
        prompt = target.encode(text)
        oracle = plain(target.backend, prompt, params)
        result = speculate(target.backend, NgramProposer(), prompt, params, k)
        assert result.token_ids == oracle.token_ids, (text, k)
        drafted += result.stats.num_draft_tokens
    assert drafted > 0


def test_a_native_backend_also_keeps_the_tiled_kernel_off(stories_path, monkeypatch):
    """ggml reads GGML_CPU_TILED_MM once per process: a native draft created (and run) before an invariant target
    must not leave the tiled kernel on for it, so every backend sets the default; a user's setting wins."""
    monkeypatch.delenv("GGML_CPU_TILED_MM", raising=False)
    LlamaCppCausalLM(stories_path, n_threads=1, batch_invariant=False, max_context=16)
    assert os.environ["GGML_CPU_TILED_MM"] == "0"
    monkeypatch.setenv("GGML_CPU_TILED_MM", "1")
    LlamaCppCausalLM(stories_path, n_threads=1, batch_invariant=False, max_context=16)
    assert os.environ["GGML_CPU_TILED_MM"] == "1"


def test_build_engine_with_the_llama_cpp_backend(stories_path):
    config = SpeculativeConfig(method="draft_model", model=str(stories_path), num_speculative_tokens=3)
    bundle = build_engine(str(stories_path), config, backend="llama.cpp", threads=1)
    assert isinstance(bundle.target.backend, LlamaCppCausalLM) and isinstance(bundle.draft.backend, LlamaCppCausalLM)
    assert bundle.target.backend.batch_invariant and not bundle.draft.backend.batch_invariant
    # the draft runs llama.cpp's native kernels: repacked weights, one-token passes, full-size prefill passes
    assert bundle.draft.backend.handle.repacked and not bundle.target.backend.handle.repacked
    prompt = bundle.target.encode(PROMPTS[0])
    params = SamplingParams(max_tokens=24)
    oracle = plain(bundle.target.backend, prompt, params, bundle.target.eos_token_ids)
    assert bundle.engine.generate(prompt, params).token_ids == oracle.token_ids


# ---------------------------------------------------------------------------------------------- mixed backends
@pytest.mark.parametrize("k", [1, 4])
def test_torch_target_with_llama_cpp_draft_is_exact(stories, stories_path, k):
    """Identical token tables: a PyTorch target may take a llama.cpp draft (and the output is the target's)."""
    config = SpeculativeConfig(method="draft_model", model=str(stories_path), num_speculative_tokens=k)
    proposer, draft = build_proposer(config, stories, device="cpu", dtype=None, backend="llama.cpp", threads=1)
    assert isinstance(draft.backend, LlamaCppCausalLM)
    params = SamplingParams(max_tokens=48)
    for text in PROMPTS:
        prompt = stories.encode(text)
        oracle = plain(stories.backend, prompt, params, stories.eos_token_ids)
        result = speculate(stories.backend, proposer, prompt, params, k, stories.eos_token_ids)
        assert result.token_ids == oracle.token_ids, (text, k)
        assert result.stats.acceptance_rate > 0.9  # same weights, two implementations


def test_mixed_backends_refuse_a_different_token_table(stories, variants):
    """Ids 300 and 301 swapped: the error names them (more mixed-backend rules in test_llama_draft.py)."""
    config = SpeculativeConfig(method="draft_model", model=str(variants["swapped"]), num_speculative_tokens=2)
    with pytest.raises(TokenizerMismatchError, match="different tokenizers.*first: id 300: target"):
        build_proposer(config, stories, device="cpu", dtype=None, backend="llama.cpp", threads=1)


def test_extra_tokens_pass_on_one_backend(lc_stories, variants):
    """The same 8 extra tokens are only a warning when both models run on llama.cpp (the usual rule)."""
    config = SpeculativeConfig(method="draft_model", model=str(variants["extra"]), num_speculative_tokens=2)
    _, draft = build_proposer(config, lc_stories, device=None, dtype=None, backend="llama.cpp", threads=1)
    assert draft.backend.vocab_size == 520


# ---------------------------------------------------------------------------------------------- CLI
def test_bench_command_on_llama_cpp(stories_path, tmp_path):
    from draftwise.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"question_id": 1, "category": "a", "turns": ["Once upon a time"]}\n'
                       '{"question_id": 2, "category": "b", "turns": ["Tom had a red ball."]}\n')
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(stories_path), "--draft", str(stories_path), "--prompts", str(prompts),
                 "--methods", "plain,draft,ngram", "--ks", "2,4", "--max-tokens", "24", "--chat", "off",
                 "--backend", "llama.cpp", "--threads", "1", "--output", str(out), "--no-plots"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["config"]["backend"] == "llama.cpp"
    assert all(run["identical_to_plain"] for run in data["runs"])
    assert [row["method"] for row in data["summary"]] == ["plain", "draft K=2", "draft K=4", "ngram K=2", "ngram K=4",
                                                          "plain (repeat)"]


def test_requantize_writes_a_loadable_q4_0_copy(stories_path, tmp_path):
    from draftwise.backends.llama_cpp_backend import gguf_file_type, requantize_gguf

    assert gguf_file_type(stories_path) is None  # all F32, the header does not say
    copy = requantize_gguf(stories_path, tmp_path / "q4_0.gguf", "Q4_0", threads=1)
    assert gguf_file_type(copy) == 2 and list(tmp_path.iterdir()) == [copy]  # no partial file left
    backend = LlamaCppCausalLM(copy, n_threads=1, batch_invariant=False, max_context=32)
    assert backend.forward(TOKENS).logits.shape == (len(TOKENS), backend.vocab_size)
    with pytest.raises(ValueError, match="file type 'Q3_X': choose one of Q4_0, Q8_0, IQ4_NL"):
        requantize_gguf(stories_path, tmp_path / "x.gguf", "Q3_X")
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        requantize_gguf(tmp_path / "missing.gguf", tmp_path / "x.gguf")


def test_requantize_can_give_the_lm_head_its_own_type(stories_path, tmp_path):
    import gguf

    from draftwise.backends.llama_cpp_backend import requantize_gguf

    def types(path):
        return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}

    default = types(requantize_gguf(stories_path, tmp_path / "default.gguf", "Q4_0", threads=1))
    small_head = types(requantize_gguf(stories_path, tmp_path / "head.gguf", "Q4_0", threads=1, head_type="Q4_0"))
    assert default["output.weight"] == "Q8_0"  # llama.cpp's choice for a head 64 wide (not a multiple of 256)
    assert small_head["output.weight"] == "Q4_0"
    assert {k: v for k, v in small_head.items() if k != "output.weight"} == \
        {k: v for k, v in default.items() if k != "output.weight"}
    backend = LlamaCppCausalLM(tmp_path / "head.gguf", n_threads=1, batch_invariant=False, max_context=32)
    assert backend.forward(TOKENS).logits.shape == (len(TOKENS), backend.vocab_size)
    with pytest.raises(ValueError, match="head type 'Q9': choose one of Q4_0, Q8_0, IQ4_NL"):
        requantize_gguf(stories_path, tmp_path / "x.gguf", "Q4_0", head_type="Q9")
