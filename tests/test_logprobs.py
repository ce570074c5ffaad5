"""Log-probabilities in the engine (:mod:`draftwise.logprobs`): the definition on hand-built rows, then on
stories260K's lean runtime (row-invariant): with speculation (draft model, n-gram, K 1/4/8, a draft tree) the
committed tokens' logprobs equal plain decoding's bit for bit at temperature 0 (and under coupled sampling with a
seed); prompt logprobs are the raw distribution of the row before each prompt token, the same however the prompt
is chunked."""

from __future__ import annotations

import math

import pytest
import torch

from draftwise.config import SamplingParams
from draftwise.engine import EngineCore, SpeculativeEngine
from draftwise.logprobs import TokenLogprob, cumulative_logprob, token_logprobs
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer

PROMPTS = ["Once upon a time there was a little dog", "Lily and Ben went to the park. They saw"]


# ---------------------------------------------------------------------- the definition, on hand-built rows
def test_greedy_logprob_is_log_softmax_of_the_processed_row():
    row = torch.tensor([[2.0, 1.0, float("-inf"), 0.5]])  # token 2 masked by a processor
    [entry] = token_logprobs(row, [1], SamplingParams(), num_top=3)
    expected = torch.log_softmax(row[0], -1)
    assert entry.logprob == float(expected[1]) and entry.rank == 2
    assert entry.top == ((0, float(expected[0])), (1, float(expected[1])), (3, float(expected[3])))


def test_temperature_top_k_and_top_p_shape_the_distribution():
    row = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.5, top_k=2)
    [entry] = token_logprobs(row, [1], params, num_top=4)
    kept = torch.log_softmax(torch.tensor([6.0, 4.0]), -1)
    assert entry.logprob == pytest.approx(float(kept[1]))
    assert [t for t, _ in entry.top] == [0, 1]  # excluded tokens are left out of the alternatives
    [nucleus] = token_logprobs(row, [0], SamplingParams(temperature=1.0, top_p=0.5), num_top=4)
    assert nucleus.logprob == 0.0 and len(nucleus.top) == 1


def test_no_alternatives_and_a_checked_shape():
    [entry] = token_logprobs(torch.tensor([[0.0, 0.0]]), [0], None, num_top=0)
    assert entry.top == () and entry.logprob == pytest.approx(math.log(0.5)) and entry.rank == 1
    with pytest.raises(ValueError):
        token_logprobs(torch.zeros(2, 3), [0], None, num_top=0)
    assert cumulative_logprob([TokenLogprob(0, -1.0, 1), TokenLogprob(1, -0.5, 2)]) == -1.5


@pytest.mark.parametrize("name, value", [("logprobs", 21), ("logprobs", -1), ("prompt_logprobs", 21)])
def test_sampling_params_bound_the_counts(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


# ---------------------------------------------------------------------- stories260K, lean runtime
@pytest.fixture(scope="module")
def lean_pair(draftwise_home, stories_path):
    """stories260K on the lean runtime (fp32, row-invariant) and a lean draft of its first 3 layers."""
    from draftwise.models.loading import derive_layer_draft, load_model

    target = load_model(str(stories_path), device="cpu", runtime="lean")
    return target, derive_layer_draft(target, num_layers=3)


def _plain(target, prompt, params):
    return SpeculativeEngine(target.backend, eos_token_ids=target.eos_token_ids).generate(prompt, params)


def _proposer(kind: str, target, draft):
    if kind == "ngram":
        return NgramProposer()
    if kind == "tree":
        return DraftModelProposer(draft.backend, target.backend.vocab_size, tree_width=2)
    return DraftModelProposer(draft.backend, target.backend.vocab_size)


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "tree"])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_logprobs_with_speculation_equal_plain_bit_for_bit(lean_pair, kind, k):
    target, draft = lean_pair
    params = SamplingParams(max_tokens=24, logprobs=5)
    drafted = 0
    for text in PROMPTS:
        prompt = target.encode(text)
        oracle = _plain(target, prompt, params)
        engine = SpeculativeEngine(target.backend, _proposer(kind, target, draft), k,
                                   eos_token_ids=target.eos_token_ids)
        result = engine.generate(prompt, params)
        assert result.token_ids == oracle.token_ids
        assert result.logprobs == oracle.logprobs  # floats compared exactly: bit for bit
        assert len(result.logprobs) == len(result.token_ids)
        assert [e.token_id for e in result.logprobs] == result.token_ids
        drafted += result.stats.num_accepted_tokens
    assert drafted > 0  # some logprobs came from draft rows of a verification pass


def test_greedy_logprobs_rank_the_chosen_token_first_and_sort_the_alternatives(lean_pair):
    target, _ = lean_pair
    result = _plain(target, target.encode(PROMPTS[0]), SamplingParams(max_tokens=16, logprobs=20))
    for entry in result.logprobs:
        values = [v for _, v in entry.top]
        assert len(entry.top) == 20 and values == sorted(values, reverse=True)
        assert entry.rank == 1 and entry.top[0] == (entry.token_id, entry.logprob)
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    assert result.cumulative_logprob == pytest.approx(sum(e.logprob for e in result.logprobs))


def test_coupled_sampling_logprobs_with_speculation_equal_plain(lean_pair):
    target, draft = lean_pair
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=24, seed=7, logprobs=2)
    prompt = target.encode(PROMPTS[1])
    oracle = _plain(target, prompt, params)
    result = SpeculativeEngine(target.backend, DraftModelProposer(draft.backend, target.backend.vocab_size), 4,
                               eos_token_ids=target.eos_token_ids).generate(prompt, params)
    assert result.token_ids == oracle.token_ids and result.logprobs == oracle.logprobs
    assert all(len(e.top) <= 2 and e.logprob > float("-inf") for e in result.logprobs)


def test_logprobs_are_computed_only_when_asked(lean_pair):
    target, _ = lean_pair
    result = _plain(target, target.encode(PROMPTS[0]), SamplingParams(max_tokens=4))
    assert result.logprobs is None and result.prompt_logprobs is None and result.cumulative_logprob is None


def test_prompt_logprobs_are_the_raw_rows_before_each_token_however_chunked(lean_pair):
    target, draft = lean_pair
    prompt = target.encode(PROMPTS[1])
    params = SamplingParams(max_tokens=6, prompt_logprobs=3, logprobs=0)
    whole = _plain(target, prompt, params)
    backend = target.backend
    backend.reset()
    raw = backend.forward(prompt).logits  # [len(prompt), V], every row
    expected = torch.log_softmax(raw.float(), -1)
    assert whole.prompt_logprobs[0] is None and len(whole.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(whole.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-5)
        assert len(entry.top) == 3 and entry.top[0][0] == int(expected[i - 1].argmax())
    chunked = EngineCore(backend, DraftModelProposer(draft.backend, backend.vocab_size), 4,
                         eos_token_ids=target.eos_token_ids, max_num_batched_tokens=5, min_prefill_tokens=5)
    [result] = chunked.generate([prompt], params)
    assert result.prompt_logprobs == whole.prompt_logprobs  # lean rows: the same bits in any chunk
    assert result.token_ids == whole.token_ids and result.logprobs == whole.logprobs


def test_transformers_runtime_is_close_but_not_promised_bit_for_bit(draftwise_home, stories_path):
    """fp32 on transformers' kernels is not row-invariant: the tokens agree and the values nearly (docs/server.md)."""
    from draftwise.models.loading import derive_layer_draft, load_model

    target = load_model(str(stories_path), device="cpu", runtime="transformers")
    draft = derive_layer_draft(target, num_layers=3)
    params = SamplingParams(max_tokens=16, logprobs=2)
    prompt = target.encode(PROMPTS[0])
    oracle = _plain(target, prompt, params)
    result = SpeculativeEngine(target.backend, DraftModelProposer(draft.backend, target.backend.vocab_size), 4,
                               eos_token_ids=target.eos_token_ids).generate(prompt, params)
    assert result.token_ids == oracle.token_ids
    for got, want in zip(result.logprobs, oracle.logprobs):
        assert got.token_id == want.token_id and got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_int8_lean_logprobs_with_speculation_equal_plain_bit_for_bit(draftwise_home, stories_path):
    """``--quantization int8`` (lean runtime, row-invariant int8 kernels) is exact too."""
    from draftwise.backends.quantization import int8_kernels_available
    from draftwise.models.loading import derive_layer_draft, load_model

    if not int8_kernels_available():
        pytest.skip("torch build without fbgemm int8 kernels")
    target = load_model(str(stories_path), device="cpu", quantization="int8")
    draft = derive_layer_draft(target, num_layers=3)
    params = SamplingParams(max_tokens=24, logprobs=3)
    prompt = target.encode(PROMPTS[1])
    oracle = _plain(target, prompt, params)
    for proposer, k in ((DraftModelProposer(draft.backend, target.backend.vocab_size), 4), (NgramProposer(), 8)):
        result = SpeculativeEngine(target.backend, proposer, k, eos_token_ids=target.eos_token_ids).generate(
            prompt, params)
        assert result.token_ids == oracle.token_ids and result.logprobs == oracle.logprobs
        assert result.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("sampling", ["rejection", "coupled"])
def test_sampled_logprobs_are_the_targets_processed_distribution_at_each_position(lean_pair, sampling):
    """However a token was chosen (an accepted draft, rejection sampling's correction, a bonus), its logprob is the
    target's processed distribution at its position: the rows of one pass over the whole text give the same."""
    target, draft = lean_pair
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=3, sampling=sampling, logprobs=4,
                            ignore_eos=True)
    prompt = target.encode(PROMPTS[0])
    result = SpeculativeEngine(target.backend, DraftModelProposer(draft.backend, target.backend.vocab_size), 4,
                               eos_token_ids=target.eos_token_ids).generate(prompt, params)
    assert result.stats.num_accepted_tokens > 0
    backend = target.backend
    backend.reset()
    rows = backend.forward(prompt + result.token_ids[:-1]).logits[len(prompt) - 1:]  # [generated, V]
    assert result.logprobs == token_logprobs(rows, result.token_ids, params, 4)
