"""``serve --generation-config auto|none|PATH``: sampling defaults from a model's generation_config.json, found
beside the model, applied only to the fields a request does not send (absent or null), before validation (a
default the server refuses is refused as if sent), and said at start-up."""

from __future__ import annotations

import json
import logging

import pytest

from draftwise.cli import build_parser
from draftwise.commands.common import CliError
from draftwise.commands.serve import plan_from_args
from draftwise.server.errors import RequestError
from draftwise.server.generation_config import (
    GenerationConfigError,
    GenerationDefaults,
    find_generation_config,
    load_generation_defaults,
)
from draftwise.server.protocol import ChatCompletionRequest, CompletionRequest

QWEN_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
               "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_new_tokens": 512}


def write_config(directory, config=QWEN_CONFIG, name="generation_config.json"):
    path = directory / name
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def test_defaults_fill_only_the_fields_a_request_did_not_send():
    defaults = GenerationDefaults({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 512})
    sent = CompletionRequest(prompt="x", temperature=0.0, top_k=None, max_tokens=5)
    applied = defaults.apply(sent)
    assert (applied.temperature, applied.top_p, applied.top_k, applied.max_tokens) == (0.0, 0.8, 20, 5)
    assert sent.top_p is None  # the request itself is not changed
    chat = ChatCompletionRequest(messages=[], max_completion_tokens=9)
    assert defaults.apply(chat).max_tokens is None  # max_completion_tokens was sent: no max_tokens default
    assert defaults.apply(ChatCompletionRequest(messages=[])).max_tokens == 512


def test_vllm_sampling_defaults_fill_only_unsent_fields():
    defaults = GenerationDefaults({"min_p": 0.05, "repetition_penalty": 1.1})
    applied = defaults.apply(CompletionRequest(prompt="x"))
    assert (applied.min_p, applied.repetition_penalty) == (0.05, 1.1)
    sent = CompletionRequest.model_validate({"prompt": "x", "min_p": 0.1, "repetition_penalty": 1.0})
    assert (defaults.apply(sent).min_p, defaults.apply(sent).repetition_penalty) == (0.1, 1.0)


def test_auto_finds_the_file_beside_a_directory_or_a_gguf(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    path = write_config(model_dir)
    assert find_generation_config(str(model_dir)) == path
    gguf = tmp_path / "coder.gguf"
    gguf.write_bytes(b"GGUF")
    assert find_generation_config(str(gguf)) is None
    own = write_config(tmp_path, {"temperature": 0.2}, "coder.generation_config.json")
    assert find_generation_config(str(gguf)) == own
    defaults = load_generation_defaults("auto", str(gguf))
    assert defaults.values == {"temperature": 0.2} and defaults.source == own


def test_reading_maps_keys_and_skips_values_of_the_wrong_type(tmp_path, caplog):
    path = write_config(tmp_path, {**QWEN_CONFIG, "min_p": "high", "top_k": 2.5})
    with caplog.at_level(logging.WARNING):
        defaults = load_generation_defaults(str(tmp_path), "whatever")
    assert defaults.values == {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.1, "max_tokens": 512}
    assert defaults.source == path
    assert "min_p" in caplog.text and "top_k" in caplog.text
    assert "temperature=0.7" in defaults.describe() and str(path) in defaults.describe()


def test_none_and_missing_paths(tmp_path):
    write_config(tmp_path)
    none = load_generation_defaults("none", str(tmp_path))
    assert none.values == {} and "--generation-config none" in none.describe()
    assert "no generation_config.json found" in load_generation_defaults("auto", str(tmp_path / "nowhere")).describe()
    with pytest.raises(GenerationConfigError):
        load_generation_defaults(str(tmp_path / "missing.json"), "m")
    (tmp_path / "bad.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(GenerationConfigError):
        load_generation_defaults(str(tmp_path / "bad.json"), "m")


def test_serve_flag_reaches_the_settings(tmp_path):
    path = write_config(tmp_path)
    plan = plan_from_args(build_parser().parse_args(["serve", "t.gguf", "--generation-config", str(path)]))
    assert plan.settings.generation_defaults.values["top_k"] == 20
    plan = plan_from_args(build_parser().parse_args(["serve", "t.gguf", "--generation-config", "none"]))
    assert plan.settings.generation_defaults.values == {}
    with pytest.raises(CliError, match="no generation config"):
        plan_from_args(build_parser().parse_args(["serve", "t.gguf", "--generation-config", str(tmp_path / "x")]))


def test_defaults_go_through_validation_as_if_sent():
    from test_fim import char_tokenizer

    from draftwise.models.loading import LoadedModel
    from draftwise.server import ServerSettings
    from draftwise.server.text import TextCodec
    from draftwise.server.validation import EngineLimits, RequestValidator

    tokenizer = char_tokenizer()

    def validator(values):
        codec = TextCodec(LoadedModel(backend=None, tokenizer=tokenizer, name="fake"), copies=1)
        settings = ServerSettings(generation_defaults=GenerationDefaults(values))
        return RequestValidator(codec, EngineLimits(4096, len(tokenizer), max_num_seqs=2), settings, "fake")

    request = validator({"temperature": 0.7, "top_p": 0.8, "top_k": 20}).completion(CompletionRequest(prompt="ab"))
    assert (request.params.temperature, request.params.top_p, request.params.top_k) == (0.7, 0.8, 20)
    sent = validator({"temperature": 0.7}).completion(CompletionRequest(prompt="ab", temperature=0.0))
    assert sent.params.temperature == 0.0
    with pytest.raises(RequestError) as caught:  # a bad default is refused like a bad value sent, naming it
        validator({"top_p": 1.5}).completion(CompletionRequest(prompt="ab"))
    assert caught.value.param == "top_p"
