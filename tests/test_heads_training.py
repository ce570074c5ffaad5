"""Training Medusa / EAGLE heads on stories260K's own continuations: data, loss, checkpoints, evaluation, save/load."""

from __future__ import annotations

import pytest
import torch

from draftwise.benchmark import BenchPrompt, load_prompts
from draftwise.heads.config import HeadsConfig, HeadsMismatchError, base_model_identity
from draftwise.heads.data import HeadsSample, build_samples, split_prompts, write_prompts_jsonl
from draftwise.heads.eagle import EagleHead, eagle_layer_config
from draftwise.heads.io import load_heads, save_heads
from draftwise.heads.training import (
    IGNORE,
    FrozenTarget,
    TrainSettings,
    eagle_loss_positions,
    evaluate_heads,
    medusa_examples,
    train_heads,
)

PROMPTS = [BenchPrompt("1", "story", ("Once upon a time",)), BenchPrompt("2", "story", ("Tom had a red ball.",)),
           BenchPrompt("3", "tale", ("Lily went to the park",))]


@pytest.fixture(scope="module")
def samples(stories, tmp_path_factory):
    cache = tmp_path_factory.mktemp("heads_cache")
    fingerprint = base_model_identity(stories.backend.model)
    return build_samples(stories, PROMPTS, fingerprint=fingerprint, cache_dir=cache, max_new_tokens=24, chat=False)


def _model(stories):
    return stories.backend.model


def test_split_is_deterministic_disjoint_and_round_trips(tmp_path):
    prompts = [BenchPrompt(str(i), cat, (f"q{i}",)) for i, cat in enumerate(["a", "a", "a", "b", "b", "c"])]
    split = split_prompts(prompts, held_out=1, held_out_categories=["a", "b"], seed=3)
    assert [p.id for p in split.heldout] == ["0", "3"]  # the first of each chosen category, file order
    assert {p.id for p in split.train} == {"1", "2", "4", "5"}
    assert split == split_prompts(prompts, held_out=1, held_out_categories=["a", "b"], seed=3)
    assert len(split_prompts(prompts, held_out=1, num_train=2).train) == 2
    path = write_prompts_jsonl(tmp_path / "heldout.jsonl", split.heldout)
    assert load_prompts(path) == split.heldout
    with pytest.raises(ValueError, match="not in the prompts"):
        split_prompts(prompts, held_out=1, held_out_categories=["zzz"])
    with pytest.raises(ValueError, match="no training prompts"):
        split_prompts(prompts[:1], held_out=1)


def test_samples_are_target_greedy_continuations_and_cached(stories, samples, tmp_path):
    hidden = stories.backend.hidden_size
    target = FrozenTarget(_model(stories), "cpu")
    for sample in samples:
        length = sample.tokens.shape[0]
        assert sample.features.shape == (length, hidden) and sample.num_generated > 0
        # greedy: the LM head on the feature at t picks x_{t+1} for every generated token
        guesses = target.logits(sample.features[sample.prompt_len - 1:-1]).argmax(-1)
        assert torch.equal(guesses, sample.tokens[sample.prompt_len:])
    fingerprint = base_model_identity(_model(stories))
    seen = []
    build_samples(stories, PROMPTS[:1], fingerprint=fingerprint, cache_dir=tmp_path, max_new_tokens=24, chat=False,
                  on_sample=lambda s, cached: seen.append(cached))
    again = build_samples(stories, PROMPTS[:1], fingerprint=fingerprint, cache_dir=tmp_path, max_new_tokens=24,
                          chat=False, on_sample=lambda s, cached: seen.append(cached))
    assert seen == [False, True] and len(list(tmp_path.glob("*.safetensors"))) == 1
    assert torch.equal(again[0].tokens, samples[0].tokens) and torch.equal(again[0].features, samples[0].features)


def test_labels_are_target_generated_tokens_only():
    tokens = torch.arange(10, 20)  # T = 10, prompt_len = 4
    sample = HeadsSample("x", "c", tokens, torch.randn(10, 3), prompt_len=4)
    features, labels = medusa_examples([sample], num_heads=2)
    # rows t = 1..7; head i labels x_{t+2+i} when 4 <= t+2+i <= 9
    assert labels.tolist() == [[IGNORE, 14], [14, 15], [15, 16], [16, 17], [17, 18], [18, 19], [19, IGNORE]]
    assert torch.equal(features, sample.features[1:8])
    assert eagle_loss_positions(sample).tolist() == [2, 3, 4, 5, 6, 7]  # pair j predicts x_{j+2}, j+2 in [4, 9]


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_training_lowers_the_loss_and_evaluates(stories, samples, method):
    settings = TrainSettings(method=method, num_heads=2, steps=24, lr=3e-3, batch_tokens=24, seed=1)
    result = train_heads(_model(stories), samples[:2], settings, fingerprint="fp")
    assert result.steps == 24 and len(result.losses) == 24
    assert sum(result.losses[-4:]) / 4 < 0.8 * sum(result.losses[:4]) / 4
    evaluation = evaluate_heads(result.heads, _model(stories), samples[2:], settings)
    values = evaluation["top1"] + evaluation["chain"] if method == "medusa" else \
        [evaluation["top1_teacher_forced"]] + evaluation["top1_by_depth"] + evaluation["chain_by_depth"]
    assert values and all(0.0 <= v <= 1.0 for v in values)
    if method == "eagle":
        assert len(evaluation["top1_by_depth"]) == settings.eval_depth and evaluation["anchors"] > 0
        assert evaluation["chain_by_depth"] == sorted(evaluation["chain_by_depth"], reverse=True)
    else:
        assert evaluation["positions"][0] > 0


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_resume_continues_from_the_saved_step(stories, samples, tmp_path, method):
    noise = 0.05 if method == "eagle" else 0.0  # the noise is replayed too
    settings = TrainSettings(method=method, num_heads=2, steps=8, lr=3e-3, batch_tokens=16, checkpoint_every=3, seed=2,
                             eagle_noise=noise)
    straight = train_heads(_model(stories), samples[:2], settings, fingerprint="fp")

    def stop_at_6(done, total, loss):
        if done == 6:
            raise KeyboardInterrupt

    checkpoint = tmp_path / "checkpoint.pt"
    with pytest.raises(KeyboardInterrupt):
        train_heads(_model(stories), samples[:2], settings, fingerprint="fp", checkpoint_path=checkpoint, on_step=stop_at_6)
    assert torch.load(checkpoint, weights_only=True)["step"] == 6
    resumed = train_heads(_model(stories), samples[:2], settings, fingerprint="fp", checkpoint_path=checkpoint,
                          resume=True)
    assert resumed.resumed_from == 6 and resumed.steps == 8 and len(resumed.losses) == 8
    assert resumed.losses == pytest.approx(straight.losses, rel=1e-5)
    for (name, a), (_, b) in zip(straight.heads.state_dict().items(), resumed.heads.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), name
    other = TrainSettings(method=method, num_heads=2, steps=8, seed=2)
    with pytest.raises(HeadsMismatchError, match="another run"):
        train_heads(_model(stories), samples[:2], other, fingerprint="other-model", checkpoint_path=checkpoint, resume=True)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_save_load_round_trip_and_wrong_base_model(stories, stories_path, samples, tmp_path, method):
    from draftwise.models.loading import load_model

    model = _model(stories)
    settings = TrainSettings(method=method, num_heads=2, steps=3, batch_tokens=16)
    heads = train_heads(model, samples[:1], settings, fingerprint="fp").heads
    fingerprint = base_model_identity(model)
    config = HeadsConfig(method=method, hidden_size=64, vocab_size=512, base_model="stories260K",
                         base_fingerprint=fingerprint, num_heads=2 if method == "medusa" else 1,
                         eagle=eagle_layer_config(model.config) if method == "eagle" else {}, training={"steps": 3})
    save_heads(tmp_path, heads, config)
    loaded, loaded_config = load_heads(tmp_path, fingerprint=fingerprint)
    assert loaded_config == config
    features = samples[0].features[:6]
    with torch.no_grad():
        if method == "medusa":
            assert torch.equal(loaded(features), heads(features))
        else:
            embeds, positions = torch.randn(6, 64), torch.arange(6)
            assert isinstance(loaded, EagleHead)
            assert torch.equal(loaded(features, embeds, positions), heads(features, embeds, positions))
    other = load_model(f"random:{stories_path}", device="cpu")
    with pytest.raises(HeadsMismatchError, match="cannot run on"):
        load_heads(tmp_path, fingerprint=base_model_identity(other.backend.model))
