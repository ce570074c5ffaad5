"""Shared fixtures: the real stories260K model (../shared/models) and tiny random Llama models.

The whole session runs with ``DRAFTWISE_HOME`` pointing at a temporary directory (set in
:func:`pytest_configure`, before any test module is collected, and removed at the end), so calibration,
kernel choices, dequantized copies and token maps never land in the user's cache. Tests that need models
pulled by ``draftwise pull`` read them from the user's real models directory, captured below before the
override: :data:`USER_MODELS_DIR` and :func:`pulled_model_path`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from draftwise.models.pull import MODEL_REGISTRY, models_dir
from draftwise.files import draftwise_home as resolved_draftwise_home

REPO = Path(__file__).resolve().parents[1]

# The user's own directories, resolved before pytest_configure points DRAFTWISE_HOME elsewhere.
USER_DRAFTWISE_HOME = resolved_draftwise_home()
USER_MODELS_DIR = models_dir()

_session: dict[str, str | None] = {}


long_test = pytest.mark.skipif(
    not os.environ.get("DRAFTWISE_LONG_TESTS"),
    reason="takes minutes of CPU (a real model's whole load, extension builds): set DRAFTWISE_LONG_TESTS=1")
"""A test outside the default run's 10-minute budget, run with ``DRAFTWISE_LONG_TESTS=1``."""


def pulled_model_path(name: str) -> Path:
    """Where ``draftwise pull NAME`` put registry model ``name`` in the user's models directory (it need not
    exist; tests only read it)."""
    return USER_MODELS_DIR / MODEL_REGISTRY[name].filename


def session_draftwise_home() -> Path:
    """The temporary ``DRAFTWISE_HOME`` of this test session."""
    return Path(_session["home"])


def pytest_configure(config) -> None:
    """Point ``DRAFTWISE_HOME`` at a fresh temporary directory for the whole session (subprocesses inherit it)."""
    _session["previous"] = os.environ.get("DRAFTWISE_HOME")
    _session["home"] = tempfile.mkdtemp(prefix="draftwise-test-home-")
    os.environ["DRAFTWISE_HOME"] = _session["home"]


def pytest_unconfigure(config) -> None:
    """Restore the caller's ``DRAFTWISE_HOME`` and remove the session's."""
    if "home" not in _session:
        return
    previous = _session.pop("previous")
    if previous is None:
        os.environ.pop("DRAFTWISE_HOME", None)
    else:
        os.environ["DRAFTWISE_HOME"] = previous
    shutil.rmtree(_session.pop("home"), ignore_errors=True)

# The test models are tiny: one intra-op thread is faster than two and does not collapse when the CPU is
# shared with other work (two OpenMP threads on a busy 2-core machine ran 10-50x slower).
torch.set_num_threads(1)
STORIES = Path(os.environ.get("DRAFTWISE_SHARED", REPO.parent / "shared")) / "models/stories260K/stories260K.gguf"


@pytest.fixture(scope="session")
def draftwise_home() -> Path:
    """The session's temporary DRAFTWISE_HOME (dequantization, calibration and kernel caches)."""
    return session_draftwise_home()


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


def first_layer_copy(model):
    """A copy of a transformers Llama ``model`` keeping only its first decoder layer: a real, imperfect draft
    for that model (same embeddings and head)."""
    import copy

    weak = copy.deepcopy(model)
    weak.model.layers = weak.model.layers[:1]
    weak.config.num_hidden_layers = 1
    return weak


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
