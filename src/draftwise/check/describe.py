"""What a model is, read without loading its weights: parameter count, attention shape, vocabulary width,
context length and tokenizer.

- GGUF files (and pulled registry models): the header only (:func:`draftwise.check.gguf_header.read_gguf_header`);
  the parameter count is the sum of the stored tensors' elements.
- Hugging Face directories and hub ids: ``config.json`` and the tokenizer files; the parameter count comes
  from instantiating the architecture on PyTorch's ``meta`` device (no memory, exact, tied weights counted
  once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from draftwise.check.gguf_header import GGUFFormatError, GGUFHeader, read_gguf_header
from draftwise.check.tokenizer import (
    GGUF_TOKENIZER_KEYS,
    TokenizerInfo,
    tokenizer_info_from_gguf,
    tokenizer_info_from_hf,
)
from draftwise.models.loading import ModelLoadError, resolve_model

__all__ = ["ModelDescription", "describe_model", "describe_gguf", "describe_hf"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelDescription:
    """A model's size and shape, as far as memory and tokenizer checks need them.

    Attributes:
        name: what the user asked for (registry name, path or hub id).
        source: the resolved file, directory or hub id.
        format: ``"gguf"`` or ``"hf"``.
        architecture: e.g. ``"llama"``, ``"qwen2"``.
        num_parameters: parameters as loaded (tied embeddings counted once).
        vocab_width: embedding rows, which is the logits width (may exceed the tokenizer's table).
        kv_heads: key/value heads of each layer (0 for a layer without attention).
        key_dim, value_dim: per-head key and value sizes (elements).
        context_length: the model's context length in tokens (None when the config does not say).
        tokenizer: the model's tokenizer table and special tokens.
    """

    name: str
    source: str
    format: str
    architecture: str
    num_parameters: int
    vocab_width: int
    kv_heads: tuple[int, ...]
    key_dim: int
    value_dim: int
    context_length: int | None
    tokenizer: TokenizerInfo

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.kv_heads)

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of the weights at ``dtype_bytes`` bytes per parameter (4 for fp32, 2 for bf16/fp16)."""
        return self.num_parameters * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV-cache bytes one token takes: keys and values of every layer,
        ``sum over layers of kv_heads * (key_dim + value_dim) * dtype_bytes``; for equal key and value sizes
        this is ``2 * layers * kv_heads * head_dim * dtype_bytes``. Sliding-window layers are counted as full
        attention (an upper bound)."""
        return sum(self.kv_heads) * (self.key_dim + self.value_dim) * dtype_bytes

    def to_dict(self) -> dict:
        """JSON-ready summary (the token table is left out)."""
        return {"name": self.name, "source": self.source, "format": self.format,
                "architecture": self.architecture, "num_parameters": self.num_parameters,
                "vocab_width": self.vocab_width, "tokenizer_tokens": len(self.tokenizer.tokens),
                "num_layers": self.num_layers, "kv_heads": list(self.kv_heads), "key_dim": self.key_dim,
                "value_dim": self.value_dim, "context_length": self.context_length}


def describe_model(spec: str) -> ModelDescription:
    """Describe a registry name, ``.gguf`` file, Hugging Face directory or hub id without loading weights.

    Raises:
        ModelLoadError: a registry model that is not pulled, a missing file, or unreadable config/tokenizer.
    """
    source = resolve_model(spec)
    local = Path(source)
    try:
        if source.endswith(".gguf"):
            return describe_gguf(local, name=spec)
        if not local.is_dir() and (local.exists() or local.is_absolute() or source.startswith(".")):
            raise ModelLoadError(f"model not found: {source} (expected a .gguf file, a model directory or a hub id)")
        return describe_hf(source, name=spec)  # a directory, or a hub id such as Qwen/Qwen2.5-0.5B
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not read model {spec!r}: {exc}") from exc


def _wanted_gguf_key(key: str) -> bool:
    """Every small metadata value plus the tokenizer fields the check compares (merges and scores skipped)."""
    return key in GGUF_TOKENIZER_KEYS or not key.startswith("tokenizer.")


def _per_layer(value, layers: int) -> tuple[int, ...]:
    """A GGUF head count: one number for all layers, or a list with one per layer."""
    if isinstance(value, list):
        if len(value) != layers:
            raise ValueError(f"per-layer head counts list {len(value)} layers, expected {layers}")
        return tuple(int(v) for v in value)
    return (int(value),) * layers


def describe_gguf(path: Path, name: str | None = None) -> ModelDescription:
    """Describe a GGUF model from its header (about a second for a 150k-token vocabulary).

    Raises:
        FileNotFoundError: no such file. ValueError (GGUFFormatError): not a readable GGUF model.
    """
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    header = read_gguf_header(path, _wanted_gguf_key)
    meta = header.metadata
    arch = str(meta.get("general.architecture", ""))
    if not arch:
        raise GGUFFormatError(f"{path}: no general.architecture in the GGUF metadata")

    def arch_value(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    layers = int(arch_value("block_count"))
    heads = _per_layer(arch_value("attention.head_count"), layers)
    kv_heads = _per_layer(arch_value("attention.head_count_kv", arch_value("attention.head_count")), layers)
    head_dim = int(arch_value("embedding_length")) // max(heads)
    tokenizer = tokenizer_info_from_gguf(header, str(path))
    context = arch_value("context_length")
    return ModelDescription(
        name=name or str(path), source=str(path), format="gguf", architecture=arch,
        num_parameters=header.num_parameters, vocab_width=_gguf_vocab_width(header, arch, tokenizer),
        kv_heads=kv_heads, key_dim=int(arch_value("attention.key_length", head_dim)),
        value_dim=int(arch_value("attention.value_length", head_dim)),
        context_length=None if context is None else int(context), tokenizer=tokenizer,
    )


def _gguf_vocab_width(header: GGUFHeader, arch: str, tokenizer: TokenizerInfo) -> int:
    """Embedding rows: the token embedding's second GGUF dimension, else the metadata's vocabulary size."""
    shape = header.tensor_shapes.get("token_embd.weight")
    if shape and len(shape) == 2:
        return int(shape[1])
    tokens = header.metadata.get("tokenizer.ggml.tokens") or tokenizer.tokens
    return int(header.metadata.get(f"{arch}.vocab_size", len(tokens)))


def describe_hf(source: str, name: str | None = None) -> ModelDescription:
    """Describe a Hugging Face directory or hub id from its config and tokenizer.

    Raises:
        OSError: missing or unreachable files. ValueError: an architecture transformers does not know.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(source)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    num_parameters = sum(p.numel() for p in model.parameters())
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    context = getattr(text, "max_position_embeddings", None)
    return ModelDescription(
        name=name or source, source=source, format="hf", architecture=str(text.model_type),
        num_parameters=int(num_parameters), vocab_width=int(model.get_output_embeddings().weight.shape[0]),
        kv_heads=(kv_heads,) * int(text.num_hidden_layers), key_dim=head_dim, value_dim=head_dim,
        context_length=None if context is None else int(context),
        tokenizer=tokenizer_info_from_hf(AutoTokenizer.from_pretrained(source)),
    )
