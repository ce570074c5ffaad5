"""The vLLM export: file layout, weight names and shapes, config fields, and (where an independent implementation
exists here) that the exported files compute what the draftwise heads compute.

vLLM cannot run here; the Medusa check re-implements vLLM's ``ResidualBlock`` (x + SiLU(layer(x)) per layer)
and LM head, and the EAGLE check loads the exported ``config.json`` into ``transformers``' own Llama decoder
layer (vLLM's ``llama_eagle`` uses vLLM's Llama layer with the input norm of layer 0 removed).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftwise.heads.config import HeadsConfig
from draftwise.heads.eagle import EagleHead, eagle_layer_config
from draftwise.heads.export import VLLM_WEIGHTS_FILE, export_vllm
from draftwise.heads.medusa import MedusaHeads


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return module


def _config(model, method: str, num_heads: int = 1, num_layers: int = 1) -> HeadsConfig:
    return HeadsConfig(method=method, hidden_size=64, vocab_size=512, base_model="stories260K", base_fingerprint="fp",
                       num_heads=num_heads, num_layers=num_layers,
                       eagle=eagle_layer_config(model.config) if method == "eagle" else {})


def _read(directory):
    return json.loads((directory / "config.json").read_text()), load_file(str(directory / VLLM_WEIGHTS_FILE))


@pytest.mark.parametrize("shared", [True, False])
def test_medusa_export_layout_and_outputs(stories, tmp_path, shared):
    model = stories.backend.model
    heads = _randomize(MedusaHeads(64, num_heads=3, num_layers=2), seed=0)
    result = export_vllm(heads, _config(model, "medusa", 3, 2), model, tmp_path, dtype="fp32", shared_lm_head=shared)
    config, tensors = _read(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["hidden_size"], config["vocab_size"], config["truncated_vocab_size"]) == (64, 512, 512)
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, 2)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is shared
    # vLLM's MedusaConfig.from_pretrained renames every key containing "num" + "heads"/"layers"
    assert [k for k in config if "num" in k] == ["num_heads", "num_hidden_layers"]
    lm_heads = ["lm_heads.0.weight"] if shared else [f"lm_heads.{i}.weight" for i in range(3)]
    blocks = [f"blocks.{i}.layers.{j}.{p}" for i in range(3) for j in range(2) for p in ("weight", "bias")]
    assert sorted(tensors) == sorted(blocks + lm_heads)
    assert tensors["blocks.1.layers.1.weight"].shape == (64, 64) and tensors["blocks.1.layers.1.bias"].shape == (64,)
    assert all(tensors[name].shape == (512, 64) for name in lm_heads)
    assert result.weights_bytes == (tmp_path / VLLM_WEIGHTS_FILE).stat().st_size
    # vLLM's Medusa: per head, x = x + SiLU(layer(x)) per layer, then its LM head
    hidden = torch.randn(5, 64)
    with torch.no_grad():
        ours = F.linear(heads(hidden), model.get_output_embeddings().weight)  # [heads, 5, V]
    for i in range(3):
        x = hidden
        for j in range(2):
            x = x + F.silu(F.linear(x, tensors[f"blocks.{i}.layers.{j}.weight"], tensors[f"blocks.{i}.layers.{j}.bias"]))
        vllm_logits = F.linear(x, tensors[lm_heads[0] if shared else lm_heads[i]])
        assert torch.allclose(vllm_logits, ours[i], atol=1e-5)


def test_medusa_export_dtype(stories, tmp_path):
    model = stories.backend.model
    export_vllm(MedusaHeads(64, 2), _config(model, "medusa", 2), model, tmp_path)  # default bf16
    config, tensors = _read(tmp_path)
    assert config["torch_dtype"] == "bfloat16" and all(t.dtype == torch.bfloat16 for t in tensors.values())
    with pytest.raises(ValueError, match="export dtype"):
        export_vllm(MedusaHeads(64, 2), _config(model, "medusa", 2), model, tmp_path, dtype="int4")


def test_eagle_export_layout(stories, tmp_path):
    model = stories.backend.model
    head = _randomize(EagleHead(64, eagle_layer_config(model.config)), seed=1)
    with torch.no_grad():
        head.fc.bias.zero_()
    export_vllm(head, _config(model, "eagle"), model, tmp_path)
    config, tensors = _read(tmp_path)
    expected = {"fc.weight": (64, 128), "layers.0.self_attn.q_proj.weight": (64, 64),
                "layers.0.self_attn.k_proj.weight": (32, 64), "layers.0.self_attn.v_proj.weight": (32, 64),
                "layers.0.self_attn.o_proj.weight": (64, 64), "layers.0.mlp.gate_proj.weight": (172, 64),
                "layers.0.mlp.up_proj.weight": (172, 64), "layers.0.mlp.down_proj.weight": (64, 172),
                "layers.0.post_attention_layernorm.weight": (64,)}
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected  # zero fc.bias left out
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and "eagle_fc_bias" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 8)
    assert config["vocab_size"] == 512 and config["rope_theta"] == 10000.0 and config["qkv_bias"] is False
    with torch.no_grad():
        head.fc.bias.fill_(0.5)
    export_vllm(head, _config(model, "eagle"), model, tmp_path / "bias", include_embeddings=True)
    config, tensors = _read(tmp_path / "bias")
    assert config["eagle_fc_bias"] is True and tensors["fc.bias"].shape == (64,)
    assert tensors["embed_tokens.weight"].shape == (512, 64)


def test_eagle_export_runs_as_a_llama_decoder_layer(stories, tmp_path):
    """transformers' LlamaDecoderLayer built from the exported config.json and weights (input norm removed, fc in
    front) computes the same next features as the draftwise head."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    model = stories.backend.model
    head = _randomize(EagleHead(64, eagle_layer_config(model.config)), seed=2)
    with torch.no_grad():
        head.fc.bias.zero_()
    export_vllm(head, _config(model, "eagle"), model, tmp_path, dtype="fp32")
    config = LlamaConfig.from_pretrained(str(tmp_path))
    config._attn_implementation = "eager"
    _, tensors = _read(tmp_path)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")})
    n = 7
    features, embeds, positions = torch.randn(n, 64), torch.randn(n, 64), torch.arange(3, 3 + n)
    with torch.no_grad():
        x = F.linear(torch.cat([embeds, features], dim=-1), tensors["fc.weight"])[None]  # [1, n, H]
        rope = LlamaRotaryEmbedding(config)(x, positions[None])
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=positions[None], position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        ours = head(features, embeds, positions)
    assert torch.allclose(out[0], ours, atol=1e-5)
