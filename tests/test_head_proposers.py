"""Medusa and EAGLE proposers on the real stories260K model: greedy exactness (chains and trees), the EAGLE
head's incremental state against a from-scratch computation, and heads/config mismatch errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draftwise.builder import build_head_proposer
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.heads import EagleHead, HeadsConfig, HeadsMismatchError, MedusaHeads, base_model_identity, save_heads
from draftwise.heads.eagle import eagle_layer_config


def _random_(module: torch.nn.Module, seed: int, std: float = 0.05) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return module


def _heads_dir(tmp_path, stories, method: str, *, fingerprint: str | None = None):
    model = stories.backend.model
    hidden = model.config.hidden_size
    vocab = stories.backend.vocab_size
    if method == "medusa":
        heads = _random_(MedusaHeads(hidden, num_heads=4), seed=1)
        config = HeadsConfig("medusa", hidden, vocab, "stories260K", fingerprint or base_model_identity(model), num_heads=4)
    else:
        layer = eagle_layer_config(model.config)
        heads = _random_(EagleHead(hidden, layer), seed=2)
        config = HeadsConfig("eagle", hidden, vocab, "stories260K", fingerprint or base_model_identity(model), eagle=layer)
    return save_heads(tmp_path / method, heads, config)


@pytest.fixture(scope="module")
def heads_dirs(tmp_path_factory, stories):
    root = tmp_path_factory.mktemp("heads")
    return {method: _heads_dir(root, stories, method) for method in ("medusa", "eagle")}


def _generate(stories, proposer=None, k=1, params=None):
    params = params or SamplingParams(max_tokens=40, ignore_eos=True)
    engine = SpeculativeEngine(stories.backend, proposer, k, eos_token_ids=stories.eos_token_ids)
    return engine.generate(stories.encode("Once upon a time, there was a"), params)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
@pytest.mark.parametrize("k,width", [(1, 1), (3, 1), (3, 3), (4, 2)])
def test_greedy_output_equals_plain_decoding(stories, heads_dirs, method, k, width):
    oracle = _generate(stories)
    config = SpeculativeConfig(method=method, model=str(heads_dirs[method]), num_speculative_tokens=k, tree_width=width)
    proposer = build_head_proposer(config, stories)
    result = _generate(stories, proposer, k)
    assert result.token_ids == oracle.token_ids
    assert result.stats.num_drafts > 0
    if width > 1:
        assert result.stats.num_tree_nodes > result.stats.num_drafts


def test_seeded_sampling_with_a_tree_is_reproducible(stories, heads_dirs):
    config = SpeculativeConfig(method="eagle", model=str(heads_dirs["eagle"]), num_speculative_tokens=3, tree_width=2)
    proposer = build_head_proposer(config, stories)
    params = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=7)
    first = _generate(stories, proposer, 3, params).token_ids
    assert _generate(stories, proposer, 3, params).token_ids == first
    assert _generate(stories, proposer, 3, dataclasses.replace(params, seed=8)).token_ids != first


def test_eagle_incremental_state_matches_a_from_scratch_head_pass(stories, heads_dirs):
    config = SpeculativeConfig(method="eagle", model=str(heads_dirs["eagle"]), num_speculative_tokens=3, tree_width=2)
    proposer = build_head_proposer(config, stories)
    prompt = stories.encode("Once upon a time, there was a")
    engine = SpeculativeEngine(stories.backend, proposer, 3)
    generation = engine.stream(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    generated: list[int] = []
    for chunk in generation:
        generated.extend(chunk)
        if len(generated) >= 12:
            break
    context = prompt + generated
    draft = proposer.propose(context, 3, SamplingParams(), torch.Generator())
    generation.close()
    assert len(proposer._cache) == len(context) - 1  # draft entries were dropped again

    backend, model = stories.backend, stories.backend.model
    backend.reset()
    features = backend.forward(context, return_hidden=True).hidden  # [T, H]
    backend.reset()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor(context[1:]))
        predicted = proposer.head(features[:-1], embeds, torch.arange(len(context) - 1))[-1]
        expected_top = int(torch.argmax(model.get_output_embeddings()(predicted)))
    assert draft.token_ids[0] == expected_top


def test_heads_of_another_model_are_refused(tmp_path, stories):
    wrong = _heads_dir(tmp_path, stories, "medusa", fingerprint="8x64x512-0000000000000000")
    with pytest.raises(HeadsMismatchError, match="trained on"):
        build_head_proposer(SpeculativeConfig(method="medusa", model=str(wrong)), stories)


def test_missing_or_mismatched_heads_directories(tmp_path, stories, heads_dirs):
    with pytest.raises(HeadsMismatchError, match="not found"):
        build_head_proposer(SpeculativeConfig(method="eagle", model=str(tmp_path / "nope")), stories)
    with pytest.raises(HeadsMismatchError, match="medusa heads, not eagle"):
        build_head_proposer(SpeculativeConfig(method="eagle", model=str(heads_dirs["medusa"])), stories)


def test_head_method_config_validation():
    with pytest.raises(ValueError, match="heads directory"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="fixed"):
        SpeculativeConfig(method="eagle", model="x", k_policy="auto")
    with pytest.raises(ValueError, match="medusa"):
        SpeculativeConfig(method="eagle", model="x", tree=[[0]])
    with pytest.raises(ValueError, match="prefix"):
        SpeculativeConfig(method="medusa", model="x", tree=[[0], [1, 1]])
    with pytest.raises(ValueError, match="tree_width"):
        SpeculativeConfig(method="medusa", model="x", tree_width=0)
    assert SpeculativeConfig(method="medusa", model="x", tree=[[1], [0], [0, 0]]).tree == ((0,), (1,), (0, 0))


def test_medusa_with_an_explicit_tree_is_exact(stories, heads_dirs):
    oracle = _generate(stories)
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    config = SpeculativeConfig(method="medusa", model=str(heads_dirs["medusa"]), num_speculative_tokens=3, tree=tree)
    result = _generate(stories, build_head_proposer(config, stories), 3)
    assert result.token_ids == oracle.token_ids
    drafts = result.stats.num_drafts  # the last steps may be clamped by max_tokens (a shallower tree)
    assert 7 * (drafts - 2) <= result.stats.num_tree_nodes <= 7 * drafts


def test_bench_runs_medusa_and_eagle_chains_and_trees(tmp_path, stories_path, stories, heads_dirs):
    import json

    from draftwise.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question_id": 1, "category": "a", "turns": ["Once upon a time"]}\n')
    output = tmp_path / "bench.json"
    code = main(["bench", "--model", str(stories_path), "--methods", "plain,medusa,eagle", "--ks", "3",
                 "--medusa-heads", str(heads_dirs["medusa"]), "--eagle-heads", str(heads_dirs["eagle"]),
                 "--tree-widths", "1,2", "--prompts", str(prompts), "--max-tokens", "16", "--ignore-eos",
                 "--chat", "off", "--no-calibrate", "--no-plots", "--output", str(output)])
    assert code == 0
    runs = json.loads(output.read_text())["runs"]
    assert sorted(r["method"] for r in runs) == ["eagle K=3", "eagle K=3 w=2", "medusa K=3", "medusa K=3 w=2", "plain",
                                                 "plain (repeat)"]
    assert all(r["identical_to_plain"] for r in runs)


def test_bench_needs_heads_for_head_methods(capsys, stories_path):
    from draftwise.cli import main

    assert main(["bench", "--model", str(stories_path), "--methods", "plain,eagle", "--no-calibrate"]) != 0
    assert "--eagle-heads" in capsys.readouterr().err


def test_generate_with_eagle_speculative_config_prints_the_plain_text(capsys, stories_path, stories, heads_dirs):
    import json

    from draftwise.cli import main

    # heads run on the transformers runtime: plain decoding there is the oracle (the lean runtime's int8 or
    # fp32 numerics differ from transformers' in the last bits, so the default auto could pick another text)
    args = ["generate", "--model", str(stories_path), "--max-tokens", "20", "--chat", "off", "--runtime",
            "transformers", "Once upon a time"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    config = json.dumps({"method": "eagle", "model": str(heads_dirs["eagle"]), "num_speculative_tokens": 3,
                         "tree_width": 2})
    assert main(args + ["--speculative-config", config]) == 0
    assert capsys.readouterr().out.strip() == plain.strip()
    bad = json.dumps({"method": "eagle", "model": str(heads_dirs["medusa"])})
    assert main(args + ["--speculative-config", bad]) != 0
    assert "medusa heads, not eagle" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_heads_trained_a_few_steps_are_exact_and_accept_more_than_untrained_ones(tmp_path, stories, heads_dirs, method):
    """Self-distillation on the prompt itself: the trained heads must accept tokens (the untrained random
    ones almost never do), and the output stays plain decoding's."""
    from draftwise.benchmark import BenchPrompt
    from draftwise.heads.data import build_samples
    from draftwise.heads.training import TrainSettings, train_heads

    model = stories.backend.model
    fingerprint = base_model_identity(model)
    prompts = [BenchPrompt("1", "story", ("Once upon a time, there was a",))]
    samples = build_samples(stories, prompts, fingerprint=fingerprint, cache_dir=tmp_path / "cache",
                            max_new_tokens=40, chat=False)
    settings = TrainSettings(method=method, num_heads=3, steps=60, batch_tokens=64, lr=3e-3)
    heads = train_heads(model, samples, settings, fingerprint=fingerprint).heads
    layer = eagle_layer_config(model.config) if method == "eagle" else {}
    config = HeadsConfig(method, model.config.hidden_size, stories.backend.vocab_size, "stories260K", fingerprint,
                         num_heads=3 if method == "medusa" else 1, eagle=layer)
    trained_dir = save_heads(tmp_path / "trained", heads, config)

    oracle = _generate(stories)
    rates = {}
    for name, directory in (("trained", trained_dir), ("untrained", heads_dirs[method])):
        spec = SpeculativeConfig(method=method, model=str(directory), num_speculative_tokens=3)
        result = _generate(stories, build_head_proposer(spec, stories), 3)
        assert result.token_ids == oracle.token_ids, name
        rates[name] = result.stats.acceptance_rate
    assert rates["trained"] > max(0.3, rates["untrained"]), rates
