"""Saving and loading heads: ``heads.safetensors`` (head parameters only; the target's LM head and
embeddings are not copied) plus ``heads_config.json`` (:class:`HeadsConfig`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftwise.heads.config import CONFIG_FILE, HeadsConfig, HeadsMismatchError
from draftwise.heads.eagle import EagleHead
from draftwise.heads.medusa import MedusaHeads

__all__ = ["WEIGHTS_FILE", "build_heads", "load_heads", "save_heads"]

#: File name of the head weights inside a heads directory.
WEIGHTS_FILE = "heads.safetensors"


def build_heads(config: HeadsConfig) -> torch.nn.Module:
    """A freshly initialised :class:`MedusaHeads` or :class:`EagleHead` for ``config``."""
    if config.method == "medusa":
        return MedusaHeads(config.hidden_size, config.num_heads, config.num_layers)
    if not config.eagle:
        raise HeadsMismatchError("eagle heads config lacks its 'eagle' layer sizes")
    return EagleHead(config.hidden_size, config.eagle)


def save_heads(directory: str | Path, heads: torch.nn.Module, config: HeadsConfig) -> Path:
    """Write ``heads.safetensors`` (float32) and ``heads_config.json`` into ``directory`` (created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in heads.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"method": config.method})
    (directory / CONFIG_FILE).write_text(config.to_json() + "\n", encoding="utf-8")
    return directory


def load_heads(directory: str | Path, *, fingerprint: str | None = None, base_name: str = "the target",
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, HeadsConfig]:
    """Load heads saved by :func:`save_heads`.

    Args:
        fingerprint: :func:`base_model_identity` of the model the heads will run on; checked when given.

    Raises:
        HeadsMismatchError: not a heads directory, unreadable weights, weights that do not fit the config, or
            (with ``fingerprint``) heads trained on another base model.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadsMismatchError(f"heads directory not found: {directory}")
    config = HeadsConfig.from_json_file(directory / CONFIG_FILE)
    if fingerprint is not None:
        config.check_base(fingerprint, base_name)
    heads = build_heads(config)
    try:
        state = load_file(str(directory / WEIGHTS_FILE))
        heads.load_state_dict(state, strict=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise HeadsMismatchError(f"{directory / WEIGHTS_FILE}: cannot load {config.method} heads: {exc}") from exc
    return heads.to(device=device, dtype=dtype).eval(), config
