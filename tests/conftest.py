"""Shared fixtures: the real stories260K model (../shared/models) and tiny random Llama models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# The test models are tiny: one intra-op thread is faster than two and does not collapse when the CPU is
# shared with other work (two OpenMP threads on a busy 2-core machine ran 10-50x slower).
torch.set_num_threads(1)
STORIES = Path(os.environ.get("DRAFTWISE_SHARED", REPO.parent / "shared")) / "models/stories260K/stories260K.gguf"


@pytest.fixture(scope="session")
def draftwise_home(tmp_path_factory):
    """A private DRAFTWISE_HOME for the session (dequantization cache), restored afterwards."""
    home = tmp_path_factory.mktemp("draftwise_home")
    old = os.environ.get("DRAFTWISE_HOME")
    os.environ["DRAFTWISE_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("DRAFTWISE_HOME", None)
    else:
        os.environ["DRAFTWISE_HOME"] = old


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not STORIES.is_file():
        pytest.skip(f"stories260K not found at {STORIES} (set DRAFTWISE_SHARED to the shared folder)")
    return STORIES


@pytest.fixture(scope="session")
def stories(draftwise_home, stories_path):
    """stories260K loaded through the real GGUF path (fp32, CPU)."""
    from draftwise.models.loading import load_model

    return load_model(str(stories_path), device="cpu")


@pytest.fixture(scope="session")
def stories_draft(draftwise_home, stories_path):
    """A real derived draft: stories260K's first 2 of 5 layers (shares embedding and LM head)."""
    from draftwise.models.loading import derive_layer_draft, load_model

    return derive_layer_draft(load_model(str(stories_path), device="cpu"), num_layers=2)


def tiny_llama(seed: int, vocab: int = 96, layers: int = 2, max_context: int = 256):
    """A tiny random Llama (fp32, eager attention) with peaked logits, as a :class:`TorchCausalLM`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftwise.backends.torch_backend import TorchCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_context, initializer_range=0.3,
        attn_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval()
    return TorchCausalLM(model, name=f"tiny-llama-{seed}")
