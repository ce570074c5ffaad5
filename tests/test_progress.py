"""Progress of long work (issue 21, item 8): the library logs stages, the CLI prints them as lines."""

from __future__ import annotations

import io
import logging

import pytest

from draftwise import progress
from draftwise.cli import main, model_roles


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_carry_role_stage_counts_and_an_eta():
    clock = FakeClock()
    lines = progress.ProgressLines({"qwen2.5-coder-1.5b": "target"}, clock=clock, interval_s=2.0)

    def event(done: int, **fields) -> progress.ProgressEvent:
        return progress.ProgressEvent("building the lean decoder", done=done, total=28, unit="layers", **fields)

    assert lines.render(event(0, model="qwen2.5-coder-1.5b+int8")) == (
        "[target qwen2.5-coder-1.5b] building the lean decoder 0/28 layers")
    clock.now += 10
    assert lines.render(event(3)) == "[target qwen2.5-coder-1.5b] building the lean decoder 3/28 layers, ETA 1m23s"
    clock.now += 1
    assert lines.render(event(4)) is None  # within the interval: throttled
    clock.now += 1
    assert lines.render(event(5)).endswith("5/28 layers, ETA 55s")
    clock.now += 4
    assert lines.render(event(28)) == "[target qwen2.5-coder-1.5b] building the lean decoder 28/28 layers, took 16s"
    # a stage that reports no model belongs to the last model reported
    assert lines.render(progress.ProgressEvent("kernel self-test (int8)", done=2, total=5, unit="kernels",
                                               estimate=False)).startswith("[target qwen2.5-coder-1.5b] kernel")


def test_labels_roles_and_durations():
    lines = progress.ProgressLines({"/m/stories.gguf": "target/draft", "qwen2.5-coder-0.5b": "draft"})
    assert lines.label("/m/stories.gguf+int8+lean") == "target/draft stories.gguf"
    assert lines.label("qwen2.5-coder-0.5b") == "draft qwen2.5-coder-0.5b"
    assert lines.label("Qwen/Qwen2.5-0.5B") == "Qwen2.5-0.5B"
    assert [progress.format_duration(s) for s in (4.4, 80, 7500)] == ["4s", "1m20s", "2h05m"]
    parser_args = type("Args", (), {"model": "/m/stories.gguf", "draft": "/m/stories.gguf"})()
    assert model_roles(parser_args) == {"/m/stories.gguf": "target/draft"}
    serve_args = type("Args", (), {"model_tag": "/m/stories.gguf", "speculative_model": "/m/stories.gguf"})()
    assert model_roles(serve_args) == {"/m/stories.gguf": "target/draft"}  # serve's TARGET is model_tag
    config = '{"method": "hybrid", "model": "/m/stories.gguf"}'  # the draft named in --speculative-config
    config_args = type("Args", (), {"model_tag": "/m/stories.gguf", "speculative_config": config})()
    assert model_roles(config_args) == {"/m/stories.gguf": "target/draft"}
    for broken in ("{not json", '["a"]', '{"model": 3}'):
        assert model_roles(type("Args", (), {"model_tag": "t.gguf", "speculative_config": broken})()) == {
            "t.gguf": "target"}


def test_library_users_see_nothing_unless_they_ask(capsys, caplog):
    progress.report("calibrating verify cost k=1..5", model="m", done=1, total=6, unit="rounds")
    assert capsys.readouterr().err == ""
    with caplog.at_level(logging.INFO, logger=progress.LOGGER_NAME):
        progress.report("calibrating verify cost k=1..5", model="m", done=2, total=6, unit="rounds")
    (record,) = [r for r in caplog.records if r.name == progress.LOGGER_NAME]
    assert record.getMessage() == "[m] calibrating verify cost k=1..5 2/6 rounds"
    assert record.progress.done == 2


def test_progress_lines_restores_the_logger():
    logger = logging.getLogger(progress.LOGGER_NAME)
    before = (logger.level, logger.propagate, list(logger.handlers))
    stream = io.StringIO()
    with progress.progress_lines({"m": "target"}, stream=stream):
        progress.report("loading the weights", model="m")
    assert stream.getvalue() == "[target m] loading the weights\n"
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


def test_cli_shows_the_stages_of_loading_the_models(stories_path, tmp_path, capsys, monkeypatch):
    """bench on stories260K with the int8 lean runtime, in a fresh home: dequantization, weights, kernel
    self-test, lean build, row-invariance check and calibration each show as a line naming the model."""
    from draftwise.backends.quantization import int8_kernels_available

    if not int8_kernels_available():
        pytest.skip("no int8 kernels on this machine")
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "home"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    code = main(["bench", "--model", str(stories_path), "--draft", str(stories_path), "--prompts", str(prompts),
                 "--methods", "plain,draft", "--ks", "2", "--max-tokens", "4", "--chat", "off", "--quantization",
                 "int8", "--no-plots", "--output", str(tmp_path / "b.json")])
    assert code == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[target/draft stories")]
    stages = " | ".join(lines)
    for expected in ("dequantizing GGUF", "saving the dequantized copy", "loading the weights",
                     "kernel self-test (int8; cached afterwards) 0/", "building the lean decoder 0/5 layers",
                     "building the lean decoder 5/5 layers, took", "row-invariance self-test 9/9 passes",
                     "calibrating verify cost k=1..3 (200 cached) 6/6 rounds, took"):
        assert expected in stages, expected
