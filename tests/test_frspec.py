"""FR-Spec: the draft's LM head over a frequency-ranked vocabulary subset (draftwise.frspec)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from conftest import REPO
from draftwise.backends.kernels import OneDnnInt8Linear  # the self-test may pick it: same bits as Int8Linear
from draftwise.backends.quantization import Int8Linear, int8_kernels_available, quantize_model
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.frspec import (
    CorpusSource,
    HeadSubset,
    SubsetLMHead,
    always_kept_ids,
    corpus_texts,
    count_tokens,
    default_ranking,
    kept_ids,
    load_token_map,
    rank_tokens,
    restrict_draft_head,
    restrict_lm_head,
    save_token_map,
    shipped_token_map,
    vocabulary_hash,
)
from draftwise.models.loading import LoadedModel, derive_layer_draft, load_model
from draftwise.proposers.draft_model import DraftModelProposer
from fakes import BigramLM, sequence_distribution

needs_int8 = pytest.mark.skipif(not int8_kernels_available(), reason="torch build without fbgemm int8 kernels")


def random_head(vocab: int = 200, hidden: int = 32, seed: int = 0, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=generator)
    return weight, (torch.randn(vocab, generator=generator) if bias else None)


# ------------------------------------------------------------------------------------------ SubsetLMHead
def test_float_subset_head_matches_full_head_on_kept_ids_and_is_minus_inf_elsewhere():
    weight, bias = random_head()
    full = nn.Linear(32, 200)
    with torch.no_grad():
        full.weight.copy_(weight)
        full.bias.copy_(bias)
    ids = torch.tensor([150, 3, 77, 0, 199, 42])
    head = SubsetLMHead(weight, ids, bias=bias)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    out = head(x)
    assert out.shape == (2, 5, 200) and out.dtype == torch.float32
    expected = full(x)
    # a GEMM over 6 rows may sum in another order than over 200: float32 rounding, not a wrong row
    torch.testing.assert_close(out[..., ids], expected[..., ids], rtol=1e-5, atol=1e-5)
    others = torch.ones(200, dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(out[..., others]).all()
    assert head.num_kept == 6 and head.weight.shape == (200, 32) and head.weight.device.type == "meta"


def test_subset_head_copies_rows_and_pads_a_wider_logits_row():
    weight, _ = random_head(vocab=10, hidden=4, bias=False)
    head = SubsetLMHead(weight, [1, 5], vocab_size=16)  # a padded logits width, as Qwen's 151,936 vs 151,665
    weight.zero_()  # the head holds its own copy of the kept rows
    out = head(torch.ones(3, 4))
    assert out.shape == (3, 16)
    assert torch.isfinite(out).sum().item() == 6 and torch.isfinite(out[:, [1, 5]]).all()
    assert out[:, 1].abs().sum() > 0


@pytest.mark.parametrize("ids, message", [([], "non-empty"), ([1, 1], "repeat"), ([0, 10], r"\[0, 10\)"),
                                          ([-1], r"\[0, 10\)"), ([[1, 2]], "1-D")])
def test_subset_head_rejects_bad_ids(ids, message):
    weight, _ = random_head(vocab=10, hidden=4)
    with pytest.raises(ValueError, match=message):
        SubsetLMHead(weight, torch.tensor(ids, dtype=torch.long) if ids else ids)


def test_subset_head_rejects_bad_shapes_and_kernels():
    weight, _ = random_head(vocab=10, hidden=4)
    with pytest.raises(ValueError, match="hidden"):
        SubsetLMHead(weight[0], [1])
    with pytest.raises(ValueError, match="bias"):
        SubsetLMHead(weight, [1], bias=torch.zeros(3))
    with pytest.raises(ValueError, match="unknown kernel"):
        SubsetLMHead(weight, [1], kernel="fp8")


def test_subset_head_takes_a_linear_factory():
    weight, _ = random_head(vocab=10, hidden=4, bias=False)
    made = []

    def factory(w, b):
        made.append(tuple(w.shape))
        return _float(w, b)

    head = SubsetLMHead(weight, [2, 7, 9], kernel=factory)
    assert made == [(3, 4)]
    torch.testing.assert_close(head(torch.ones(4))[[2, 7, 9]], weight[[2, 7, 9]].sum(1))


def _float(weight, bias):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


@needs_int8
def test_int8_subset_head_is_bit_identical_to_the_full_int8_head_on_kept_ids():
    weight, bias = random_head(vocab=300, hidden=64, seed=3)
    full = Int8Linear(weight, bias)
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:40]
    head = SubsetLMHead(weight, ids, bias=bias, kernel="int8")
    assert isinstance(head.proj, (Int8Linear, OneDnnInt8Linear))
    x = torch.randn(7, 64)
    out, expected = head(x), full(x)
    assert torch.equal(out[:, ids], expected[:, ids])
    assert torch.isneginf(out).sum().item() == 7 * (300 - 40)


@needs_int8
def test_quantize_model_turns_a_float_subset_head_into_an_int8_one():
    weight, bias = random_head(vocab=50, hidden=16)
    holder = nn.Module()
    holder.head = SubsetLMHead(weight, [4, 8, 15], bias=bias)
    holder.head.proj.weight.requires_grad_(False)
    # quantize_model needs a transformers model; _replace_linears is what converts the head's projection
    from draftwise.backends.quantization import _replace_linears

    assert _replace_linears(holder) == 1
    assert isinstance(holder.head.proj, Int8Linear)
    assert torch.equal(holder.head(torch.ones(16))[[4, 8, 15]], Int8Linear(weight, bias)(torch.ones(16))[[4, 8, 15]])


# ------------------------------------------------------------------------------------------ ranking & maps
def test_kept_ids_takes_the_top_and_the_always_kept():
    ranked = [9, 4, 7, 1, 0, 3]
    assert kept_ids(ranked, 3) == [4, 7, 9]
    assert kept_ids(ranked, 2, always=[3, 9, 20]) == [3, 4, 9, 20]
    with pytest.raises(ValueError, match=">= 1"):
        kept_ids(ranked, 0)
    with pytest.raises(ValueError, match="ranks 6 ids"):
        kept_ids(ranked, 7)


def test_rank_tokens_orders_by_count_then_id_and_appends_unseen_ids():
    counts = np.array([0, 5, 2, 5, 0, 9, 0])
    assert rank_tokens(counts) == [5, 1, 3, 2, 0, 4, 6]
    assert rank_tokens(counts, vocabulary_ids=[0, 1, 2, 3, 5, 6]) == [5, 1, 3, 2, 0, 6]  # 4: not a real token


class CharTokenizer:
    """A tokenizer of single characters (ids = code points - 96 for a..z), for counting tests."""

    all_special_ids = [0]

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) - 96 for c in text if "a" <= c <= "z"] for text in texts]}

    def get_vocab(self):
        return {chr(96 + i) if i else "<s>": i for i in range(27)}


def test_count_tokens_counts_every_id():
    counts = count_tokens(CharTokenizer(), ["abca", "zz", "a"] * 50, 27, batch=4)
    assert counts[1] == 150 and counts[26] == 100 and counts[2] == counts[3] == 50 and counts.sum() == 350


@pytest.mark.parametrize("suffix", [".npy", ".txt"])
def test_token_map_round_trip(tmp_path, suffix):
    path = save_token_map(tmp_path / f"map{suffix}", [5, 2, 9, 0])
    assert load_token_map(path) == [5, 2, 9, 0]
    assert path.stat().st_mode & 0o777 == 0o644


def test_token_map_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="token map not found"):
        load_token_map(tmp_path / "missing.npy")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="empty"):
        load_token_map(tmp_path / "empty.txt")
    (tmp_path / "dup.txt").write_text("1 2 1\n")
    with pytest.raises(ValueError, match="unique"):
        load_token_map(tmp_path / "dup.txt")
    (tmp_path / "words.txt").write_text("1 two\n")
    with pytest.raises(ValueError, match="words.txt"):
        load_token_map(tmp_path / "words.txt")
    np.save(tmp_path / "matrix.npy", np.zeros((2, 2), dtype=np.int32))
    with pytest.raises(ValueError, match="1-D integer"):
        load_token_map(tmp_path / "matrix.npy")


def test_corpus_texts_mixes_sources_by_weight_within_the_budget(tmp_path):
    for kind in ("code", "prose"):
        (tmp_path / kind).mkdir()
        for i in range(4):
            (tmp_path / kind / f"{i}.txt").write_text(kind * 100)
    (tmp_path / "code" / "test").mkdir()
    (tmp_path / "code" / "test" / "x.txt").write_text("excluded")
    sources = [CorpusSource("code", tmp_path / "code", ("*.txt",), ("test",), weight=2),
               CorpusSource("prose", tmp_path / "prose", ("*.txt",)), CorpusSource("gone", tmp_path / "no", ("*",))]
    texts = list(corpus_texts(1000, per_file_bytes=100, sources=sources))
    assert [t[:4] for t in texts] == ["code", "code", "pros", "code", "code", "pros", "pros", "pros"]
    assert "excluded" not in texts
    assert len(list(corpus_texts(250, per_file_bytes=100, sources=sources))) == 3  # budget: 100 + 100 + 50
    with pytest.raises(ValueError, match=">= 1 byte"):
        next(corpus_texts(0))


def test_default_ranking_counts_once_then_reads_the_cache(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("zzz yy x " * 20)
    sources = [CorpusSource("t", corpus, ("*.txt",))]
    ranked = default_ranking(CharTokenizer(), cache_dir=tmp_path / "cache", sources=sources)
    assert ranked[:3] == [26, 25, 24] and sorted(ranked) == list(range(27))
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
    monkeypatch.setattr("draftwise.frspec.count_tokens", lambda *a, **k: pytest.fail("counted again"))
    assert default_ranking(CharTokenizer(), cache_dir=tmp_path / "cache", sources=sources) == ranked
    with pytest.raises(ValueError, match="no local corpus"):
        default_ranking(CharTokenizer(), cache_dir=tmp_path / "other", sources=[CorpusSource("n", tmp_path / "no", ("*",))])


def test_shipped_map_is_found_by_vocabulary_hash(tmp_path):
    tokenizer = CharTokenizer()
    assert shipped_token_map(tokenizer, tmp_path) is None
    save_token_map(tmp_path / "other-0123456789abcdef.npy", [1])
    path = save_token_map(tmp_path / f"chars-{vocabulary_hash(tokenizer)}.npy", [3, 1])
    assert shipped_token_map(tokenizer, tmp_path) == path


def test_shipped_qwen_map_is_valid():
    maps = sorted((REPO / "data" / "token_maps").glob("qwen2.5-*.npy"))
    assert maps, "data/token_maps/qwen2.5-<hash>.npy is missing"
    ranked = load_token_map(maps[0])
    assert len(ranked) == 65536 and max(ranked) < 151936
    assert 220 in ranked[:10] and 198 in ranked[:10]  # " " and "\n" of the Qwen2 byte-level BPE


def test_head_subset_resolution(tmp_path):
    tokenizer = CharTokenizer()
    path = save_token_map(tmp_path / "m.txt", [5, 4, 3, 2, 1])
    assert HeadSubset(size=2, token_map=str(path)).resolve(tokenizer, [9], 27) == [0, 4, 5, 9]  # 0: special
    assert HeadSubset(token_map=str(path)).resolve(tokenizer, [], 27) == [0, 1, 2, 3, 4, 5]
    assert HeadSubset(size=27, token_map=str(path)).resolve(tokenizer, [], 27) is None  # the whole vocabulary
    with pytest.raises(ValueError, match="outside the draft's 4-token head"):
        HeadSubset(size=2, token_map=str(path)).resolve(tokenizer, [], 4)
    with pytest.raises(ValueError, match="ranks 5 ids"):
        HeadSubset(size=6, token_map=str(path)).resolve(tokenizer, [], 27)
    with pytest.raises(ValueError, match="size, a token map"):
        HeadSubset()
    with pytest.raises(ValueError, match=">= 1"):
        HeadSubset(size=0)


def test_always_kept_ids_include_eos_and_special_tokens(stories):
    assert always_kept_ids(stories.tokenizer, stories.eos_token_ids) == [0, 1, 2]
    assert always_kept_ids(CharTokenizer(), [7]) == [0, 7]


# ------------------------------------------------------------------------------------------ build script
def test_build_token_map_script_on_a_tiny_corpus(draftwise_home, stories_path, stories, tmp_path):
    spec = importlib.util.spec_from_file_location("build_token_map", REPO / "scripts" / "build_token_map.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "story.md").write_text("Once upon a time there was a little dog. " * 40 + "zebra")
    (corpus / "ignored.bin").write_text("zebra " * 1000)
    output = tmp_path / "stories.npy"
    assert script.main([str(stories_path), "--corpus", str(corpus), "--output", str(output)]) == 0
    ranked = load_token_map(output)
    assert sorted(ranked) == sorted(stories.tokenizer.get_vocab().values())  # every id, ranked
    counts = count_tokens(stories.tokenizer, [(corpus / "story.md").read_text()], 512)
    assert counts[ranked[0]] == counts.max() > counts[ranked[20]]
    assert script.main([str(stories_path), "--corpus", str(corpus), "--output", str(tmp_path / "t.txt"), "--top", "8"]) == 0
    assert load_token_map(tmp_path / "t.txt") == ranked[:8]
    assert script.main([str(stories_path), "--corpus", str(tmp_path / "none"), "--output", str(output)]) == 1


# ------------------------------------------------------------------------------------------ on real models
def plain(target, prompt, params, eos):
    return SpeculativeEngine(target, eos_token_ids=eos).generate(prompt, params)


class RecordingProposer(DraftModelProposer):
    """A draft-model proposer that keeps every proposal (tokens and draft probabilities)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.proposals = []

    def propose(self, requests, pricing=None):
        proposals = super().propose(requests, pricing)
        self.proposals.extend(proposals)
        return proposals


def stories_ranked(stories) -> list[int]:
    """A stories260K ranking counted on a few in-test sentences (not on any benchmark prompt)."""
    text = ("Once upon a time, there was a little girl named Lily. She liked to play outside with her dog. "
            "One day, they went to the park and saw a big tree. Tom said, \"Let's play!\" They were happy.")
    counts = count_tokens(stories.tokenizer, [text] * 3, stories.backend.vocab_size)
    return rank_tokens(counts, stories.tokenizer.get_vocab().values())


@pytest.fixture(scope="module")
def fr_drafts(stories):
    """stories260K's first 2 layers as a draft, with heads of 64 and 256 ranked ids (plus specials)."""
    drafts = {}
    for size in (64, 256):
        draft = derive_layer_draft(stories, num_layers=2)  # a deep copy: the target keeps its full head
        ids = kept_ids(stories_ranked(stories), size, always_kept_ids(stories.tokenizer, stories.eos_token_ids))
        restrict_draft_head(draft, ids)
        drafts[size] = (draft, set(ids))
    return drafts


@pytest.mark.parametrize("size", [64, 256])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_output_with_an_frspec_draft_equals_plain_target(stories, fr_drafts, size, k):
    draft, kept = fr_drafts[size]
    assert draft.backend.name.endswith(f"+fr{len(kept)}")
    assert isinstance(stories.backend.model.lm_head, nn.Linear)  # the target's head is untouched
    params = SamplingParams(max_tokens=40)
    for text in ["Once upon a time", "Lily and Ben went to the park. They saw"]:
        prompt = stories.encode(text)
        oracle = plain(stories.backend, prompt, params, stories.eos_token_ids)
        proposer = RecordingProposer(draft.backend, stories.backend.vocab_size)
        result = SpeculativeEngine(stories.backend, proposer, k, eos_token_ids=stories.eos_token_ids).generate(prompt, params)
        assert result.token_ids == oracle.token_ids, (text, k, size)
        assert result.finish_reason == oracle.finish_reason
        proposed = {t for p in proposer.proposals for t in p.token_ids}
        assert proposed and proposed <= kept  # never a token outside the subset
        assert result.stats.num_draft_tokens > 0


def test_frspec_draft_outside_the_subset_is_rejected_but_output_stays_exact(stories, fr_drafts):
    """A 64-id head cannot propose most of the target's tokens: acceptance falls, output does not change."""
    draft, _ = fr_drafts[64]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = stories.encode("Once upon a time")
    oracle = plain(stories.backend, prompt, params, stories.eos_token_ids)
    outside = [t for t in oracle.token_ids if t not in fr_drafts[64][1]]
    assert outside, "pick a prompt whose output leaves the 64-id subset"
    result = SpeculativeEngine(stories.backend, DraftModelProposer(draft.backend, stories.backend.vocab_size), 4,
                               eos_token_ids=stories.eos_token_ids).generate(prompt, params)
    assert result.token_ids == oracle.token_ids
    assert result.stats.acceptance_rate < 1.0


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_sampling_with_an_frspec_draft_runs_and_q_is_zero_outside_the_subset(stories, fr_drafts, sampling):
    draft, kept = fr_drafts[256]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=3, sampling=sampling, ignore_eos=True)
    proposer = RecordingProposer(draft.backend, stories.backend.vocab_size)
    result = SpeculativeEngine(stories.backend, proposer, 4, eos_token_ids=stories.eos_token_ids).generate(
        stories.encode("Once upon a time"), params)
    assert len(result.token_ids) == 32 and result.stats.num_draft_tokens > 0
    outside = torch.ones(stories.backend.vocab_size, dtype=torch.bool)
    outside[sorted(kept)] = False
    for proposal in proposer.proposals:
        assert set(proposal.token_ids) <= kept
        if sampling == "rejection":
            q = proposal.draft_probs  # [k, vocab]
            assert q is not None and q.shape == (len(proposal.token_ids), stories.backend.vocab_size)
            assert torch.all(q[:, outside] == 0)
            torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0]))
        else:
            assert proposal.draft_probs is None  # coupled drafts are deterministic given the noise
    if sampling == "coupled":  # same seed, same text as plain decoding under coupled sampling
        assert result.token_ids == plain(stories.backend, stories.encode("Once upon a time"), params,
                                         stories.eos_token_ids).token_ids


def test_rejection_sampling_with_a_subset_draft_keeps_the_target_distribution():
    """A draft whose distribution is zero on half the vocabulary (a subset head's -inf logits): the residual
    max(p - q, 0) covers the missing tokens, so sequences still follow the target exactly."""
    vocab, length, draws = 4, 3, 6000
    gen = torch.Generator().manual_seed(0)
    target_table = torch.randn(vocab, vocab, generator=gen) * 1.5
    weight = torch.randn(vocab, 6, generator=gen)
    hidden = torch.randn(vocab, 6, generator=gen)  # one "hidden state" per previous token
    draft_table = SubsetLMHead(weight, [0, 2])(hidden)  # [vocab, vocab], -inf in columns 1 and 3
    assert torch.isneginf(draft_table[:, [1, 3]]).all()
    engine = SpeculativeEngine(BigramLM(target_table), DraftModelProposer(BigramLM(draft_table), vocab), 2)
    counts: dict[tuple, int] = {}
    for seed in range(draws):
        params = SamplingParams(temperature=0.8, max_tokens=length, ignore_eos=True, seed=seed, sampling="rejection")
        result = engine.generate([0], params)
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
    expected = sequence_distribution(target_table, 0, length, 0.8)
    tv = 0.5 * sum(abs(counts.get(s, 0) / draws - p) for s, p in expected.items())
    assert tv < 0.04, tv
    assert any(1 in s or 3 in s for s in counts)  # tokens the draft cannot propose are still emitted


def test_load_model_with_a_head_subset(draftwise_home, stories_path, stories, tmp_path):
    path = save_token_map(tmp_path / "map.npy", stories_ranked(stories)[:100])
    loaded = load_model(str(stories_path), device="cpu", head_subset=HeadSubset(size=50, token_map=str(path)))
    head = loaded.backend.model.lm_head
    assert isinstance(head, SubsetLMHead) and head.num_kept == 53  # 50 + <unk>, <s>, </s>
    assert loaded.backend.name.endswith("+fr53") and loaded.backend.vocab_size == stories.backend.vocab_size
    prompt = stories.encode("Once upon a time")
    got = loaded.backend.forward(prompt).logits
    stories.backend.reset()
    want = stories.backend.forward(prompt).logits
    stories.backend.reset()
    ids = head.token_ids
    torch.testing.assert_close(got[:, ids], want[:, ids], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).sum().item() == got.shape[0] * 53
    whole = load_model(str(stories_path), device="cpu", head_subset=HeadSubset(size=512, token_map=None))
    assert isinstance(whole.backend.model.lm_head, nn.Linear)  # a subset of the whole vocabulary: no change
    with pytest.raises(ValueError, match="PyTorch backend"):
        load_model(str(stories_path), backend="llama.cpp", head_subset=HeadSubset(size=50))


@needs_int8
def test_int8_subset_logits_are_bit_identical_to_the_full_int8_model(draftwise_home, stories_path, stories, tmp_path):
    ranked = stories_ranked(stories)
    path = save_token_map(tmp_path / "map.npy", ranked)
    full = load_model(str(stories_path), device="cpu", quantization="int8")
    subset = load_model(str(stories_path), device="cpu", quantization="int8",
                        head_subset=HeadSubset(size=64, token_map=str(path)))
    head = subset.backend.model.lm_head
    kept = kept_ids(ranked, 64, [0, 1, 2])
    assert head.token_ids.tolist() == kept
    assert isinstance(head.proj, (Int8Linear, OneDnnInt8Linear)) and f"+int8+fr{len(kept)}" in subset.backend.name
    prompt = stories.encode("Lily and Ben went to the park")
    ids = head.token_ids
    assert torch.equal(subset.backend.forward(prompt).logits[:, ids], full.backend.forward(prompt).logits[:, ids])


@needs_int8
def test_restrict_draft_head_after_int8_quantization():
    from test_quantization import tiny_qwen2  # tied embeddings, as the Qwen drafts

    float_model = tiny_qwen2(seed=4)
    quantized = copy.deepcopy(float_model)
    quantize_model(quantized.model, "int8")
    reference = copy.deepcopy(quantized)
    loaded = LoadedModel(backend=quantized, tokenizer=None, name="tiny")
    ids = list(range(0, 128, 3))
    head = restrict_draft_head(loaded, ids)
    assert isinstance(head.proj, (Int8Linear, OneDnnInt8Linear)) and quantized.name == "tiny-qwen2-4+fr43"
    prompt = [3, 9, 27, 81]
    assert torch.equal(quantized.forward(prompt).logits[:, ids], reference.forward(prompt).logits[:, ids])
    with pytest.raises(ValueError, match="cannot restrict"):
        restrict_draft_head(loaded, ids)  # already restricted
    untied = LoadedModel(backend=copy.deepcopy(float_model), tokenizer=None, name="untied")
    untied.backend.model.config.tie_word_embeddings = False
    quantize_model(untied.backend.model, "int8")
    with pytest.raises(ValueError, match="not tied"):
        restrict_draft_head(untied, ids)
    with pytest.raises(ValueError, match="float nn.Linear"):
        restrict_lm_head(untied.backend.model, ids)


def test_restrict_draft_head_needs_a_pytorch_model():
    loaded = LoadedModel(backend=BigramLM(torch.zeros(4, 4)), tokenizer=None, name="bigram")
    with pytest.raises(ValueError, match="PyTorch draft"):
        restrict_draft_head(loaded, [1])


# ------------------------------------------------------------------------------------------ config & builder
def test_config_fields_are_validated():
    config = SpeculativeConfig(model="d", draft_vocab_size=32768, token_map="map.npy")
    assert (config.draft_vocab_size, config.token_map) == (32768, "map.npy")
    SpeculativeConfig(method="hybrid", model="d", draft_vocab_size=16)
    with pytest.raises(ValueError, match="draft_vocab_size must be >= 1"):
        SpeculativeConfig(model="d", draft_vocab_size=0)
    with pytest.raises(ValueError, match="draft_vocab_size must be an integer or null"):
        SpeculativeConfig(model="d", draft_vocab_size="32768")
    with pytest.raises(ValueError, match="draft_vocab_size must be an integer"):
        SpeculativeConfig(model="d", draft_vocab_size=True)
    with pytest.raises(ValueError, match="token_map must be a string"):
        SpeculativeConfig(model="d", token_map=5)
    with pytest.raises(ValueError, match="token_map must be a path"):
        SpeculativeConfig(model="d", token_map=" ")
    with pytest.raises(ValueError, match="'draft_vocab_size' is not used by method 'ngram'.*draft_model, hybrid"):
        SpeculativeConfig(method="ngram", draft_vocab_size=64)
    with pytest.raises(ValueError, match="'token_map' is not used by method 'suffix'"):
        SpeculativeConfig(method="suffix", token_map="m.npy")


def test_cli_speculative_config_carries_the_fields():
    import argparse

    from draftwise.commands.common import CliError, speculative_config_from_args

    args = argparse.Namespace(speculative_config='{"model": "d", "draft_vocab_size": 64, "token_map": "m.npy"}',
                              speculative_model=None, num_speculative_tokens=None)
    config = speculative_config_from_args(args)
    assert (config.draft_vocab_size, config.token_map) == (64, "m.npy")
    args.speculative_config = '{"model": "d", "draft_vocab_size": -1}'
    with pytest.raises(CliError, match="draft_vocab_size"):
        speculative_config_from_args(args)


def test_build_engine_threads_draft_vocab_size_to_the_draft(draftwise_home, stories_path, stories):
    from draftwise.builder import build_engine

    config = SpeculativeConfig(model=str(stories_path), num_speculative_tokens=3, draft_vocab_size=128)
    bundle = build_engine(str(stories_path), config, device="cpu", kv_cache_memory=0)
    head = bundle.draft.backend.model.lm_head
    assert isinstance(head, SubsetLMHead) and head.num_kept >= 128
    assert isinstance(bundle.target.backend.model.lm_head, nn.Linear)
    params = SamplingParams(max_tokens=32)
    prompt = stories.encode("Once upon a time")
    assert bundle.engine.generate(prompt, params).token_ids == plain(stories.backend, prompt, params,
                                                                     stories.eos_token_ids).token_ids
    missing = SpeculativeConfig(model=str(stories_path), token_map=str(Path(draftwise_home) / "nope.npy"))
    with pytest.raises(FileNotFoundError, match="token map not found"):
        build_engine(str(stories_path), missing, device="cpu")


def test_bench_agent_plan_passes_the_subset_to_draft_methods_only():
    from draftwise.commands.bench import agent_method_plan

    plan = agent_method_plan(["plain", "draft", "ngram", "hybrid"], [2], ["fixed"], [1], {}, "d",
                             draft_vocab={"draft_vocab_size": 64, "token_map": None})
    sizes = {label: (config.draft_vocab_size if config else None) for label, _, _, config in plan}
    assert sizes == {"plain": None, "draft K=2": 64, "ngram K=2": None, "hybrid K=2": 64}
