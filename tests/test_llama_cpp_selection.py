"""Which backend ``load_model`` picks (``--backend torch|llama.cpp|auto``); runs without llama-cpp-python."""

from __future__ import annotations

import argparse

import pytest

from draftwise.commands.common import add_backend_arg
from draftwise.models.loading import ModelLoadError, select_backend
from llama_cpp_gate import needs_llama_cpp


def test_torch_is_the_default_and_never_switches():
    assert select_backend("torch", "model.gguf") == "torch"
    assert select_backend("torch", "Qwen/Qwen2.5-0.5B", device="cuda") == "torch"


@needs_llama_cpp
def test_auto_picks_llama_cpp_for_gguf_files_only():
    assert select_backend("auto", "/models/m.gguf") == "llama.cpp"
    assert select_backend("auto", "/models/hf-dir") == "torch"
    assert select_backend("auto", "Qwen/Qwen2.5-0.5B") == "torch"


@pytest.mark.parametrize("option", [{"device": "cuda"}, {"dtype": "bf16"}, {"quantization": "int8"}])
def test_auto_keeps_torch_when_a_torch_only_option_is_set(option):
    assert select_backend("auto", "/models/m.gguf", **option) == "torch"


@pytest.mark.parametrize("option", [{"device": "cuda"}, {"dtype": "bf16"}, {"quantization": "int8"}])
def test_llama_cpp_rejects_torch_only_options(option):
    with pytest.raises(ValueError, match="only apply to --backend torch"):
        select_backend("llama.cpp", "/models/m.gguf", **option)


@needs_llama_cpp
def test_llama_cpp_needs_a_gguf_file():
    with pytest.raises(ModelLoadError, match="needs a .gguf file"):
        select_backend("llama.cpp", "/models/hf-dir")
    assert select_backend("llama.cpp", "/models/m.gguf", device="cpu", quantization="none") == "llama.cpp"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("onnx", "m.gguf")


def test_llama_cpp_missing_is_a_clear_error(monkeypatch):
    import draftwise.backends.llama_cpp_backend as module

    monkeypatch.setattr(module, "llama_cpp_available", lambda: False)
    assert select_backend("auto", "/models/m.gguf") == "torch"
    with pytest.raises(ModelLoadError, match="scripts/install_llama_cpp.sh"):
        select_backend("llama.cpp", "/models/m.gguf")


def test_backend_flag():
    parser = argparse.ArgumentParser()
    add_backend_arg(parser)
    assert parser.parse_args([]).backend == "torch"
    args = parser.parse_args(["--backend", "llama.cpp", "--threads", "2"])
    assert (args.backend, args.threads) == ("llama.cpp", 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--backend", "vllm"])
