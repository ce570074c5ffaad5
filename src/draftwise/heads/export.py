"""Export trained heads in the layouts vLLM's ``medusa`` and ``eagle`` speculative methods load, so the same heads
can be served with ``vllm serve TARGET --speculative-config '{"method": "medusa"|"eagle", "model": DIR, ...}'``.

What vLLM reads (from its source: ``vllm/transformers_utils/configs/medusa.py``, ``model_executor/models/medusa.py``,
``transformers_utils/configs/eagle.py``, ``model_executor/models/llama_eagle.py``, ``config/speculative.py``,
``v1/spec_decode/eagle.py``; vLLM itself cannot run here, so this is checked for structure only):

Medusa (``MedusaModel``): ``config.json`` with ``model_type: "medusa"``, ``hidden_size``, ``vocab_size``,
``num_heads``, ``num_hidden_layers`` (residual blocks per head), ``truncated_vocab_size`` (= vocab_size: no token
map) and ``medusa_fc_bias: true`` (our blocks have biases); weights ``blocks.{i}.layers.{j}.weight`` ``[H, H]``,
``blocks.{i}.layers.{j}.bias`` ``[H]`` and the LM head. vLLM's Medusa does not borrow the target's LM head, so
the export carries a copy: one ``lm_heads.0.weight`` ``[V, H]`` with ``original_lm_head: true`` (every head uses
it, as draftwise does), or with ``shared_lm_head=False`` one copy per head (``lm_heads.{i}.weight``) for vLLM
releases without ``original_lm_head``. Its ``MedusaConfig.from_pretrained`` renames any key containing "num"
and "heads"/"layers", so the config holds no other such key.

EAGLE-1 (``EagleLlamaForCausalLM``): a one-layer Llama ``config.json`` (``architectures: ["LlamaForCausalLM"]``,
as the EAGLE-1 checkpoints vLLM tests with ship); for ``method: "eagle"`` vLLM wraps it in its ``EAGLEConfig``
and renames the architecture to ``EagleLlamaForCausalLM``. Weights ``fc.weight`` ``[H, 2H]`` (input
``cat(token embedding, feature)``, the order draftwise uses), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``. Layer 0 has no input
norm in vLLM either, and no final norm. Qwen2-style targets give the head q/k/v biases but no o_proj bias:
written as ``qkv_bias: true`` with ``attention_bias: false`` (vLLM's Llama layer then biases q/k/v only). The
target's embedding and LM head are shared by vLLM (pipeline parallel size 1), so they are not exported unless
``include_embeddings``. vLLM's V1 ``llama_eagle`` builds ``fc`` without a bias and skips an ``fc.bias`` weight,
so ``fc.bias`` is only written (with ``eagle_fc_bias: true``, the older loader's switch) when it is non-zero,
which draftwise training avoids by default.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from draftwise.heads.config import HeadsConfig
from draftwise.heads.eagle import EagleHead
from draftwise.heads.medusa import MedusaHeads

__all__ = ["EXPORT_FORMATS", "ExportResult", "export_vllm", "medusa_vllm_state", "medusa_vllm_config",
           "eagle_vllm_state", "eagle_vllm_config", "VLLM_WEIGHTS_FILE", "parse_export_dtype"]

logger = logging.getLogger(__name__)

#: Formats ``draftwise export-heads --format`` writes.
EXPORT_FORMATS = ("vllm",)
#: Weights file of an export (vLLM loads ``*.safetensors`` from the directory).
VLLM_WEIGHTS_FILE = "model.safetensors"
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


@dataclass(frozen=True)
class ExportResult:
    """An export directory: ``config.json`` plus ``model.safetensors``.

    Attributes:
        directory: the output directory.
        config: the JSON written to ``config.json``.
        tensors: weight name -> shape.
        weights_bytes: size of ``model.safetensors`` in bytes.
    """

    directory: Path
    config: dict
    tensors: dict[str, list[int]]
    weights_bytes: int


def parse_export_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or a torch dtype) to a torch dtype.

    Raises:
        ValueError: another name.
    """
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown export dtype {name!r}; choose bf16, fp16 or fp32")
    return _DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _provenance(config: HeadsConfig) -> dict:
    """What the export came from (kept under the ``draftwise`` key; vLLM ignores it)."""
    return {"method": config.method, "base_model": config.base_model, "base_fingerprint": config.base_fingerprint}


# ---------------------------------------------------------------------------------------------- Medusa
def medusa_vllm_state(heads: MedusaHeads, lm_head_weight: torch.Tensor, *, shared_lm_head: bool = True,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """vLLM Medusa weights: ``blocks.{i}.layers.{j}.{weight,bias}`` and ``lm_heads.0.weight`` (shared) or
    ``lm_heads.{i}.weight`` (one copy per head), all cast to ``dtype``.

    Args:
        lm_head_weight: ``[V, H]`` the target's LM head weight.
    """
    state = {}
    for i, block in enumerate(heads.blocks):
        for j, res in enumerate(block):
            state[f"blocks.{i}.layers.{j}.weight"] = res.linear.weight
            state[f"blocks.{i}.layers.{j}.bias"] = res.linear.bias
    for i in range(1 if shared_lm_head else heads.num_heads):
        state[f"lm_heads.{i}.weight"] = lm_head_weight
    return {name: t.detach().to("cpu", dtype, copy=True).contiguous() for name, t in state.items()}


def medusa_vllm_config(config: HeadsConfig, *, shared_lm_head: bool = True, dtype: torch.dtype = torch.bfloat16) -> dict:
    """vLLM ``MedusaConfig`` fields for ``config`` (see the module docstring)."""
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "truncated_vocab_size": config.vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": shared_lm_head,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": _dtype_name(dtype),
        "draftwise": _provenance(config),
    }


# ---------------------------------------------------------------------------------------------- EAGLE
def eagle_vllm_state(head: EagleHead, *, dtype: torch.dtype = torch.bfloat16,
                     embed_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """vLLM EAGLE-1 weights: the head's own names (``fc.*``, ``layers.0.*``), cast to ``dtype``; ``fc.bias`` only
    when non-zero; ``embed_tokens.weight`` when ``embed_weight`` (``[V, H]``) is given."""
    state = {name: t for name, t in head.state_dict().items()}
    if not bool(state["fc.bias"].any()):
        del state["fc.bias"]
    if embed_weight is not None:
        state["embed_tokens.weight"] = embed_weight
    return {name: t.detach().to("cpu", dtype, copy=True).contiguous() for name, t in state.items()}


def eagle_vllm_config(config: HeadsConfig, base_config, *, fc_bias: bool, dtype: torch.dtype = torch.bfloat16) -> dict:
    """A one-layer Llama config for vLLM's EAGLE-1 model (see the module docstring).

    Args:
        config: the heads' config (``config.eagle`` gives the layer's sizes).
        base_config: the target's ``transformers`` config (vocabulary, context length, special tokens).
        fc_bias: whether the export carries ``fc.bias``.
    """
    layer = config.eagle
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": layer["intermediate_size"],
        "num_attention_heads": layer["num_attention_heads"],
        "num_key_value_heads": layer["num_key_value_heads"],
        "head_dim": layer["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": layer["rms_norm_eps"],
        "rope_theta": layer["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": layer["rope_theta"]},
        "max_position_embeddings": int(getattr(base_config, "max_position_embeddings", 2048)),
        "vocab_size": int(base_config.vocab_size),
        "attention_bias": False,
        "qkv_bias": bool(layer["attention_bias"]),
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(dtype),
        "draftwise": _provenance(config),
    }
    if fc_bias:
        out["eagle_fc_bias"] = True
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(base_config, key, None) is not None:
            out[key] = getattr(base_config, key)
    return out


# ---------------------------------------------------------------------------------------------- writing
def export_vllm(heads: nn.Module, config: HeadsConfig, model: nn.Module, output_dir: str | Path, *,
                dtype: str | torch.dtype = "bf16", shared_lm_head: bool = True,
                include_embeddings: bool = False) -> ExportResult:
    """Write ``config.json`` and ``model.safetensors`` for vLLM into ``output_dir`` (created).

    Args:
        heads: :class:`MedusaHeads` or :class:`EagleHead` trained for ``model``.
        config: their :class:`HeadsConfig`.
        model: the target ``transformers`` model (LM head / embedding weights and config).
        dtype: weight dtype of the export (``"bf16"``, ``"fp16"``, ``"fp32"``).
        shared_lm_head: Medusa: one LM head copy with ``original_lm_head`` (else one per head).
        include_embeddings: EAGLE: also write ``embed_tokens.weight`` (needed only with pipeline parallelism).

    Raises:
        ValueError: unknown dtype, or heads that do not match ``config``.
    """
    torch_dtype = parse_export_dtype(dtype)
    output_dir = Path(output_dir)
    if config.method == "medusa":
        if not isinstance(heads, MedusaHeads):
            raise ValueError("medusa config with non-Medusa heads")
        lm_weight = model.get_output_embeddings().weight
        tensors = medusa_vllm_state(heads, lm_weight, shared_lm_head=shared_lm_head, dtype=torch_dtype)
        vllm_config = medusa_vllm_config(config, shared_lm_head=shared_lm_head, dtype=torch_dtype)
    else:
        if not isinstance(heads, EagleHead):
            raise ValueError("eagle config with a non-EAGLE head")
        embed = model.get_input_embeddings().weight if include_embeddings else None
        tensors = eagle_vllm_state(heads, dtype=torch_dtype, embed_weight=embed)
        vllm_config = eagle_vllm_config(config, model.config, fc_bias="fc.bias" in tensors, dtype=torch_dtype)
    output_dir.mkdir(parents=True, exist_ok=True)
    weights = output_dir / VLLM_WEIGHTS_FILE
    save_file(tensors, str(weights), metadata={"format": "pt"})
    (output_dir / "config.json").write_text(json.dumps(vllm_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    logger.info("exported %s heads for vLLM to %s (%d bytes of weights)", config.method, output_dir, weights.stat().st_size)
    return ExportResult(directory=output_dir, config=vllm_config,
                        tensors={name: list(t.shape) for name, t in tensors.items()},
                        weights_bytes=weights.stat().st_size)
