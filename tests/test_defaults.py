"""Regression (issue 21, item 6): the commands' default is the fastest exact configuration the machine
supports: ``--quantization auto`` resolves to int8 on the lean runtime for a Llama-family model on a CPU with
the int8 kernels, and to none where int8 cannot run or the architecture is not one the lean runtime implements."""

from __future__ import annotations

import pytest
import torch

from draftwise.backends.quantization import int8_usable
from draftwise.cli import build_parser
from draftwise.models.loading import resolve_quantization

needs_int8 = pytest.mark.skipif(not int8_usable(), reason="no fbgemm int8 kernels in this torch build")


@pytest.mark.parametrize("command", [["generate", "hello"], ["serve", "m"], ["bench"], ["costs", "m"]])
def test_every_command_defaults_to_auto(command):
    assert build_parser().parse_args(command).quantization == "auto"


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2)


@needs_int8
def test_auto_is_int8_on_the_cpu_for_the_lean_architectures():
    assert resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config()) == "int8"


def test_auto_is_none_where_int8_does_not_run_or_the_lean_runtime_does_not_apply():
    from transformers import GPT2Config

    config = llama_config()
    assert resolve_quantization("auto", device="cuda", dtype=torch.float32, config=config) == "none"
    assert resolve_quantization("auto", device="cpu", dtype=torch.bfloat16, config=config) == "none"
    assert resolve_quantization("auto", device="cpu", dtype=torch.float32, config=GPT2Config()) == "none"
    assert resolve_quantization("none", device="cpu", dtype=torch.float32, config=config) == "none"


@needs_int8
def test_loading_with_the_default_runs_int8_on_the_lean_runtime(draftwise_home, stories_path):
    from draftwise.backends.lean import LeanCausalLM
    from draftwise.models.loading import load_model

    args = build_parser().parse_args(["generate", "--model", str(stories_path), "hello"])
    model = load_model(str(stories_path), quantization=args.quantization, runtime=args.runtime)
    assert isinstance(model.backend, LeanCausalLM) and model.quantization == "int8"
    explicit = load_model(str(stories_path), quantization="none", runtime=args.runtime)
    assert explicit.quantization == "none" and not isinstance(explicit.backend, LeanCausalLM)
