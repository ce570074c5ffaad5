"""Memory checks: sizes parse, descriptions read before loading match the loaded models (parameters, KV
cache bytes per token), the pair total against a budget, and the fast GGUF header reader."""

from __future__ import annotations

import pytest
import torch

from draftwise.check.describe import describe_gguf, describe_hf, describe_model
from draftwise.check.gguf_header import GGUFFormatError, read_gguf_header
from draftwise.check.memory import estimate_memory
from draftwise.units import format_bytes, parse_bytes
from draftwise.models.loading import ModelLoadError
from test_check_support import tiny_pair_dirs

GIB = 2**30


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * GIB), ("24G", 24 * GIB), ("24 gib", 24 * GIB), ("24GB", 24 * 10**9), ("1.5GiB", 3 * GIB // 2),
    ("512MiB", 512 * 2**20), ("100", 100), ("100B", 100), ("2KB", 2000), ("2Ki", 2048), ("0", 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1GiB", "24XB", "GiB", "1.2.3G"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0.5", "0.9B", "0.0001KB"])
def test_parse_bytes_rejects_a_size_under_one_byte(text):
    """Found by a new-user test: ``--kv-cache-memory 0.5`` turned the prefix cache off without a word."""
    with pytest.raises(ValueError, match="less than one byte"):
        parse_bytes(text)
    assert parse_bytes("0.0") == 0


def test_format_bytes():
    assert [format_bytes(v) for v in (512, 48 * 1024, int(1.5 * GIB), None)] == ["512 B", "48.0 KiB", "1.50 GiB", "-"]


def _cache_bytes_per_token(backend, num_tokens: int) -> float:
    backend.reset()
    backend.forward(list(range(3, 3 + num_tokens)))
    layers = backend._cache.layers
    total = sum(layer.keys.nbytes + layer.values.nbytes for layer in layers)
    backend.reset()
    return total / num_tokens


def test_gguf_description_matches_the_loaded_model(stories, stories_path):
    """Parameters and KV bytes per token from the header alone equal what the loaded fp32 model holds."""
    described = describe_gguf(stories_path)
    model = stories.backend.model
    assert described.num_parameters == sum(p.numel() for p in model.parameters()) == 292_800
    assert described.vocab_width == stories.backend.vocab_size == 512
    assert described.context_length == 2048
    assert described.kv_bytes_per_token(4) == 2 * 5 * 4 * 8 * 4  # 2 x layers x kv heads x head dim x fp32
    assert described.kv_bytes_per_token(4) == _cache_bytes_per_token(stories.backend, 10)


def test_hf_description_matches_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny_pair_dirs(tmp_path, padded_width=128)
    described = describe_hf(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    assert described.num_parameters == sum(p.numel() for p in model.parameters())
    assert described.vocab_width == 128 and len(described.tokenizer.tokens) == 96
    assert described.kv_heads == (2, 2) and described.key_dim == 12 and described.context_length == 256
    from draftwise.backends.torch_backend import TorchCausalLM

    assert described.kv_bytes_per_token(4) == _cache_bytes_per_token(TorchCausalLM(model), 7) == 2 * 2 * 2 * 12 * 4


def test_estimate_totals_and_budget(stories_path):
    model = describe_gguf(stories_path)
    fits = estimate_memory(model, model, dtype=torch.bfloat16, context_len=1000, num_seqs=3, budget=10 * 2**20)
    weights, kv_token = 292_800 * 2, 2 * 5 * 4 * 8 * 2
    assert fits.bytes_per_param == 2 and fits.dtype == "bfloat16"
    assert fits.target_weights == fits.draft_weights == weights
    assert fits.target_kv == fits.draft_kv == kv_token * 3000
    assert fits.draft_total == weights + kv_token * 3000
    assert fits.total == 2 * (weights + kv_token * 3000)
    assert fits.fits and fits.headroom == 10 * 2**20 - fits.total
    short = estimate_memory(model, model, dtype=torch.float32, context_len=2048, budget=1024)
    assert short.fits is False and short.headroom < 0 and "does not fit in 1.00 KiB" in short.summary()
    unknown = estimate_memory(model, model, dtype=torch.float32, context_len=2048)
    assert unknown.fits is None and unknown.headroom is None


def test_estimate_rejects_bad_sizes(stories_path):
    model = describe_gguf(stories_path)
    with pytest.raises(ValueError, match=">= 1"):
        estimate_memory(model, model, dtype=torch.float32, context_len=0)


def test_gguf_header_reader_agrees_with_gguf_package(stories_path):
    from gguf import GGUFReader

    reference = GGUFReader(str(stories_path))
    header = read_gguf_header(stories_path)
    assert set(header.metadata) == {k for k in reference.fields if not k.startswith("GGUF.")}
    for key in ("general.architecture", "llama.block_count", "tokenizer.ggml.tokens", "tokenizer.ggml.scores"):
        assert header.metadata[key] == pytest.approx(reference.fields[key].contents())
    assert header.tensor_shapes == {t.name: tuple(int(d) for d in t.shape) for t in reference.tensors}
    assert header.num_parameters == sum(int(t.n_elements) for t in reference.tensors)
    only = read_gguf_header(stories_path, ["llama.block_count"])
    assert only.metadata == {"llama.block_count": 5}


def test_gguf_header_reader_rejects_other_files(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all, just text")
    with pytest.raises(GGUFFormatError, match="bad magic"):
        read_gguf_header(bad)
    with pytest.raises(ModelLoadError, match="could not read model"):
        describe_model(str(bad))
    with pytest.raises(ModelLoadError, match="not found"):
        describe_model(str(tmp_path / "missing.gguf"))


def test_a_gpu_draft_is_counted_in_its_own_dtype(stories_path):
    """On a GPU the draft runs in bf16 by default and the target in fp32 (docs/gpu.md): the draft's weights and
    cache are counted at 2 bytes, the target's at 4."""
    model = describe_gguf(stories_path)
    both = estimate_memory(model, model, dtype=torch.float32, context_len=100)
    mixed = estimate_memory(model, model, dtype=torch.float32, draft_dtype=torch.bfloat16, context_len=100)
    assert mixed.draft_dtype == "bfloat16" and mixed.dtype == "float32"
    assert mixed.target_weights == both.target_weights and mixed.draft_weights * 2 == both.draft_weights
    assert mixed.draft_kv * 2 == both.draft_kv and mixed.total < both.total


def test_check_counts_a_gpu_draft_in_bf16(monkeypatch, stories_path):
    """``check --device cuda`` (CUDA faked; nothing is loaded by the static check) reports the draft in bf16."""
    from draftwise.check.runner import CheckSettings, static_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = describe_gguf(stories_path)
    report = static_check(model, model, CheckSettings(device="cuda", memory_budget=2**30))
    assert report.settings["dtype"] == "float32" and report.settings["draft_dtype"] == "bfloat16"
    assert report.memory.draft_weights * 2 == report.memory.target_weights
