"""Batch-invariant int8 linear layers for the PyTorch CPU backend (``--quantization int8``).

Speculative decoding pays on a CPU only where a forward pass over k tokens costs about as much as over one,
and greedy speculation is exact only where a position's logits do not depend on how many tokens share the
pass. fp32 through MKL fails both here (2-4x one token for k = 2..16; other kernels, other rounding, for
m >= 2 rows). This module replaces every ``nn.Linear`` of a ``transformers`` causal LM, LM head included,
with :class:`Int8Linear`:

- weights: int8, symmetric, one scale per output channel (``scale_c = max|W_c| / 127``);
- activations: quantized per row (per token) to 7 bits plus sign: each row is multiplied by
  ``g = 63.5 / max|x_row|`` in float, then run through fbgemm's u8 x s8 GEMM
  (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``) with a FIXED input scale 1 and zero
  point 64, and the fp32 result is divided by ``g`` and the bias added.

Why this is batch-invariant: a row's scale depends on that row only; the GEMM accumulates integer products
in int32, which is exact and so independent of blocking or the order in which rows and columns are
visited; the float epilogue is elementwise with constants per output channel. Row i of an m-row call is
therefore the same bits as the 1-row call (tested, m = 1..17, every layer shape of the Qwen models).
PyTorch's own dynamic quantization (``quantize_dynamic``) uses the same kernel but one activation scale
for the whole tensor, so there a token's result depends on its neighbours.

7-bit activations (fbgemm's ``reduce_range`` convention on x86) keep the AVX2 ``vpmaddubsw`` int16 pair
sums from saturating (2 * 128 * 127 < 32767).

Alternatives, measured in docs/cpu_int8.md (with the machine and date): ``torch._weight_int8pack_mm``
(weight-only int8) is bit-exact batch-invariant but had no vectorized kernel on the AVX2-only CPU measured;
``torch._int_mm`` was similarly slow there; fbgemm's fp16-weight GEMM is not batch-invariant.

The word embedding stays in float (a lookup, row-independent); a tied LM head gets a quantized copy.
The rest of batch invariance (attention, activations, rotary embeddings computed per position) is
:func:`draftwise.backends.attention.make_batch_invariant`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from draftwise.backends.attention import make_batch_invariant

__all__ = ["QUANTIZATION_CHOICES", "QUANTIZATION_MODES", "Int8Linear", "QuantizationError", "int8_kernels_available", "quantize_model",
           "parse_quantization", "row_grid_scale"]

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("none", "int8", "q4k")
#: what ``--quantization`` accepts: a mode, or ``"auto"`` (the fastest exact mode for the model and machine,
#: resolved at load by :func:`draftwise.models.loading.resolve_quantization`).
QUANTIZATION_CHOICES = ("auto", *QUANTIZATION_MODES)

_ACT_HALF_RANGE = 63.5  # rows are scaled to [-63.5, 63.5]; with zero point 64 they quantize to [0, 128]
_ACT_ZERO_POINT = 64
_MIN_ROW_MAX = 1e-30  # floor of a row's max |x|, so 63.5 / max stays finite (an all-zero row maps to zeros)
_ROW_CHUNK = 16384  # output channels quantized at a time (bounds the float temporary of a large LM head)


class QuantizationError(ValueError):
    """The requested quantization cannot be applied here (missing kernels, a model not on the CPU)."""


def parse_quantization(mode: str | None) -> str:
    """Normalize a ``--quantization`` value (None -> ``"none"``; ``"auto"`` stays ``"auto"``).

    Raises:
        ValueError: a value not in :data:`QUANTIZATION_CHOICES`.
    """
    mode = (mode or "none").lower()
    if mode not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZATION_CHOICES)}")
    return mode


def int8_usable() -> bool:
    """True when int8 layers can run here: fbgemm's kernels are in this torch build and its engine is listed."""
    return int8_kernels_available() and "fbgemm" in torch.backends.quantized.supported_engines


def int8_kernels_available() -> bool:
    """True when this torch build has fbgemm's int8 linear kernels (x86 CPUs)."""
    try:
        ops = torch.ops.quantized
        return all(hasattr(ops, name) for name in ("linear_prepack", "linear_with_input_q_dq_qweight_dq_output_fp32"))
    except (AttributeError, RuntimeError):
        return False


def _require_int8_kernels() -> None:
    if not int8_usable():
        raise QuantizationError(
            "int8 quantization needs PyTorch's fbgemm kernels (quantized::linear_prepack, "
            "quantized::linear_with_input_q_dq_qweight_dq_output_fp32) on an x86 CPU; this torch "
            f"{torch.__version__} build lacks them. Use --quantization none."
        )


def quantize_weight_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization.

    Args:
        weight: ``[out, in]`` float.

    Returns:
        ``(q, scales)``: ``q`` ``[out, in]`` int8 in [-127, 127] and ``scales`` ``[out]`` float64 with
        ``weight ~= q * scales[:, None]`` (an all-zero channel gets scale 1).
    """
    out_features = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(out_features, dtype=torch.float64)
    for start in range(0, out_features, _ROW_CHUNK):
        rows = weight[start:start + _ROW_CHUNK].detach().to("cpu", torch.float32)
        scale = rows.abs().amax(dim=1) / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q[start:start + _ROW_CHUNK] = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start:start + _ROW_CHUNK] = scale.double()
    return q, scales


def row_grid_scale(rows: torch.Tensor) -> torch.Tensor:
    """``g [m, 1] = 63.5 / max|row|`` for fp32 ``rows [m, in]``: the per-row factor that maps each row onto the
    7-bit activation grid (a row's own scale: row-invariant). One definition for every kernel with these
    numerics (:class:`Int8Linear`, ``OneDnnInt8Linear``), so they keep the same bits."""
    # max |x| is exact in any order; abs().amax is 3-5x faster than vector_norm(ord=inf) on 1-5 rows here
    row_max = rows.abs().amax(dim=1, keepdim=True)
    return _ACT_HALF_RANGE / row_max.clamp_min_(_MIN_ROW_MAX)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with int8 weights (per output channel) and per-row 7-bit activations, on fbgemm.

    Batch-invariant: row i of the output depends on row i of the input only, bit for bit (see the module
    docstring). CPU only; inputs of any float dtype are computed in fp32 and returned in their own dtype.

    Args:
        weight: ``[out_features, in_features]`` float weight (not kept; a packed int8 copy is).
        bias: ``[out_features]`` or None (kept in fp32).

    Raises:
        QuantizationError: if the fbgemm kernels are missing.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        _require_int8_kernels()
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        q, scales = quantize_weight_rows(weight)
        with warnings.catch_warnings():  # quantized tensor constructors warn of a future deprecation
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(
                q, scales, torch.zeros(self.out_features, dtype=torch.long), 0
            )
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to("cpu", torch.float32), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize an ``nn.Linear`` (its weight is left untouched)."""
        return cls(linear.weight, linear.bias)

    @property
    def weight(self) -> torch.Tensor:
        """A ``meta`` tensor of the float weight's shape ``[out, in]``: for code that reads ``.weight.shape``
        (e.g. ``get_output_embeddings().weight.shape``); it holds no values."""
        return torch.empty((self.out_features, self.in_features), device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., in_features]`` float on CPU -> ``[..., out_features]`` in ``x``'s dtype."""
        rows = x.reshape(-1, self.in_features)  # [m, in]
        if rows.dtype != torch.float32:
            rows = rows.float()
        to_grid = row_grid_scale(rows)  # [m, 1]: each row to [-63.5, 63.5]
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            rows * to_grid, 1.0, _ACT_ZERO_POINT, self._packed
        )  # [m, out]
        y.div_(to_grid)
        if self.bias is not None:
            y.add_(self.bias)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def nbytes(self) -> int:
        """Bytes the layer stores: int8 weights, per-channel scales (float64), bias (float32)."""
        bias = 0 if self.bias is None else 4 * self.out_features
        return self.out_features * self.in_features + 8 * self.out_features + bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _replace_linears(module: nn.Module, build: Callable[[nn.Linear], nn.Module] = Int8Linear.from_linear) -> int:
    """Replace every ``nn.Linear`` below ``module`` with ``build(linear)``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, build(child))
            count += 1
        else:
            count += _replace_linears(child, build)
    return count


def quantize_model(model: nn.Module, mode: str | None = "int8", *, kernel: Any = None) -> nn.Module:
    """Apply a quantization mode to a loaded ``transformers`` causal LM, in place.

    ``"int8"``: every ``nn.Linear`` (attention and MLP projections, the LM head) becomes an
    :class:`Int8Linear`; the input embedding stays float (a tied LM head gets its own int8 copy, the
    embedding table is not modified); attention, MLP activations and rotary embeddings are computed one
    position at a time (:func:`draftwise.backends.attention.make_batch_invariant`).
    ``"none"``: the model is returned unchanged, unless a ``kernel`` of mode ``"none"`` is given.

    ``kernel``: a :class:`draftwise.backends.kernels.KernelChoice` of the same mode, from
    :func:`draftwise.backends.kernels.select_linear_kernel` run on this model's
    :func:`~draftwise.backends.kernels.model_linear_shapes`: every ``nn.Linear`` is then built by it instead
    (``onednn-int8`` gives the same bits as the default :class:`Int8Linear`; ``fp32-mkl-pad`` makes the fp32
    linear layers row-invariant on CPUs where padding does), and the per-position pieces are made
    batch-invariant as for int8.

    Args:
        model: a ``*ForCausalLM`` on the CPU, in eval mode.
        mode: one of :data:`QUANTIZATION_MODES` (None means ``"none"``).
        kernel: the linear kernel to use (default: :class:`Int8Linear` for int8, nothing for none).

    Returns:
        ``model`` itself.

    Raises:
        ValueError: unknown mode, a kernel of another mode, or a model whose attention cannot be swapped.
        QuantizationError: the model is not on the CPU, or the int8 kernels are missing.
        draftwise.backends.kernels.KernelError: a layer shape the kernel's self-test did not cover.
    """
    mode = parse_quantization(mode)
    if kernel is not None and kernel.mode != mode:
        raise ValueError(f"kernel {kernel.name} serves mode {kernel.mode!r}, not {mode!r}")
    if mode == "none" and kernel is None:
        return model
    if kernel is None:
        _require_int8_kernels()
    if mode == "q4k" and kernel is None:
        raise ValueError("q4k needs kernel=draftwise.backends.kernels.gguf_source.Q4KKernel() (the kernels import this "
                         "module, so it cannot build them itself)")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"cpu"}:
        raise QuantizationError(f"{mode} linear kernels run on the CPU only; the model is on {sorted(devices)}")
    make_batch_invariant(model)
    with torch.no_grad():
        if kernel is None:
            count = _replace_linears(model)
        else:
            count = _replace_linears(model, lambda linear: kernel.build(linear.weight, linear.bias))
    logger.info("replaced %d linear layers of %s with %s", count, type(model).__name__,
                "int8 (per-channel weights, per-token activations)" if kernel is None else kernel.name)
    return model
