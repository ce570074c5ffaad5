"""Replayable sampling: coupled (Gumbel-max) sampling gives, for a seed, the same text with speculation on or
off, whatever the proposer, K or tree, and its output has exactly the target's distribution.

Layers: the noise and the sampler (distribution tests with top-k / top-p), the coupled verifier on hand-built
drafts, then same-seed-same-text through the engine (bigram fakes, a tiny random Llama, stories260K with a
draft model, n-gram, Medusa and EAGLE chains and trees), the CLI and the server.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import tiny_llama
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer
from draftwise.sampling import Sampler, gumbel_noise, logits_to_probs
from draftwise.tree import chain_parents
from draftwise.verification import verify, verify_coupled
from fakes import BigramLM, ScriptedTreeProposer, peaked_table

SEEDS = range(6)
KS = (1, 2, 4, 8)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


# ---------------------------------------------------------------------- config
def test_sampling_rule_defaults_and_validation():
    assert SamplingParams(temperature=0.7, seed=1).coupled
    assert not SamplingParams(temperature=0.7).coupled
    assert SamplingParams(temperature=0.7, sampling="coupled").coupled
    assert not SamplingParams(temperature=0.7, seed=1, sampling="rejection").coupled
    assert not SamplingParams(seed=1, sampling="coupled").coupled  # greedy is greedy
    with pytest.raises(ValueError, match="sampling must be one of"):
        SamplingParams(temperature=1.0, sampling="gumbel")


# ---------------------------------------------------------------------- noise and sampler
def test_gumbel_noise_is_standard_gumbel_and_a_pure_function_of_seed_and_position():
    noise = gumbel_noise(7, 100, 200_000)
    assert noise.dtype == torch.float32 and torch.isfinite(noise).all()
    assert torch.equal(noise, gumbel_noise(7, 100, 200_000))
    assert not torch.equal(noise[:1000], gumbel_noise(7, 101, 1000))
    assert not torch.equal(noise[:1000], gumbel_noise(8, 100, 1000))
    assert torch.equal(noise[:1000], gumbel_noise(7, 100, 1000))  # a narrower vocabulary is a prefix
    assert abs(float(noise.mean()) - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(float(noise.std()) - torch.pi / 6**0.5) < 0.01


def test_sampler_shares_noise_per_position_until_released():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    rows = sampler.noise([5, 6], 50)
    assert torch.equal(sampler.noise([6], 50)[0], rows[1])
    with pytest.raises(ValueError, match="width"):
        sampler.noise([6], 40)
    sampler.release(7)
    assert torch.equal(sampler.noise([6], 40)[0], rows[1, :40])  # regenerated: the same noise
    assert Sampler(SamplingParams(temperature=1.0)).seed != Sampler(SamplingParams(temperature=1.0)).seed


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.8)])
def test_coupled_sampler_draws_the_target_distribution(top_k, top_p):
    """Gumbel-max over positions t = 0..draws-1 is an exact sampler of softmax(processed logits)."""
    from scipy.stats import chisquare

    logits = torch.tensor([2.0, 1.5, 1.2, 0.5, 0.0, -0.5, -1.0, -2.0])
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, seed=11)
    sampler = Sampler(params)
    draws = 20_000
    tokens = [sampler.sample(logits, t) for t in range(draws)]
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    probs = logits_to_probs(logits[None], params)[0]
    assert float(counts[probs == 0].sum()) == 0  # masked tokens are never drawn
    support = probs > 0
    assert total_variation(counts, probs) < 0.012
    assert chisquare(counts[support].numpy(), (probs[support] * draws).numpy()).pvalue > 1e-3


def test_coupled_distance_shrinks_with_more_draws():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(2)) * 2
    params = SamplingParams(temperature=1.0, seed=5)
    probs = logits_to_probs(logits[None], params)[0]

    def tv_after(draws: int, offset: int) -> float:
        sampler = Sampler(params)
        tokens = [sampler.sample(logits, offset + t) for t in range(draws)]
        return total_variation(torch.bincount(torch.tensor(tokens), minlength=12).float(), probs)

    assert tv_after(20_000, 0) < tv_after(300, 10**6)
    assert tv_after(20_000, 0) < 0.015


# ---------------------------------------------------------------------- the coupled verifier
def test_coupled_verifier_commits_the_target_gumbel_argmax_for_any_draft():
    """Chains and trees of random tokens: the committed tokens are always what plain coupled decoding picks."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    params = SamplingParams(temperature=1.0, seed=9)
    for trial in range(300):
        sampler = Sampler(params)
        position = 50 + trial
        tree = trial % 2 == 1
        parents = (-1, -1, 0, 0, 2) if tree else chain_parents(4)
        tokens = torch.randint(0, vocab, (len(parents),), generator=gen).tolist()
        logits = torch.randn(len(parents) + 1, vocab, generator=gen) * 1.5
        result = verify(tokens, parents, None, logits, sampler, position)
        # replay: row 0's choice, then the accepted node's row, one position further each time
        row = 0
        for depth, token in enumerate(result.token_ids):
            assert token == sampler.sample(logits[row], position + depth)
            if depth < result.num_accepted:
                row = 1 + result.accepted_nodes[depth]


def test_coupled_verifier_on_hand_built_rows():
    vocab = 5
    noise = torch.zeros(4, vocab)  # no noise: the Gumbel-argmax is the argmax of the scores
    logits = torch.full((4, vocab), -5.0)
    for row, best in enumerate([1, 2, 3, 4]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=1.0)
    result = verify_coupled([1, 2, 3], chain_parents(3), logits, params, noise)
    assert result.token_ids == (1, 2, 3, 4) and result.bonus and result.accepted_nodes == (0, 1, 2)
    result = verify_coupled([1, 0, 3], chain_parents(3), logits, params, noise)
    assert result.token_ids == (1, 2) and not result.bonus
    # a tree: root -> (0: token 4, 1: token 1); node 1 -> (2); row 2 is node 1's row (best: 3)
    result = verify_coupled([4, 1, 3], (-1, -1, 1), logits, params, noise)
    assert result.accepted_nodes == (1, 2) and result.token_ids == (1, 3, 4) and result.bonus
    result = verify_coupled([4, 1, 0], (-1, -1, 1), logits, params, noise)
    assert result.accepted_nodes == (1,) and result.token_ids == (1, 3) and not result.bonus
    with pytest.raises(ValueError, match="noise"):
        verify_coupled([1, 2, 3], chain_parents(3), logits, params, noise[:2])


def test_coupled_acceptance_of_a_sampled_draft_follows_the_gumbel_coupling():
    """A draft sampled with the same noise matches the target with probability
    sum_i 1 / sum_j max(p_j / p_i, q_j / q_i) (the exponential race), at most sum(min(p, q)) (rejection)."""
    target = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    draft = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
    params = SamplingParams(temperature=1.0, seed=21)
    sampler = Sampler(params)
    draws, accepted = 20_000, 0
    for t in range(draws):
        token, _ = sampler.choose(draft.log(), t)
        accepted += verify([token], (-1,), None, torch.stack([target, target]).log(), sampler, t).num_accepted
    expected = sum(1 / float(torch.maximum(target / target[i], draft / draft[i]).sum()) for i in range(6))
    assert abs(accepted / draws - expected) < 0.012
    assert expected < float(torch.minimum(target, draft).sum())


# ---------------------------------------------------------------------- engine: bigram fakes
def _params(seed: int, **extra) -> SamplingParams:
    fields = {"temperature": 0.8, "max_tokens": 40, "ignore_eos": True, "seed": seed, **extra}
    return SamplingParams(**fields)


@pytest.mark.parametrize("k", KS)
def test_same_seed_same_text_on_bigram_models_for_every_proposer(k):
    vocab = 48
    table = peaked_table(vocab, seed=0, scale=1.2)
    noise = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1))
    target = BigramLM(table)
    proposers = {
        "close draft": DraftModelProposer(BigramLM(table + 0.3 * noise), vocab),
        "random draft": DraftModelProposer(BigramLM(noise * 2), vocab),
        "ngram": NgramProposer(1, 3),
        "tree": ScriptedTreeProposer(2, [(7 * i) % vocab for i in range(200)], vocab, width=3, rank=1),
    }
    plain = SpeculativeEngine(target)
    accepted = 0
    for seed in SEEDS:
        for extra in ({}, {"top_k": 10, "top_p": 0.9}):
            oracle = plain.generate([3, 5], _params(seed, **extra)).token_ids
            for name, proposer in proposers.items():
                result = SpeculativeEngine(target, proposer, k).generate([3, 5], _params(seed, **extra))
                assert result.token_ids == oracle, (name, seed, extra)
                accepted += result.stats.num_accepted_tokens if name == "close draft" else 0
    assert accepted > 0


def test_rejection_sampling_text_depends_on_the_configuration_and_seeds_change_the_text():
    """Why coupling is needed (the regression this file guards): with rejection sampling the same seed gives
    different text with and without speculation; with coupling, different seeds still give different texts."""
    vocab = 48
    table = peaked_table(vocab, seed=0, scale=1.2)
    target, draft = BigramLM(table), BigramLM(table + torch.randn(vocab, vocab) * 0.3)
    plain, spec = SpeculativeEngine(target), SpeculativeEngine(target, DraftModelProposer(draft, vocab), 4)
    rejection = [plain.generate([3], _params(s, sampling="rejection")).token_ids !=
                 spec.generate([3], _params(s, sampling="rejection")).token_ids for s in SEEDS]
    assert any(rejection)
    texts = {tuple(spec.generate([3], _params(s)).token_ids) for s in SEEDS}
    assert len(texts) == len(SEEDS)


def test_unseeded_coupled_requests_are_random_and_seeded_ones_replay():
    target = BigramLM(peaked_table(32, seed=2, scale=1.0))
    engine = SpeculativeEngine(target, NgramProposer(1, 2), 4)
    unseeded = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, sampling="coupled")
    assert engine.generate([1], unseeded).token_ids != engine.generate([1], unseeded).token_ids
    seeded = dataclasses.replace(unseeded, seed=4)
    assert engine.generate([1], seeded).token_ids == SpeculativeEngine(target).generate([1], seeded).token_ids


# ---------------------------------------------------------------------- engine: a tiny random Llama
@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_llama(30), tiny_llama(31), tiny_llama(30)  # target, another model, a copy of the target


@pytest.mark.parametrize("k", KS)
def test_same_seed_same_text_on_a_tiny_llama(tiny_pair, k):
    target, other, copy = tiny_pair
    plain = SpeculativeEngine(target)
    engines = {
        "other draft": SpeculativeEngine(target, DraftModelProposer(other, target.vocab_size), k),
        "target as draft": SpeculativeEngine(target, DraftModelProposer(copy, target.vocab_size), k),
        "ngram": SpeculativeEngine(target, NgramProposer(1, 3), k),
    }
    for seed in SEEDS[:4]:
        params = _params(seed, max_tokens=32, top_p=0.95)
        oracle = plain.generate([0, 5, 9], params).token_ids
        for name, engine in engines.items():
            result = engine.generate([0, 5, 9], params)
            assert result.token_ids == oracle, (name, seed)
            if name == "target as draft":  # the same model with the same noise picks the same tokens
                assert result.stats.acceptance_rate > 0.95


# ---------------------------------------------------------------------- engine: stories260K, every proposer
@pytest.fixture(scope="module")
def stories_proposers(tmp_path_factory, stories, stories_draft):
    from draftwise.builder import build_head_proposer
    from draftwise.config import SpeculativeConfig
    from test_head_proposers import _heads_dir

    root = tmp_path_factory.mktemp("coupled-heads")
    heads = {method: str(_heads_dir(root, stories, method)) for method in ("medusa", "eagle")}

    def make(name: str, k: int):
        if name == "draft_model":
            return DraftModelProposer(stories_draft.backend, stories.backend.vocab_size)
        if name == "ngram":
            return NgramProposer(1, 3)
        method, width = name.split("-")
        config = SpeculativeConfig(method=method, model=heads[method], num_speculative_tokens=k, tree_width=int(width))
        return build_head_proposer(config, stories)

    return make


PROPOSERS = ["draft_model", "ngram", "medusa-1", "medusa-3", "eagle-1", "eagle-2"]


@pytest.mark.parametrize("k", KS)
def test_same_seed_same_text_on_stories260k_for_every_proposer(stories, stories_proposers, k):
    prompt = stories.encode("Once upon a time, there was a")
    plain = SpeculativeEngine(stories.backend, eos_token_ids=stories.eos_token_ids)
    oracles = {seed: plain.generate(prompt, _params(seed, max_tokens=24, top_k=40)).token_ids for seed in SEEDS[:4]}
    assert len({tuple(o) for o in oracles.values()}) == len(oracles)  # different seeds, different texts
    for name in PROPOSERS:
        engine = SpeculativeEngine(stories.backend, stories_proposers(name, k), k, eos_token_ids=stories.eos_token_ids)
        for seed, oracle in oracles.items():
            assert engine.generate(prompt, _params(seed, max_tokens=24, top_k=40)).token_ids == oracle, (name, seed)


# ---------------------------------------------------------------------- CLI and server
def test_cli_generate_same_seed_same_text_with_and_without_speculation(stories, stories_path, capsys):
    from draftwise.cli import main

    base = ["generate", "--model", str(stories_path), "--max-tokens", "24", "--chat", "off", "--temperature", "0.8"]
    texts = []
    for seed in ("1", "2", "3"):
        args = base + ["--seed", seed, "Once upon a time"]
        assert main(args) == 0
        plain = capsys.readouterr().out
        assert main(args + ["--speculative-model", str(stories_path), "--num-speculative-tokens", "3"]) == 0
        assert capsys.readouterr().out == plain
        assert main(args + ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4})]) == 0
        assert capsys.readouterr().out == plain
        texts.append(plain)
    assert len(set(texts)) == 3
    assert main(base + ["--seed", "1", "--sampling", "rejection", "Once upon a time"]) == 0
    assert capsys.readouterr().out.strip()


def test_server_same_seed_same_text_with_and_without_speculation(stories_path, draftwise_home):
    from fastapi.testclient import TestClient

    from draftwise.builder import EngineBundle
    from draftwise.config import SpeculativeConfig
    from draftwise.models.loading import derive_layer_draft, load_model
    from draftwise.server import create_app

    target = load_model(str(stories_path), device="cpu")
    draft = derive_layer_draft(target, 2)
    spec_engine = SpeculativeEngine(target.backend, DraftModelProposer(draft.backend, target.backend.vocab_size), 4,
                                    eos_token_ids=target.eos_token_ids)
    spec = EngineBundle(target=target, core=spec_engine.core, draft=draft,
                        speculative_config=SpeculativeConfig(model=draft.name, num_speculative_tokens=4))
    plain = EngineBundle(target=target, core=SpeculativeEngine(target.backend, eos_token_ids=target.eos_token_ids).core)
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0.8, "top_p": 0.95}
    with TestClient(create_app(spec)) as spec_client, TestClient(create_app(plain)) as plain_client:
        for seed in (1, 2):
            fast = spec_client.post("/v1/completions", json={**body, "seed": seed}).json()
            slow = plain_client.post("/v1/completions", json={**body, "seed": seed}).json()
            assert fast["choices"][0]["text"] == slow["choices"][0]["text"], seed
            assert fast["usage"]["speculative"]["num_draft_tokens"] > 0
        assert spec_client.post("/v1/completions", json={**body, "seed": 1, "sampling": "rejection"}).status_code == 200
        bad = spec_client.post("/v1/completions", json={**body, "sampling": "gumbel"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling"
