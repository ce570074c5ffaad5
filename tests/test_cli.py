"""The CLI end to end on stories260K: generate and bench (JSON), and one-line user errors."""

from __future__ import annotations

import json

import pytest

from draftwise.cli import main


def test_generate_plain_and_speculative_print_same_text(stories, stories_path, capsys):
    args = ["generate", "--model", str(stories_path), "--max-tokens", "24", "--chat", "off", "Once upon a time"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    # the draft is the target on the target's runtime (--speculative-backend torch; the default measures runtimes)
    assert main(args + ["--speculative-model", str(stories_path), "--speculative-backend", "torch",
                        "--num-speculative-tokens", "3", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)  # --json: one JSON object, the text in it
    text = stats["text"]
    assert text.strip() == plain.strip() and len(text.strip()) > 0
    assert stats["method"] == "draft_model"
    assert stats["acceptance_rate"] == 1.0  # the draft is the target itself
    assert stats["num_generated_tokens"] == 24


def test_bench_writes_json_with_exactness(stories, stories_path, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time", "category": "story"}\n'
                       '{"question_id": 7, "category": "story", "turns": ["Tom had a red ball."]}\n')
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(stories_path), "--draft", str(stories_path), "--prompts", str(prompts),
                 "--ks", "1,3", "--max-tokens", "16", "--chat", "off", "--output", str(out), "--no-calibrate",
                 "--speculative-backend", "torch"])
    assert code == 0
    data = json.loads(out.read_text())
    assert [row["method"] for row in data["summary"]] == ["plain", "draft K=1", "draft K=3", "plain (repeat)"]
    assert len(data["runs"]) == 8
    assert all(run["identical_to_plain"] for run in data["runs"])
    assert {run["prompt_id"] for run in data["runs"]} == {"1", "7"}
    assert data["summary"][2]["acceptance_rate"] == 1.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--model", "/nonexistent/model.gguf", "hi"], "not found"),
        (["generate", "--model", "x", "--temperature", "-1", "hi"], "temperature"),
        (["generate", "--model", "x", "--speculative-config", "{bad", "hi"], "not valid JSON"),
        (["bench", "--ks", "0"], "every K must be in 1..64"),
        (["generate", "--model", "x", "--temperature", "nan", "hi"], "must be a number >= 0, got nan"),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("config", [
    '{"method": "suffix", "num_speculative_tokens": 4}',
    '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_tree_width": 2, '
    '"suffix_decoding_min_token_prob": 0.05}',
    '{"method": "hybrid", "model": "STORIES", "num_speculative_tokens": 3}',
])
def test_generate_with_suffix_and_hybrid_prints_the_plain_text(stories, stories_path, capsys, config):
    args = ["generate", "--model", str(stories_path), "--max-tokens", "32", "--chat", "off",
            "One two three. One two three. One two three. One two"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative-config", config.replace("STORIES", str(stories_path)), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)  # --json: one JSON object, the text in it
    text = stats["text"]
    assert text.strip() == plain.strip() and len(text.strip()) > 0
    assert stats["method"] == json.loads(config.replace("STORIES", "x"))["method"]
    assert stats["num_accepted_tokens"] > 0
    assert (stats["hybrid_steps"] is not None) == (stats["method"] == "hybrid")  # passes by side, hybrid only


@pytest.mark.parametrize("config, message", [
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "suffix_decoding_min_token_prob"),
    ('{"method": "suffix", "tree_width": 2}', "not used by method 'suffix'"),
    ('{"method": "hybrid"}', "needs a draft model"),
    ('{"method": "magic"}', "hybrid"),  # the error lists the known methods
])
def test_bad_suffix_and_hybrid_configs_are_one_line_errors(config, message, capsys):
    assert main(["generate", "--model", "x", "--speculative-config", config, "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("config, message", [
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens must be an integer, got 2.5"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "num_speculative_tokens must be an integer"),
    ('{"method": "ngram", "prompt_lookup_max": 2.5}', "prompt_lookup_max must be an integer"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": "high"}', "must be a number"),
    ('{"bogus": 1}', "unknown field(s) in --speculative-config: bogus"),
    ('{"method": "draft_model"}', "needs a draft model"),
])
def test_mistyped_speculative_config_fails_before_loading(config, message, capsys):
    """A float K used to be accepted and crash inside the n-gram proposer (a 500 on every server request)."""
    assert main(["generate", "--model", "x", "--speculative-config", config, "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_json_and_stream_exclude_each_other(capsys):
    """--json prints one JSON object (text included) at the end; with --stream it is refused before loading."""
    assert main(["generate", "--model", "x", "--json", "--stream", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--stream" in err and "Traceback" not in err


def test_a_missing_draft_is_refused_before_the_target_loads(stories_path, monkeypatch, capsys):
    import draftwise.builder as builder

    def no_loading(*args, **kwargs):
        raise AssertionError("a weight file was read before the missing draft was refused")

    monkeypatch.setattr(builder, "load_model", no_loading)
    argv = ["generate", "--model", str(stories_path), "--speculative-model", "/nope/draft.gguf", "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "GGUF file not found: /nope/draft.gguf" in err and "Traceback" not in err


@pytest.mark.parametrize("max_model_len", [5, 8, 9])
def test_a_tiny_context_loads_and_generates(stories_path, draftwise_home, max_model_len, capsys):
    """The load-time row-invariance self-test once ran 70 cached tokens + 9 rows whatever the context, and a
    --max-model-len of 1-10 died in it with a traceback; it now fits its passes into the context."""
    argv = ["generate", "--model", str(stories_path), "--max-model-len", str(max_model_len), "--max-tokens", "2",
            "Once"]
    assert main(argv) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["generate", "--model", "x", "--threads", "-2", "hi"], "--threads"),
                                           (["bench", "--limit", "-1"], "--limit")])
def test_counts_below_one_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"argument {message}: must be >= 1" in capsys.readouterr().err


def test_a_file_that_is_no_model_is_named_as_such(tmp_path, capsys):
    """Found by a new-user test: an existing non-model file was reported as 'model not found'."""
    text = tmp_path / "notes.bin"
    text.write_text("not weights")
    assert main(["generate", "--model", str(text), "hi"]) == 2
    err = capsys.readouterr().err
    assert f"not a model: {text}" in err and "Traceback" not in err
