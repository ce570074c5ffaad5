"""Configuration of trained draft heads and the identity of the base (target) model they belong to.

Heads are only valid on the exact model they were trained on: their inputs are that model's hidden states
and their outputs go through its LM head. :func:`base_model_identity` fingerprints the base model (sizes plus
a SHA-256 of its input embedding matrix, which quantization leaves untouched), and :meth:`HeadsConfig.check_base`
refuses any other model with a clear error.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["HeadsConfig", "HeadsMismatchError", "base_model_identity", "METHODS", "CONFIG_FILE"]

#: Head methods draftwise trains and runs.
METHODS = ("medusa", "eagle")
#: File name of the JSON config inside a heads directory.
CONFIG_FILE = "heads_config.json"


class HeadsMismatchError(ValueError):
    """Heads loaded onto a base model other than the one they were trained on, or an unreadable config."""


@dataclass(frozen=True)
class HeadsConfig:
    """What a heads directory holds.

    Attributes:
        method: ``"medusa"`` or ``"eagle"``.
        hidden_size: the base model's hidden size H (features are ``[..., H]``).
        vocab_size: width of the base model's LM head (logits are ``[..., vocab_size]``).
        base_model: the base model's name as the user gave it (informational).
        base_fingerprint: :func:`base_model_identity` of the base model; checked on load.
        num_heads: Medusa only: number of heads (head i predicts the token i + 2 positions after the last
            fed position, i.e. draft depth i + 1 counted from the bonus token).
        num_layers: residual blocks per Medusa head, or decoder layers of the EAGLE head (1).
        eagle: EAGLE only: the decoder layer's sizes (``intermediate_size``, ``num_attention_heads``,
            ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``rope_theta``, ``attention_bias``).
        training: free-form record of how the heads were trained (steps, data, wall time, accuracy).
    """

    method: str
    hidden_size: int
    vocab_size: int
    base_model: str
    base_fingerprint: str
    num_heads: int = 1
    num_layers: int = 1
    eagle: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"heads method must be one of {METHODS}, got {self.method!r}")
        if self.hidden_size < 1 or self.vocab_size < 1 or self.num_heads < 1 or self.num_layers < 1:
            raise ValueError("hidden_size, vocab_size, num_heads and num_layers must be >= 1")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json_file(cls, path: str | Path) -> "HeadsConfig":
        """Read ``heads_config.json``.

        Raises:
            HeadsMismatchError: missing file, invalid JSON or fields.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**data)
        except FileNotFoundError as exc:
            raise HeadsMismatchError(f"{path} not found: not a draftwise heads directory") from exc
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise HeadsMismatchError(f"{path}: invalid heads config: {exc}") from exc

    def check_base(self, fingerprint: str, name: str = "the target") -> None:
        """Raise :class:`HeadsMismatchError` unless ``fingerprint`` is this config's base model's."""
        if fingerprint != self.base_fingerprint:
            raise HeadsMismatchError(
                f"these {self.method} heads were trained on {self.base_model!r} (fingerprint "
                f"{self.base_fingerprint}) and cannot run on {name} (fingerprint {fingerprint}); train heads for "
                "this model with: draftwise train-heads"
            )


@torch.no_grad()
def base_model_identity(model: torch.nn.Module) -> str:
    """Fingerprint of a ``transformers`` causal LM: ``"<layers>x<hidden>x<vocab>-<sha256[:16]>"`` over its input
    embedding matrix as float32 bytes (the same for fp32 and int8-quantized loads of one model)."""
    embedding = model.get_input_embeddings().weight.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(embedding.numpy().tobytes()).hexdigest()[:16]
    layers = int(getattr(model.config, "num_hidden_layers", 0))
    return f"{layers}x{embedding.shape[1]}x{embedding.shape[0]}-{digest}"
