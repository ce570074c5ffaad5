"""Int8 linear layers and row-wise attention: accuracy, row independence, model surgery, loading."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from draftwise.backends.kernels import OneDnnInt8Linear  # the self-test may pick it: same bits as Int8Linear
from draftwise.backends.attention import ROWWISE_ATTENTION, register_rowwise_attention, use_rowwise_attention
from draftwise.backends.quantization import (
    Int8Linear,
    QuantizationError,
    int8_kernels_available,
    parse_quantization,
    quantize_model,
    quantize_weight_rows,
)

pytestmark = pytest.mark.skipif(not int8_kernels_available(), reason="torch build without fbgemm int8 kernels")


def tiny_qwen2(seed: int = 0, sliding_window: int | None = None):
    """A tiny random Qwen2 (q/k/v biases, grouped-query attention, tied embeddings), fp32 eager."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from draftwise.backends.torch_backend import TorchCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True,
        use_sliding_window=sliding_window is not None, sliding_window=sliding_window, max_window_layers=0,
        attn_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # random biases (the initializer zeroes them), so the bias path is exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.3)
    return TorchCausalLM(model, name=f"tiny-qwen2-{seed}")


# ------------------------------------------------------------------------------------------- Int8Linear
@pytest.mark.parametrize("shape", [(64, 48), (37, 100), (300, 129)])
def test_int8_linear_is_close_to_float(shape):
    torch.manual_seed(0)
    linear = nn.Linear(shape[1], shape[0])
    x = torch.randn(5, 3, shape[1])
    quantized = Int8Linear.from_linear(linear)
    y, ref = quantized(x), linear(x)
    assert y.shape == ref.shape == (5, 3, shape[0]) and y.dtype == torch.float32
    # 8-bit weights and 7-bit activations: error about 1% of the output scale
    assert (y - ref).norm() / ref.norm() < 0.02


def test_int8_linear_rows_are_independent_bit_for_bit():
    torch.manual_seed(1)
    for out_features, in_features in [(48, 48), (200, 64), (33, 1000)]:
        quantized = Int8Linear(torch.randn(out_features, in_features), torch.randn(out_features))
        x = torch.randn(17, in_features) * torch.logspace(-3, 3, 17)[:, None]  # very different row scales
        alone = torch.cat([quantized(x[i:i + 1]) for i in range(17)])
        for m in range(1, 18):
            assert torch.equal(quantized(x[:m]), alone[:m]), (out_features, in_features, m)


def test_int8_linear_row_scale_is_the_inf_norm_bit_for_bit():
    """The row scale reads max |x| as ``abs().amax`` (faster); the outputs equal those of the inf-norm it
    replaced, on rows of very different scales, zero rows, signed zeros and infinities."""
    from draftwise.backends.quantization import _ACT_HALF_RANGE, _MIN_ROW_MAX, row_grid_scale

    torch.manual_seed(3)
    x = torch.randn(9, 1000) * torch.logspace(-6, 6, 9)[:, None]
    x[2] = 0.0
    x[3, :5] = -0.0
    x[4, 7] = float("-inf")
    norm = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, keepdim=True)
    assert torch.equal(x.abs().amax(dim=1, keepdim=True), norm)
    assert torch.equal(row_grid_scale(x), _ACT_HALF_RANGE / norm.clamp_min(_MIN_ROW_MAX))
    quantized = Int8Linear(torch.randn(40, 1000), torch.randn(40))
    finite = x[torch.isfinite(x).all(dim=1)]
    to_grid = _ACT_HALF_RANGE / torch.linalg.vector_norm(finite, ord=float("inf"), dim=1, keepdim=True).clamp_min(
        _MIN_ROW_MAX)
    reference = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        finite * to_grid, 1.0, 64, quantized._packed).div_(to_grid).add_(quantized.bias)
    assert torch.equal(quantized(finite), reference)


def test_int8_linear_zero_rows_bias_and_dtype():
    quantized = Int8Linear(torch.randn(8, 16), torch.arange(8.0))
    assert torch.equal(quantized(torch.zeros(2, 16)), torch.arange(8.0).expand(2, 8))
    y = quantized(torch.randn(3, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 8)
    assert quantized.weight.shape == (8, 16) and quantized.weight.device.type == "meta"


def test_weight_rows_quantization():
    weight = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [2.0, 1.0, -0.5]])
    q, scales = quantize_weight_rows(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert scales[1] == 1.0 and torch.equal(q[1], torch.zeros(3, dtype=torch.int8))
    torch.testing.assert_close(q.double() * scales[:, None], weight.double(), atol=2.0 / 127, rtol=0)


# ------------------------------------------------------------------------------------------- model surgery
def test_quantize_model_replaces_every_linear_and_keeps_the_embedding():
    backend = tiny_qwen2()
    model = backend.model
    embedding = model.model.embed_tokens.weight.detach().clone()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    quantize_model(model, "int8")
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert model.config._attn_implementation == ROWWISE_ATTENTION
    assert model.get_output_embeddings().weight.shape == (128, 64)


def test_quantized_model_survives_deepcopy():
    backend = tiny_llama(seed=4)
    quantize_model(backend.model, "int8")
    clone = copy.deepcopy(backend.model)
    ids = torch.tensor([[1, 5, 9, 13]])
    assert torch.equal(backend.model(input_ids=ids).logits, clone(input_ids=ids).logits)


def test_quantization_mode_errors():
    assert parse_quantization(None) == "none" and parse_quantization("INT8") == "int8"
    with pytest.raises(ValueError, match="unknown quantization"):
        parse_quantization("int4")
    backend = tiny_llama(seed=4)
    assert quantize_model(backend.model, "none") is backend.model
    assert isinstance(backend.model.model.layers[0].mlp.up_proj, nn.Linear)
    with pytest.raises(QuantizationError, match="CPU only"):
        quantize_model(copy.deepcopy(backend.model).to("meta"), "int8")


# ------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_rowwise_attention_matches_eager(sliding_window):
    """Same maths as transformers' eager attention (GQA, biases, cache, sliding window), up to rounding."""
    eager = tiny_qwen2(seed=2, sliding_window=sliding_window)
    rowwise = tiny_qwen2(seed=2, sliding_window=sliding_window)
    use_rowwise_attention(rowwise.model)
    tokens = [(3 + 7 * i) % 128 for i in range(20)]
    for backend in (eager, rowwise):
        backend.reset()
    ref = torch.cat([eager.forward(tokens[:12]).logits, eager.forward(tokens[12:]).logits])
    out = torch.cat([rowwise.forward(tokens[:12]).logits, rowwise.forward(tokens[12:]).logits])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_rowwise_attention_registration_is_idempotent_and_rejects_padding():
    assert register_rowwise_attention() == register_rowwise_attention() == ROWWISE_ATTENTION
    backend = tiny_llama(seed=6)
    use_rowwise_attention(backend.model)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    backend.model(input_ids=ids, attention_mask=torch.ones_like(ids))  # unpadded batch: fine
    with pytest.raises(NotImplementedError, match="unpadded"):
        backend.model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))


# ------------------------------------------------------------------------------------------- loading
def test_load_model_int8_on_stories(draftwise_home, stories_path, stories):
    from draftwise.models.loading import load_model

    loaded = load_model(str(stories_path), device="cpu", quantization="int8")
    assert "+int8" in loaded.backend.name and loaded.name == str(stories_path)
    assert isinstance(loaded.backend.model.lm_head, (Int8Linear, OneDnnInt8Linear))  # same bits
    tokens = stories.encode("Once upon a time, there was a little girl named Lily. She loved to play")
    stories.backend.reset()
    loaded.backend.reset()
    ref = stories.backend.forward(tokens).logits
    out = loaded.backend.forward(tokens).logits
    agreement = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    assert agreement >= 0.85, agreement  # int8 changes the model slightly; see docs/cpu_int8.md
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(str(stories_path), device="cpu", quantization="fp4")


def test_costs_command_json(draftwise_home, stories_path, capsys):
    import json

    from draftwise.cli import main

    code = main(["costs", str(stories_path), "--quantization", "int8", "--ks", "2,4", "--repeats", "1",
                 "--context", "8", "--draft", str(stories_path), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["quantization"] == "int8" and result["context_len"] == 8
    assert sorted(result["seconds"]) == ["1", "2", "4"] and result["relative"]["1"] == 1.0
    assert result["cost_ratio_c"] > 0
    assert "draft_stop_thresholds" not in result  # k = 3 not measured: no curve to derive them from
    assert main(["costs", str(stories_path), "--quantization", "int8", "--ks", "1,2,3,4", "--repeats", "1",
                 "--context", "8", "--draft", str(stories_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["draft_stop_thresholds"]) == 2 and min(result["draft_stop_thresholds"]) > 0
    assert main(["costs", str(stories_path), "--ks", "0"]) == 2  # one-line user error
