"""Linear-layer shapes: what a model's ``nn.Linear`` layers look like, and their weight bytes."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from draftwise.backends.kernels.layers import _KernelLinear
from draftwise.backends.quantization import Int8Linear

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class LinearShape:
    """One linear layer shape of a model: ``weight [out_features, in_features]``, used ``count`` times per
    forward pass (e.g. once per decoder layer)."""

    out_features: int
    in_features: int
    count: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        if min(self.out_features, self.in_features, self.count) < 1:
            raise ValueError(f"linear shape needs positive sizes and count, got {self}")

    @property
    def key(self) -> str:
        """``"OUTxIN"``: the shape's key in timings and parameters."""
        return f"{self.out_features}x{self.in_features}"


def as_shapes(shapes: Iterable[LinearShape | Sequence[int]]) -> tuple[LinearShape, ...]:
    """Normalize shapes: :class:`LinearShape` or ``(out, in)`` / ``(out, in, count)`` tuples; equal
    ``(out, in)`` are merged (counts added).

    Raises:
        ValueError: no shapes, or a malformed one.
    """
    merged: dict[tuple[int, int], LinearShape] = {}
    for shape in shapes:
        if not isinstance(shape, LinearShape):
            if len(shape) not in (2, 3):
                raise ValueError(f"a linear shape is (out, in) or (out, in, count), got {shape!r}")
            shape = LinearShape(*(int(v) for v in shape))
        key = (shape.out_features, shape.in_features)
        if key in merged:
            old = merged[key]
            names = "+".join(n for n in (old.name, shape.name) if n)
            shape = LinearShape(shape.out_features, shape.in_features, old.count + shape.count, names)
        merged[key] = shape
    if not merged:
        raise ValueError("no linear shapes given")
    return tuple(merged.values())


def llama_linear_shapes(
    *, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, layers: int = 1,
    head_dim: int | None = None,
) -> tuple[LinearShape, ...]:
    """The linear layers of a Llama-family decoder with fused projections (gpt-fast style): q/k/v fused
    ``[(heads + 2 kv_heads) * head_dim, hidden]``, o ``[hidden, heads * head_dim]``, gate/up fused
    ``[2 intermediate, hidden]``, down ``[hidden, intermediate]`` (each ``layers`` times) and the LM head
    ``[vocab, hidden]`` (once). ``head_dim`` defaults to ``hidden // heads``.

    Example: Qwen2.5-Coder-1.5B is ``hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=151936,
    layers=28``.
    """
    head_dim = head_dim or hidden // heads
    return as_shapes([
        LinearShape((heads + 2 * kv_heads) * head_dim, hidden, layers, "qkv"),
        LinearShape(hidden, heads * head_dim, layers, "o"),
        LinearShape(2 * intermediate, hidden, layers, "gate_up"),
        LinearShape(hidden, intermediate, layers, "down"),
        LinearShape(vocab, hidden, 1, "lm_head"),
    ])


def _linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(out, in)`` of a linear layer module (``nn.Linear``, :class:`Int8Linear`, this module's kernels)."""
    if isinstance(module, (nn.Linear, Int8Linear, _KernelLinear)):
        return int(module.out_features), int(module.in_features)
    return None


def model_linear_shapes(model: nn.Module) -> tuple[LinearShape, ...]:
    """The linear layer shapes of a model, with how often each occurs (``nn.Linear``, :class:`Int8Linear`
    and the modules built by :data:`LINEAR_KERNELS`).

    Raises:
        ValueError: the model has no linear layers.
    """
    shapes = [LinearShape(*dims) for m in model.modules() if (dims := _linear_dims(m)) is not None]
    return as_shapes(shapes)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights (plus scales and biases) the model's linear layers read per forward pass:
    what one decoded token must stream from memory, apart from the embedding row and the KV cache.

    ``nn.Linear``: its parameters as stored (a tied LM head counts: it is read for every token);
    :class:`Int8Linear`: int8 weights, per-channel scale and column offset; kernel modules: their own
    ``weight_bytes``.
    """
    total = 0
    for module in model.modules():
        if isinstance(module, _KernelLinear):
            total += module.weight_bytes
        elif isinstance(module, Int8Linear):
            total += module.out_features * module.in_features + 8 * module.out_features
            total += 0 if module.bias is None else module.bias.numel() * 4
        elif isinstance(module, nn.Linear):
            total += sum(p.numel() * p.element_size() for p in (module.weight, module.bias) if p is not None)
    return total


