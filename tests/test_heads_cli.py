"""``draftwise train-heads`` / ``export-heads`` end to end on stories260K, and their one-line user errors."""

from __future__ import annotations

import json

import pytest

from draftwise.benchmark import load_prompts
from draftwise.cli import main
from draftwise.heads.config import HeadsConfig
from draftwise.heads.io import load_heads

PROMPTS = [
    {"question_id": 1, "category": "story", "turns": ["Once upon a time", "And then?"]},
    {"question_id": 2, "category": "story", "turns": ["Tom had a red ball."]},
    {"question_id": 3, "category": "tale", "turns": ["Lily went to the park"]},
    {"question_id": 4, "category": "tale", "turns": ["The cat sat on the mat."]},
]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


def _args(stories_path, prompts, output, *extra):
    return ["train-heads", str(stories_path), "--output", str(output), "--prompts", str(prompts), "--held-out", "1",
            "--held-out-categories", "story", "--max-new-tokens", "16", "--chat", "off", "--batch-tokens", "16",
            *extra]


def test_train_heads_end_to_end_with_export_and_resume(stories, stories_path, prompts, tmp_path, capsys):
    output, export = tmp_path / "heads", tmp_path / "vllm"
    code = main(_args(stories_path, prompts, output, "--method", "medusa", "--num-heads", "2", "--steps", "4",
                      "--export-vllm", str(export), "--json"))
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["heads_bytes"] == (output / "heads.safetensors").stat().st_size
    config = HeadsConfig.from_json_file(output / "heads_config.json")
    training = config.training
    assert config.method == "medusa" and config.num_heads == 2 and training["steps"] == 4
    assert training["heldout_prompt_ids"] == ["1"] and sorted(training["train_prompt_ids"]) == ["2", "3", "4"]
    assert all(0.0 <= v <= 1.0 for v in training["eval"]["top1"]) and training["wall_time_s"] > 0
    heldout = load_prompts(output / "heldout.jsonl")  # Spec-Bench lines, all turns kept, for bench --prompts
    assert [(p.id, p.category, p.turns) for p in heldout] == [("1", "story", ("Once upon a time", "And then?"))]
    assert json.loads((export / "config.json").read_text())["num_heads"] == 2
    heads, _ = load_heads(output, fingerprint=config.base_fingerprint)
    assert heads.num_heads == 2

    # a second run must not silently overwrite the checkpoint; --resume continues it to more steps
    assert main(_args(stories_path, prompts, output, "--method", "medusa", "--num-heads", "2", "--steps", "6")) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(_args(stories_path, prompts, output, "--method", "medusa", "--num-heads", "2", "--steps", "6",
                      "--resume", "--json")) == 0
    resumed = json.loads(capsys.readouterr().out)["training"]
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 6


def test_train_eagle_then_export_heads_command(stories, stories_path, prompts, tmp_path, capsys):
    output, export = tmp_path / "eagle", tmp_path / "vllm-eagle"
    assert main(_args(stories_path, prompts, output, "--method", "eagle", "--steps", "3", "--eval-depth", "3")) == 0
    out = capsys.readouterr().out
    assert "heads.safetensors" in out and "heldout.jsonl" in out
    training = HeadsConfig.from_json_file(output / "heads_config.json").training
    assert len(training["eval"]["top1_by_depth"]) == 3
    assert main(["export-heads", str(output), "--output", str(export), "--model", str(stories_path)]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["LlamaForCausalLM"]
    assert '"method": "eagle"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "lookahead"], "--method must be one of medusa, eagle"),
        (["--method", "medusa", "--num-heads", "0"], "--num-heads must be >= 1"),
        (["--method", "eagle", "--num-layers", "2"], "one decoder layer"),
        (["--method", "medusa", "--prompts", "/nonexistent/prompts.jsonl"], "prompt file not found"),
        (["--method", "medusa", "--held-out-categories", "poems"], "not in the prompts"),
        (["--method", "medusa", "--export-dtype", "int3"], "export dtype"),
    ],
)
def test_user_errors_are_one_line(stories_path, prompts, tmp_path, capsys, extra, message):
    assert main(_args(stories_path, prompts, tmp_path / "out", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_export_heads_errors_are_one_line(tmp_path, capsys):
    assert main(["export-heads", str(tmp_path / "missing"), "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err
    assert main(["export-heads", str(tmp_path), "--output", str(tmp_path / "x"), "--format", "onnx"]) == 2
    assert "--format must be one of vllm" in capsys.readouterr().err
