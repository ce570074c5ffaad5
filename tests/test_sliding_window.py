"""Tree passes build their own attention mask; on a model whose sliding window is shorter than its context they
are refused instead of silently attending past the window. Windowed caches are not exported either."""

from __future__ import annotations

import pytest
import torch


def tiny_qwen2_backend(sliding_window: int | None, max_context: int = 256):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from draftwise.backends.torch_backend import TorchCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_context, use_sliding_window=sliding_window is not None,
        sliding_window=sliding_window, max_window_layers=0, attn_implementation="eager",
    )
    return TorchCausalLM(Qwen2ForCausalLM(config).eval(), name="tiny-qwen2")


def test_sliding_window_model_refuses_trees_and_export():
    backend = tiny_qwen2_backend(sliding_window=16)
    assert backend.sliding_window == 16
    assert not backend.supports_tree and not backend.supports_cache_export
    backend.forward([1, 2, 3])
    with pytest.raises(NotImplementedError, match="sliding window"):
        backend.forward_tree([4, 5, 6], [-1, -1])
    with pytest.raises(NotImplementedError):
        backend.export_cache()


@pytest.mark.parametrize("window", [None, 256])
def test_full_attention_or_window_covering_the_context_keeps_trees(window):
    backend = tiny_qwen2_backend(sliding_window=window)
    assert backend.supports_tree
    backend.forward([1, 2, 3])
    assert backend.forward_tree([4, 5, 6], [-1, -1]).logits.shape == (3, 64)
