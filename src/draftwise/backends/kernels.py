"""Linear-layer kernels for the PyTorch CPU path, chosen per machine by a short measured self-test.

Greedy speculative decoding is exact only when a row's output of every layer does not depend on how many
rows share the call ("row invariance", bit for bit): the target's logits for a position must be the same
in a k-token verify pass as in one-token decoding (Leviathan et al. 2023, Sec. 2.3, assume exact target
probabilities; He et al. 2024, "Defeating Nondeterminism in LLM Inference", show why a GEMM's reduction
order, and so its rounding, changes with the number of rows). Which kernels keep that property, and which
is fastest, depends on the CPU (AVX2 vs AVX-512/VNNI vs AMX) and the torch build, so neither is assumed:

- :data:`LINEAR_KERNELS` lists the candidates (:class:`LinearKernel`), one quantization mode each:
  ``"none"`` (fp32 weights: MKL with rows zero-padded to a multiple of R, oneDNN prepacked), ``"bf16"``
  (oneDNN bf16), ``"int8"`` (fbgemm and oneDNN u8 x s8 with per-row activation scales, weight-only int8) and
  ``"int4"`` (weight-only int4, group size 32/64/128). Kernels of one mode may differ in their rounding
  (:attr:`LinearKernel.numerics` says how they compute); a run uses one kernel for every layer.
- :func:`select_linear_kernel` checks each available candidate on synthetic weights of the model's layer
  shapes (:func:`check_row_invariance`: rows of an m-row call, m = 1..17 and some prefill sizes, equal to
  the same rows computed alone, with ``torch.equal``), times m = 1, 2, 4, 8, 16 rows, refuses the kernels
  that are not row-invariant and picks the fastest of the rest by a weighted cost (:data:`COST_WEIGHTS`:
  decode m = 1 most, then verify passes of 5-9 rows); kernels slower than the chosen one need no check. The result (:class:`KernelChoice`) is cached as JSON
  under ``draftwise_home()/kernels/``, keyed by CPU model and flags, torch version, threads, mode, shapes and
  candidates, so later loads cost nothing. ``DRAFTWISE_KERNEL=<name>`` (or ``kernel=``) forces a kernel,
  still refused when it is not row-invariant unless the caller says it needs no invariance (a draft model).
- :func:`measure_dram_bandwidth` and :func:`cpu_description` give the machine figures that a
  weight-streaming lower bound per token (weight bytes / read bandwidth) needs.

Measured tables (AVX2 AMD EPYC and others): ``docs/kernels.md``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from draftwise import progress
from draftwise.backends.quantization import Int8Linear, int8_kernels_available, quantize_weight_rows

__all__ = [
    "KERNEL_MODES", "KERNEL_ENV", "COST_WEIGHTS", "INVARIANCE_ROWS", "TIMED_ROWS", "LINEAR_KERNELS",
    "KernelError", "LinearShape", "LinearKernel", "InvarianceResult", "KernelTrial", "KernelChoice",
    "linear_kernels", "check_row_invariance", "select_linear_kernel", "kernel_cache_dir",
    "llama_linear_shapes", "model_linear_shapes", "linear_weight_bytes", "measure_dram_bandwidth",
    "cpu_description", "cpu_flags", "cpu_model_name",
    "PaddedFloatLinear", "OneDnnFloatLinear", "OneDnnInt8Linear", "Int8WeightOnlyLinear", "Int4WeightOnlyLinear",
]

logger = logging.getLogger(__name__)

#: Quantization modes a kernel can serve: the float or integer format of the stored weights.
KERNEL_MODES = ("none", "bf16", "int8", "int4")
#: Environment variable that forces a kernel: a name, or comma-separated names (the one of the mode applies).
KERNEL_ENV = "DRAFTWISE_KERNEL"
#: Row counts whose rows must equal the same rows computed alone: decode, verify and tree passes (1..17)
#: and prefill chunks (32..512; those above the multiply-accumulate budget of a shape are skipped).
INVARIANCE_ROWS = (*range(1, 18), 32, 64, 128, 512)
#: Row counts m of an m-row call up to which every row is compared; above it a sample of rows.
FULL_CHECK_ROWS = 17
#: Longest predicted time (s) of one invariance call above 17 rows (from the kernel's measured 16-row
#: time); larger prefill sizes are skipped for that shape and kernel, which keeps the test short.
LARGE_CALL_SECONDS = 0.3
#: Row counts that are timed.
TIMED_ROWS = (1, 2, 4, 8, 16)
#: A call whose first run (the warm-up) takes longer than this (s) is not repeated.
SLOW_CALL_SECONDS = 0.25
#: A kernel whose weighted cost exceeds this multiple of the fastest fully timed one is not timed further.
SLOWER_CUTOFF = 3.0
#: Weight of each timed row count in the cost that picks a kernel: decode passes (m = 1, target and draft)
#: dominate; verify passes of K + 1 = 5..9 rows lie between m = 4 and m = 8.
COST_WEIGHTS = {1: 0.55, 2: 0.05, 4: 0.15, 8: 0.2, 16: 0.05}
#: Row multiples that ``fp32-mkl-pad`` tries, smallest first (1 = no padding).
PAD_ROWS = (1, 4, 8, 16)
#: Group sizes (input channels per scale and zero point) of the weight-only int4 kernels.
INT4_GROUP_SIZES = (32, 64, 128)
CACHE_SCHEMA = 1
#: CPU flags that decide which kernels are fast (and are printed with every figure).
RELEVANT_CPU_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                      "avx_ne_convert", "amx_tile", "amx_int8", "amx_bf16")

_ACT_HALF_RANGE = 63.5  # as draftwise.backends.quantization: rows scaled to [-63.5, 63.5], zero point 64
_ACT_ZERO_POINT = 64
_MIN_ROW_MAX = 1e-30
_SYNTHETIC_BLOCK_ROWS = 4096  # synthetic weights: a random block of this many output rows, repeated


class KernelError(ValueError):
    """A kernel cannot be used: unknown name, not available here, unsupported shape, or not row-invariant
    where invariance is required."""


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


# ---------------------------------------------------------------------------------------------- the modules
class _KernelLinear(nn.Module):
    """Base of the kernel modules: ``x [..., in]`` float -> ``[..., out]`` in ``x``'s dtype, computed in
    fp32 on contiguous ``[m, in]`` rows (a strided view could take another code path, so another rounding)."""

    kernel_name = "?"

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise KernelError(f"bias of shape {tuple(bias.shape)} does not match {out_features} output features")
        self.bias = None if bias is None else nn.Parameter(bias.detach().to("cpu", torch.float32).contiguous(),
                                                           requires_grad=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes read per call: stored weights, scales and bias."""
        raise NotImplementedError

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [m, in]`` contiguous fp32 -> ``[m, out]`` fp32."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]`` (fp32 inside, returned in ``x``'s dtype)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.kernel_name}: expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = self._rows(rows).view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"kernel={self.kernel_name}")


class _PackedLinear(_KernelLinear):
    """A kernel module whose weight is stored in the kernel's own format."""

    @property
    def weight(self) -> torch.Tensor:
        """A ``meta`` tensor of the float weight's shape ``[out, in]``, for code that reads
        ``.weight.shape`` (e.g. transformers' ``get_output_embeddings()``); it holds no values."""
        return torch.empty((self.out_features, self.in_features), device="meta")


def _float_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` as contiguous fp32 on the CPU. Raises KernelError if not 2-D."""
    if weight.dim() != 2:
        raise KernelError(f"a linear weight is [out, in], got shape {tuple(weight.shape)}")
    return weight.detach().to("cpu", torch.float32).contiguous()


class PaddedFloatLinear(_KernelLinear):
    """fp32 ``F.linear`` (MKL sgemm) with the rows zero-padded to a multiple of ``pad_rows``.

    MKL computes a row with other kernels (another summation order) depending on the number of rows; on an
    AVX2 EPYC every multiple of 4 rows gives the same bits, so padding a call to such a multiple makes it
    row-invariant there. ``pad_rows`` is found per shape by the self-test; 1 means no padding.

    Args:
        weight: ``[out, in]`` float (kept as fp32; an fp32 contiguous tensor is shared, not copied).
        bias: ``[out]`` or None.
        pad_rows: pad the rows of each call to a multiple of this (>= 1).
    """

    kernel_name = "fp32-mkl-pad"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pad_rows: int = 1) -> None:
        weight = _float_weight(weight)
        super().__init__(*weight.shape, bias)
        if pad_rows < 1:
            raise KernelError(f"pad_rows must be >= 1, got {pad_rows}")
        self.pad_rows = int(pad_rows)
        self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def weight_bytes(self) -> int:
        return 4 * self.weight.numel() + (0 if self.bias is None else 4 * self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        m = rows.shape[0]
        pad = -m % self.pad_rows
        if pad:
            rows = torch.cat((rows, rows.new_zeros(pad, self.in_features)))
        y = F.linear(rows, self.weight, self.bias)  # [m + pad, out]
        return y[:m] if pad else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, pad_rows={self.pad_rows}"


class OneDnnFloatLinear(_PackedLinear):
    """oneDNN (mkldnn) linear with a prepacked weight: fp32, or bf16 weights and activations (fp32 output).

    bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (the reorder refuses otherwise) and is fast only with
    AVX512-BF16 or AMX. Reached through ``torch.ops.mkldnn._reorder_linear_weight`` and
    ``torch.ops.mkldnn._linear_pointwise`` (the ops behind Inductor's CPU linear lowering).

    Args:
        weight: ``[out, in]`` float.
        bias: ``[out]`` or None.
        dtype: ``torch.float32`` or ``torch.bfloat16``: the stored weight and the activations' compute type.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> None:
        weight = _float_weight(weight)
        super().__init__(*weight.shape, bias)
        if dtype not in (torch.float32, torch.bfloat16):
            raise KernelError(f"oneDNN float linear supports fp32 and bf16, not {dtype}")
        self.dtype = dtype
        self.kernel_name = "onednn-fp32" if dtype == torch.float32 else "onednn-bf16"
        self._bias_c = None if self.bias is None else self.bias.data.to(dtype)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)

    @property
    def weight_bytes(self) -> int:
        size = 4 if self.dtype == torch.float32 else 2
        return size * self.out_features * self.in_features + (0 if self.bias is None else size * self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(rows.to(self.dtype), self._packed, self._bias_c, "none", [], "")
        return y.float()


def _row_grid_scale(rows: torch.Tensor) -> torch.Tensor:
    """``g [m, 1] = 63.5 / max|row|``: the per-row factor that maps a row onto the 7-bit activation grid."""
    row_max = torch.linalg.vector_norm(rows, ord=float("inf"), dim=1, keepdim=True)
    return _ACT_HALF_RANGE / row_max.clamp_min_(_MIN_ROW_MAX)


class OneDnnInt8Linear(_PackedLinear):
    """:class:`Int8Linear`'s arithmetic on oneDNN's u8 x s8 GEMM (``torch.ops.onednn.qlinear_pointwise``).

    Same weights (int8, per output channel) and activations (each row scaled by ``g = 63.5 / max|row|``,
    then ``q = round(fl(x g) + 64)``, half to even: the zero point added in float before rounding, as fbgemm
    does it); int32 accumulation, so row-invariant by construction, and the same bits as ``fbgemm-int8``
    (measured: fbgemm's output equals this arithmetic exactly; tested). oneDNN uses VNNI / AMX-INT8 where
    the CPU has them.

    Args:
        weight: ``[out, in]`` float.
        bias: ``[out]`` or None.
    """

    kernel_name = "onednn-int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = _float_weight(weight)
        super().__init__(*weight.shape, bias)
        q, scales = quantize_weight_rows(weight)
        self._scales = scales.float()  # [out]
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self._packed = torch.ops.onednn.qlinear_prepack(q, None)

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features + 4 * self.out_features + (0 if self.bias is None else 4 * self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        to_grid = _row_grid_scale(rows)  # [m, 1]
        # fbgemm's rounding: the zero point is added in float, then rounded half to even (same bits as fbgemm-int8)
        qx = torch.round(rows * to_grid + _ACT_ZERO_POINT).to(torch.uint8)  # [m, in] in [0, 128]
        y = torch.ops.onednn.qlinear_pointwise(qx, 1.0, _ACT_ZERO_POINT, self._packed, self._scales,
                                               self._zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        y.div_(to_grid)
        return y if self.bias is None else y.add_(self.bias)


class Int8WeightOnlyLinear(_PackedLinear):
    """Weight-only int8 (``torch._weight_int8pack_mm``): int8 weights with one fp32 scale per output channel,
    fp32 activations. Other numerics than :class:`Int8Linear` (activations are not quantized).

    Args:
        weight: ``[out, in]`` float.
        bias: ``[out]`` or None.
    """

    kernel_name = "weight-only-int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = _float_weight(weight)
        super().__init__(*weight.shape, bias)
        q, scales = quantize_weight_rows(weight)
        self._q, self._scales = q, scales.float()

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features + 4 * self.out_features + (0 if self.bias is None else 4 * self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(rows, self._q, self._scales)
        return y if self.bias is None else y.add_(self.bias)


def quantize_int4_groups(weight: torch.Tensor, group_size: int, dtype: torch.dtype = torch.bfloat16
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization per group of ``group_size`` input channels, in the layout of
    ``torch._weight_int4pack_mm_for_cpu``: ``w ~= (q - 8) * scale + zero`` (as torchao's int4 weight-only).

    Args:
        weight: ``[out, in]`` fp32, ``in`` a multiple of ``group_size``.
        group_size: input channels per group.
        dtype: dtype of the scales and zero points (the kernel's activation dtype).

    Returns:
        ``(q [out, in] int32 in 0..15, scales_and_zeros [in / group_size, out, 2] dtype)``; q is computed from
        the scales and zeros already rounded to ``dtype``, so it is the nearest level of what the kernel uses.

    Raises:
        KernelError: ``in`` not a multiple of ``group_size``.
    """
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise KernelError(f"int4: {in_features} input features are not a multiple of group size {group_size}")
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)  # [out, groups]
    scale = ((high - low) / 15).clamp_min(1e-12).to(dtype)
    zero = (low + scale.float() * 8).to(dtype)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).contiguous()  # [groups, out, 2]
    return q.to(torch.int32).reshape(out_features, in_features), scales_and_zeros


class Int4WeightOnlyLinear(_PackedLinear):
    """Weight-only int4 (``torch._weight_int4pack_mm_for_cpu``): 4-bit weights, one bf16 scale and zero
    point per group of input channels, bf16 activations (the fp32-activation path of this op has no
    vectorized kernel and was measured 5-30x slower on AVX2).

    A different quantization mode ("int4"): another model's numerics than int8.

    Args:
        weight: ``[out, in]`` float, ``in`` a multiple of ``group_size``.
        bias: ``[out]`` or None.
        group_size: 32, 64 or 128.

    Raises:
        KernelError: unsupported group size or shape.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 128) -> None:
        weight = _float_weight(weight)
        super().__init__(*weight.shape, bias)
        if group_size not in INT4_GROUP_SIZES:
            raise KernelError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        self.group_size = group_size
        self.kernel_name = f"int4-g{group_size}"
        q, self._scales_and_zeros = quantize_int4_groups(weight, group_size)
        self._packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)

    @property
    def weight_bytes(self) -> int:
        groups = self.in_features // self.group_size
        return (self.out_features * self.in_features // 2 + 4 * groups * self.out_features
                + (0 if self.bias is None else 4 * self.out_features))

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self._packed, self.group_size,
                                              self._scales_and_zeros).float()
        return y if self.bias is None else y.add_(self.bias)


# ------------------------------------------------------------------------------------------------ kernels
@dataclass(frozen=True)
class LinearKernel:
    """A way to compute ``y = x @ W.T + b`` for one quantization mode.

    Attributes:
        name: unique name (``DRAFTWISE_KERNEL`` value).
        mode: the quantization mode served (:data:`KERNEL_MODES`).
        numerics: how it computes (kernels of one mode with different numerics give other rounding).
        factory: ``factory(weight [out, in] fp32, bias [out] | None, **params) -> nn.Module`` whose forward
            maps ``x [m, in]`` fp32 to ``[m, out]`` fp32.
        variants: parameter sets the self-test tries in order per shape, keeping the first row-invariant one
            (e.g. ``pad_rows`` 1, 4, 8, 16); ``({},)`` when there is nothing to choose.
        bytes_per_weight: stored bytes per weight element (4 fp32, 1 int8, 0.5 int4).
        bytes_per_scale_group: ``(bytes, input channels per group)`` of scales and zero points per output
            channel and group (``group`` None: one per output channel), or None.
        row_invariant_by_construction: documentation only (int32 accumulation); the self-test checks anyway.
    """

    name: str
    mode: str
    numerics: str
    factory: Callable[..., nn.Module] = field(repr=False)
    variants: tuple[Mapping, ...] = ({},)
    bytes_per_weight: float = 4.0
    bytes_per_scale_group: tuple[int, int | None] | None = None
    row_invariant_by_construction: bool = False

    def stored_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes of an ``[out, in]`` weight in this kernel's format, scales included (bias not): what one
        call streams from memory."""
        total = self.bytes_per_weight * out_features * in_features
        if self.bytes_per_scale_group is not None:
            size, group = self.bytes_per_scale_group
            total += size * out_features * (1 if group is None else -(-in_features // group))
        return int(total)

    def unavailable_reason(self) -> str | None:
        """None when this torch build and CPU can run the kernel, else why not (a tiny build and call)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = self.factory(torch.randn(32, 128), torch.randn(32), **self.variants[0])
                y = module(torch.randn(3, 128))
            if tuple(y.shape) != (3, 32) or y.dtype != torch.float32:
                return f"returned {tuple(y.shape)} {y.dtype} instead of (3, 32) float32"
        except Exception as exc:  # noqa: BLE001 - any failure of a probe means "not on this build / CPU"
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        return None

    def available(self) -> bool:
        """True when this torch build and CPU can run the kernel (see :meth:`unavailable_reason`)."""
        return self.unavailable_reason() is None

    def build(self, weight: torch.Tensor, bias: torch.Tensor | None = None, params: Mapping | None = None) -> nn.Module:
        """The layer for ``weight [out, in]`` and ``bias [out]`` (or None), with ``params`` (default: the
        first variant). Prefer :meth:`KernelChoice.build`, which applies the parameters the self-test found
        for the shape.

        Raises:
            KernelError: the kernel cannot serve this shape or these parameters.
        """
        with warnings.catch_warnings():  # quantized-tensor constructors warn of a future deprecation
            warnings.simplefilter("ignore")
            return self.factory(weight, bias, **dict(self.variants[0] if params is None else params))


def _build_fbgemm(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    if not int8_kernels_available():
        raise KernelError("fbgemm int8 kernels missing from this torch build")
    return Int8Linear(_float_weight(weight), bias)


def _build_padded(weight: torch.Tensor, bias: torch.Tensor | None, pad_rows: int = 1) -> nn.Module:
    return PaddedFloatLinear(weight, bias, pad_rows)


def _build_onednn_fp32(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    return OneDnnFloatLinear(weight, bias, torch.float32)


def _build_onednn_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    return OneDnnFloatLinear(weight, bias, torch.bfloat16)


def _build_int4(group_size: int) -> Callable[..., nn.Module]:
    def build(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        return Int4WeightOnlyLinear(weight, bias, group_size)
    return build


_W8A7 = "int8 weights per output channel, activations per row to 7 bits, int32 accumulation"

#: Every candidate kernel, in the order the self-test tries them.
LINEAR_KERNELS: tuple[LinearKernel, ...] = (
    LinearKernel("fp32-mkl-pad", "none", "fp32 MKL sgemm, rows zero-padded to a multiple of R", _build_padded,
                 tuple({"pad_rows": r} for r in PAD_ROWS)),
    LinearKernel("onednn-fp32", "none", "fp32 oneDNN, prepacked weight", _build_onednn_fp32),
    LinearKernel("onednn-bf16", "bf16", "bf16 weights and activations, fp32 accumulation (oneDNN)", _build_onednn_bf16,
                 bytes_per_weight=2),
    LinearKernel("fbgemm-int8", "int8", f"{_W8A7} (fbgemm)", _build_fbgemm, bytes_per_weight=1,
                 bytes_per_scale_group=(8, None), row_invariant_by_construction=True),
    LinearKernel("onednn-int8", "int8", f"{_W8A7} (oneDNN)", OneDnnInt8Linear, bytes_per_weight=1,
                 bytes_per_scale_group=(4, None), row_invariant_by_construction=True),
    LinearKernel("weight-only-int8", "int8", "int8 weights per output channel, fp32 activations",
                 Int8WeightOnlyLinear, bytes_per_weight=1, bytes_per_scale_group=(4, None)),
    *(LinearKernel(f"int4-g{g}", "int4", f"int4 weights, groups of {g} (bf16 scale and zero), bf16 activations",
                   _build_int4(g), bytes_per_weight=0.5, bytes_per_scale_group=(4, g)) for g in INT4_GROUP_SIZES),
)


def linear_kernels(mode: str | None = None) -> tuple[LinearKernel, ...]:
    """The candidates of ``mode`` (all when None), available or not.

    Raises:
        KernelError: unknown mode.
    """
    if mode is None:
        return LINEAR_KERNELS
    return tuple(k for k in LINEAR_KERNELS if k.mode == _check_mode(mode))


def _check_mode(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise KernelError(f"unknown quantization mode {mode!r}; kernels exist for {', '.join(KERNEL_MODES)}")
    return mode


# ------------------------------------------------------------------------------------------------ checking
@dataclass(frozen=True)
class InvarianceResult:
    """Outcome of :func:`check_row_invariance`: ``invariant`` (None: not checked), the row counts checked and
    a one-line detail (the first differing row, or what was checked)."""

    invariant: bool | None
    checked_rows: tuple[int, ...] = ()
    detail: str = ""


def _sampled_rows(m: int) -> list[int]:
    """Rows of an m-row call compared with their one-row results: all up to :data:`FULL_CHECK_ROWS`, else
    the first two, the middle and the last."""
    return list(range(m)) if m <= FULL_CHECK_ROWS else sorted({0, 1, m // 2, m - 1})


@torch.inference_mode()
def check_row_invariance(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                         rows: Iterable[int] = INVARIANCE_ROWS) -> InvarianceResult:
    """Check that row i of ``module(x[:m])`` equals ``module(x[i:i+1])[0]`` bit for bit (``torch.equal``),
    for each m in ``rows`` (those above ``x``'s row count are skipped); all rows of calls up to 17 rows,
    a sample of larger ones. Stops at the first difference.

    The one-row results are computed once per row and reused, so the check costs one call per m plus one
    per distinct compared row. m = 1 compares two identical calls: run-to-run determinism.

    Args:
        module: ``[m, in] -> [m, out]``.
        x: ``[M, in]`` float32 test rows.
        rows: row counts m to check.

    Returns:
        An :class:`InvarianceResult`; ``invariant`` False names the first m and row that differ.
    """
    singles: dict[int, torch.Tensor] = {}
    checked = []
    for m in sorted({m for m in rows if 1 <= m <= x.shape[0]}):
        y = module(x[:m])
        if tuple(y.shape[:1]) != (m,):
            return InvarianceResult(False, tuple(checked), f"m={m}: output has shape {tuple(y.shape)}")
        for i in _sampled_rows(m):
            if i not in singles:
                singles[i] = module(x[i:i + 1])[0]
            if not torch.equal(y[i], singles[i]):
                diff = (y[i].double() - singles[i].double()).abs().max().item()
                return InvarianceResult(False, tuple(checked),
                                        f"row {i} of an {m}-row call differs from the row alone (max |diff| {diff:.2g})")
        checked.append(m)
    return InvarianceResult(True, tuple(checked), f"rows equal for m = {_ranges(checked)}")


def _ranges(values: Sequence[int]) -> str:
    """``[1, 2, 3, 5, 32]`` -> ``"1..3, 5, 32"``."""
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(v) if start == v else f"{start}..{v}")
            start = None
    return ", ".join(parts)


def _call_seconds(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    """Wall time (s) of ``module(x)``: the fastest of ``repeats`` calls after one untimed call. The fastest,
    not the median: on a shared machine noise only adds time (a second OpenMP thread that waits for a core
    adds whole scheduler slices), so the minimum is the machine's figure. A first call longer than
    :data:`SLOW_CALL_SECONDS` is the measurement (noise is small against it; repeats would cost seconds)."""
    t0 = time.perf_counter()
    module(x)
    best = time.perf_counter() - t0
    if best > SLOW_CALL_SECONDS:
        return best
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        module(x)
        best = min(best, time.perf_counter() - t0)
    return best


def _synthetic_layer(shape: LinearShape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weight [out, in], bias [out], x [M, in])`` random, weight ~ N(0, 1/in); a large weight repeats a
    random block of :data:`_SYNTHETIC_BLOCK_ROWS` rows (generating 233M normal numbers would take seconds).
    The rows of ``x`` have scales spread over 0.1..10 (per-row activation scales differ); M is the largest
    of :data:`INVARIANCE_ROWS`."""
    out_f, in_f = shape.out_features, shape.in_features
    block = torch.randn(min(out_f, _SYNTHETIC_BLOCK_ROWS), in_f, generator=generator) / math.sqrt(in_f)
    weight = block.repeat(-(-out_f // block.shape[0]), 1)[:out_f].contiguous()
    bias = torch.randn(out_f, generator=generator) * 0.1
    max_rows = max(INVARIANCE_ROWS)
    scales = 10 ** (torch.rand(max_rows, 1, generator=generator) * 2 - 1)
    return weight, bias, torch.randn(max_rows, in_f, generator=generator) * scales


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[int]:
    """Run with ``threads`` intra-op threads (None: as set), restoring the setting afterwards."""
    old = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class KernelTrial:
    """One candidate's self-test: availability, row invariance over every shape (None: not checked),
    parameters per shape and seconds per call (fastest of the repeats) by shape key and row count."""

    name: str
    mode: str
    numerics: str
    available: bool
    invariant: bool | None
    detail: str
    params: Mapping[str, Mapping] = field(default_factory=dict)
    seconds: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    weight_bytes: int = 0  # stored weight bytes of one forward pass (shapes x counts, scales included)

    def total_seconds(self, m: int, shapes: Sequence[LinearShape]) -> float | None:
        """Seconds of the linear layers of one forward pass over m rows (sum over shapes x count), or None
        when not timed."""
        try:
            return sum(s.count * self.seconds[s.key][m] for s in shapes)
        except KeyError:
            return None

    def cost(self, shapes: Sequence[LinearShape]) -> float | None:
        """The weighted cost (s) that ranks kernels: ``sum_m COST_WEIGHTS[m] * total_seconds(m)``."""
        totals = [self.total_seconds(m, shapes) for m in COST_WEIGHTS]
        if any(t is None for t in totals):
            return None
        return sum(w * t for w, t in zip(COST_WEIGHTS.values(), totals))

    def to_dict(self) -> dict:
        return {"name": self.name, "mode": self.mode, "numerics": self.numerics, "available": self.available,
                "invariant": self.invariant, "detail": self.detail, "params": {k: dict(v) for k, v in self.params.items()},
                "seconds": {k: {str(m): s for m, s in v.items()} for k, v in self.seconds.items()},
                "weight_bytes": self.weight_bytes}

    @classmethod
    def from_dict(cls, data: dict) -> KernelTrial:
        """Inverse of :meth:`to_dict`. Raises KeyError/TypeError/ValueError on malformed data."""
        return cls(name=str(data["name"]), mode=str(data["mode"]), numerics=str(data["numerics"]),
                   available=bool(data["available"]), invariant=data["invariant"], detail=str(data["detail"]),
                   params={k: dict(v) for k, v in data["params"].items()},
                   seconds={k: {int(m): float(s) for m, s in v.items()} for k, v in data["seconds"].items()},
                   weight_bytes=int(data["weight_bytes"]))


@dataclass(frozen=True)
class KernelChoice:
    """The kernel chosen for a quantization mode on this machine, with the self-test that chose it.

    Attributes:
        kernel: the chosen :class:`LinearKernel`.
        mode: its quantization mode.
        require_invariant: whether row invariance was required (False for a draft model).
        shapes: the shapes tested.
        trials: every candidate's :class:`KernelTrial` (the self-test table).
        reason: why this kernel (its cost against the others, the refused ones and why).
        cpu: :func:`cpu_description` of the machine; threads: intra-op threads of the timings.
        selftest_seconds: how long the self-test took when it ran (not on a cache hit).
        load_average: the machine's 1/5/15-minute load average when the self-test started (timings on a
            busy machine are inflated; pass ``refresh=True`` to measure again), None where unknown.
        cached: read from the cache rather than measured now.
    """

    kernel: LinearKernel
    mode: str
    require_invariant: bool
    shapes: tuple[LinearShape, ...]
    trials: tuple[KernelTrial, ...]
    reason: str
    cpu: str
    threads: int
    torch_version: str
    selftest_seconds: float
    load_average: tuple[float, ...] | None = None
    cached: bool = False

    @property
    def name(self) -> str:
        """The chosen kernel's name."""
        return self.kernel.name

    @property
    def trial(self) -> KernelTrial:
        """The chosen kernel's :class:`KernelTrial`."""
        return next(t for t in self.trials if t.name == self.name)

    def params_for(self, out_features: int, in_features: int) -> Mapping:
        """The kernel parameters the self-test found for ``[out, in]``.

        Raises:
            KernelError: the shape was not tested and invariance is required (its parameters, and whether
                the kernel is row-invariant for it, are unknown).
        """
        key = f"{out_features}x{in_features}"
        if key in self.trial.params:
            return self.trial.params[key]
        if self.require_invariant:
            raise KernelError(f"{self.name}: shape {key} was not in the self-test "
                              f"({', '.join(s.key for s in self.shapes)}); select the kernel with every layer shape")
        return self.kernel.variants[0]

    def build(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        """The linear layer for ``weight [out, in]`` (float) and ``bias [out]`` (or None) with the chosen
        kernel and the parameters found for that shape: ``x [m, in]`` fp32 -> ``[m, out]`` fp32.

        Raises:
            KernelError: an untested shape where invariance is required, or a shape the kernel cannot serve.
        """
        return self.kernel.build(weight, bias, self.params_for(*weight.shape))

    def table_rows(self) -> list[dict]:
        """One dict per candidate: ``kernel``, ``available``, ``invariant`` (True/False/None), ``ms``
        (``{m: ms}`` of one forward pass's linear layers, shapes x counts), ``cost_ms``, ``weight_bytes``,
        ``chosen``, ``detail``, ``params``."""
        rows = []
        for trial in self.trials:
            ms = {m: (None if (t := trial.total_seconds(m, self.shapes)) is None else t * 1e3) for m in TIMED_ROWS}
            cost = trial.cost(self.shapes)
            rows.append({"kernel": trial.name, "available": trial.available, "invariant": trial.invariant, "ms": ms,
                         "cost_ms": None if cost is None else cost * 1e3, "weight_bytes": trial.weight_bytes,
                         "chosen": trial.name == self.name,
                         "detail": trial.detail, "params": dict(trial.params)})
        return rows

    def to_dict(self) -> dict:
        return {"name": self.name, "mode": self.mode, "require_invariant": self.require_invariant,
                "shapes": [[s.out_features, s.in_features, s.count, s.name] for s in self.shapes],
                "trials": [t.to_dict() for t in self.trials], "reason": self.reason, "cpu": self.cpu,
                "threads": self.threads, "torch_version": self.torch_version,
                "selftest_seconds": self.selftest_seconds,
                "load_average": None if self.load_average is None else list(self.load_average)}


# ----------------------------------------------------------------------------------------------- selecting
def kernel_cache_dir() -> Path:
    """``draftwise_home()/kernels`` (not created here)."""
    from draftwise.files import draftwise_home

    return draftwise_home() / "kernels"


def select_linear_kernel(
    mode: str,
    shapes: Iterable[LinearShape | Sequence[int]],
    *,
    threads: int | None = None,
    cache_dir: Path | None = None,
    kernel: str | None = None,
    require_invariant: bool = True,
    candidates: Sequence[LinearKernel] | None = None,
    repeats: int = 3,
    refresh: bool = False,
    check_all: bool = False,
) -> KernelChoice:
    """Choose the linear kernel of a quantization mode for this machine by a short measured self-test.

    On synthetic weights of each shape, candidate by candidate (in :data:`LINEAR_KERNELS` order): time it
    at m = 1, 2, 4, 8, 16 rows (fastest of ``repeats`` calls; stopped once its weighted cost
    :meth:`KernelTrial.cost` exceeds :data:`SLOWER_CUTOFF` times the fastest row-invariant one so far); if it
    is faster than that one, check its row invariance (:func:`check_row_invariance`: m = 1..17, and the
    prefill sizes 32..512 whose predicted call time is within :data:`LARGE_CALL_SECONDS`). The fastest
    row-invariant candidate wins; slower ones are left unchecked (``check_all`` checks them all, for a full
    table). For a kernel with variants, such as ``fp32-mkl-pad``'s row multiple R, the check keeps per shape
    the first row-invariant variant, and the layer is timed again with it. The result is cached (see the
    module docstring); a cache hit measures nothing.

    Args:
        mode: one of :data:`KERNEL_MODES`.
        shapes: the model's linear shapes (:class:`LinearShape` or ``(out, in[, count])``), e.g.
            :func:`llama_linear_shapes` or :func:`model_linear_shapes`.
        threads: intra-op threads for the test (default: torch's current setting); part of the cache key.
        cache_dir: default :func:`kernel_cache_dir`.
        kernel: force this kernel (default: the ``DRAFTWISE_KERNEL`` environment variable, a name or
            comma-separated names of which the one of this mode applies); it is still tested and refused when
            not row-invariant and ``require_invariant``.
        require_invariant: False for a draft model (its output need not be row-invariant): invariance is then
            not checked and each kernel runs its first variant (e.g. no padding).
        candidates: the kernels to consider instead of :data:`LINEAR_KERNELS` (tests).
        repeats: timed calls per row count (the fastest is kept).
        refresh: measure even when a cached result exists.
        check_all: check the invariance of every fully timed candidate, not only of those that could win.

    Returns:
        A :class:`KernelChoice`.

    Raises:
        KernelError: unknown mode or kernel name, a forced kernel of another mode, unavailable, or not
            row-invariant when required; or no candidate of the mode that is available and row-invariant.
        ValueError: no shapes, or malformed ones.
    """
    _check_mode(mode)
    shapes = as_shapes(shapes)
    pool = [k for k in (LINEAR_KERNELS if candidates is None else candidates) if k.mode == mode]
    forced = _forced_kernel(mode, pool, kernel, candidates)
    tested = [forced] if forced is not None else pool
    if not tested:
        raise KernelError(f"no kernel candidates for mode {mode!r}")
    with _torch_threads(threads) as n_threads:
        key = _cache_key(mode, shapes, tested, require_invariant, n_threads, check_all)
        path = Path(cache_dir or kernel_cache_dir()) / f"kernels-{mode}-{_digest(key)}.json"
        choice = None if refresh else _read_cached(path, key, tested)
        if choice is None:
            choice = _run_selftest(mode, shapes, tested, require_invariant, n_threads, repeats, forced is not None,
                                   check_all)
            try:
                from draftwise.files import write_json_atomic

                write_json_atomic(path, {"key": key, "choice": choice.to_dict()}, sort_keys=True)
            except OSError as exc:
                logger.warning("could not cache the kernel self-test at %s: %s", path, exc)
        else:
            logger.debug("kernel choice for %s read from %s", mode, path)
    if forced is not None:
        _require_usable(choice.trial, require_invariant)
    return choice


def _forced_kernel(mode: str, pool: Sequence[LinearKernel], kernel: str | None,
                   candidates: Sequence[LinearKernel] | None) -> LinearKernel | None:
    """The kernel forced by ``kernel`` or ``$DRAFTWISE_KERNEL`` for ``mode``, or None.

    Raises:
        KernelError: an explicit ``kernel`` not among the mode's candidates, or an environment value naming
            no known kernel.
    """
    known = {k.name: k for k in (*LINEAR_KERNELS, *(candidates or ()))}
    by_name = {k.name: k for k in pool}
    if kernel is not None:
        if kernel in by_name:
            return by_name[kernel]
        other = f" (it serves mode {known[kernel].mode!r})" if kernel in known else ""
        raise KernelError(f"kernel {kernel!r} is not a {mode!r} kernel{other}; {mode!r} kernels: "
                          f"{', '.join(by_name) or 'none'}")
    names = [n.strip() for n in os.environ.get(KERNEL_ENV, "").split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KernelError(f"{KERNEL_ENV}={os.environ[KERNEL_ENV]!r}: unknown kernel {unknown[0]!r}; kernels: "
                          f"{', '.join(known)}")
    mine = [n for n in names if n in by_name]
    if len(mine) > 1:
        raise KernelError(f"{KERNEL_ENV} names several {mode!r} kernels: {', '.join(mine)}")
    if names and not mine:
        logger.debug("%s=%s names no %r kernel; choosing by self-test", KERNEL_ENV, os.environ[KERNEL_ENV], mode)
    return by_name[mine[0]] if mine else None


def _require_usable(trial: KernelTrial, require_invariant: bool) -> None:
    """Raise KernelError when a forced kernel is unavailable or (when required) not row-invariant."""
    if not trial.available:
        raise KernelError(f"kernel {trial.name} is not available here: {trial.detail}")
    if require_invariant and not trial.invariant:
        raise KernelError(f"kernel {trial.name} is not row-invariant on this machine ({trial.detail}), so greedy "
                          "speculative decoding would not be exact; choose another kernel, or pass "
                          "require_invariant=False for a draft model")


@dataclass
class _Candidate:
    """Working state of one kernel during a self-test (becomes a :class:`KernelTrial`)."""

    kernel: LinearKernel
    available: bool = True
    invariant: bool | None = None
    detail: str = ""
    params: dict[str, dict] = field(default_factory=dict)
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)  # the timed layer per shape, reused by the check
    timed_out: bool = False  # timing stopped: far slower than a kernel timed before

    def cost(self, shapes: Sequence[LinearShape]) -> float:
        return sum(w * sum(s.count * self.seconds[s.key][m] for s in shapes) for m, w in COST_WEIGHTS.items())

    def trial(self, shapes: Sequence[LinearShape]) -> KernelTrial:
        k = self.kernel
        return KernelTrial(name=k.name, mode=k.mode, numerics=k.numerics, available=self.available,
                           invariant=self.invariant, detail=self.detail, params=self.params, seconds=self.seconds,
                           weight_bytes=sum(s.count * k.stored_bytes(s.out_features, s.in_features) for s in shapes))


def _run_selftest(mode: str, shapes: tuple[LinearShape, ...], kernels: Sequence[LinearKernel],
                  require_invariant: bool, threads: int, repeats: int, forced: bool, check_all: bool) -> KernelChoice:
    """Time each candidate, check the row invariance of those faster than the fastest row-invariant one so
    far (or of all), pick (see :func:`select_linear_kernel`)."""
    started = time.perf_counter()
    load = _load_average()
    logger.info("kernel self-test for mode %s (%d shapes, %d threads; cached after this run) ...",
                mode, len(shapes), threads)
    generator = torch.Generator().manual_seed(0)
    layers = {s.key: _synthetic_layer(s, generator) for s in shapes}
    candidates: list[_Candidate] = []
    stage = f"kernel self-test ({mode}; cached afterwards)"
    progress.report(stage, done=0, total=len(kernels), unit="kernels", estimate=False)
    for kernel in kernels:
        best = _best_cost(candidates, shapes, require_invariant)
        candidate = _time_candidate(kernel, shapes, layers, repeats, SLOWER_CUTOFF * best)
        candidates.append(candidate)
        if require_invariant and candidate.available and not candidate.timed_out and (
                check_all or forced or candidate.cost(shapes) < best):
            _check_candidate(candidate, shapes, layers, repeats)
        candidate.modules.clear()
        progress.report(stage, done=len(candidates), total=len(kernels), unit="kernels", estimate=False)
    for candidate in candidates:
        if require_invariant and candidate.available and not candidate.timed_out and candidate.invariant is None:
            candidate.detail = "invariance not checked: slower than a row-invariant kernel"
    del layers
    trials = tuple(c.trial(shapes) for c in candidates)
    for trial in trials:
        if not trial.available or trial.invariant is False:
            logger.info("kernel %s refused: %s", trial.name, trial.detail)
    chosen, reason = _pick(trials, shapes, require_invariant, forced)
    choice = KernelChoice(kernel=next(k for k in kernels if k.name == chosen.name), mode=mode,
                          require_invariant=require_invariant, shapes=shapes, trials=trials, reason=reason,
                          cpu=cpu_description(), threads=threads, torch_version=torch.__version__,
                          selftest_seconds=time.perf_counter() - started, load_average=load)
    logger.info("kernel for mode %s: %s (self-test %.1f s)", mode, reason, choice.selftest_seconds)
    return choice


@torch.inference_mode()
def _time_layer(module: nn.Module, x: torch.Tensor, repeats: int) -> dict[int, float]:
    """``{m: seconds}`` of ``module`` on the first m rows of ``x``, m in :data:`TIMED_ROWS`."""
    return {m: _call_seconds(module, x[:m], repeats) for m in TIMED_ROWS}


def _time_candidate(kernel: LinearKernel, shapes: Sequence[LinearShape], layers: Mapping[str, tuple],
                    repeats: int, budget: float = math.inf) -> _Candidate:
    """Time a kernel with its first variant on every shape, smallest shapes first (unavailable when it
    cannot run here or a shape). Timing stops once the weighted cost so far exceeds ``budget`` (s): such a
    kernel cannot be chosen, and its slowest calls are not worth waiting for."""
    missing = kernel.unavailable_reason()
    if missing is not None:
        return _Candidate(kernel, available=False, detail=f"not available: {missing}")
    candidate = _Candidate(kernel, detail="invariance not checked")
    spent = 0.0
    for shape in sorted(shapes, key=lambda s: s.out_features * s.in_features):
        weight, bias, x = layers[shape.key]
        candidate.params[shape.key] = dict(kernel.variants[0])
        try:
            module = candidate.modules[shape.key] = kernel.build(weight, bias, candidate.params[shape.key])
            seconds = candidate.seconds[shape.key] = {}
            for m in TIMED_ROWS:
                seconds[m] = _call_seconds(module, x[:m], repeats)
                spent += shape.count * COST_WEIGHTS.get(m, 0.0) * seconds[m]
                if spent > budget:
                    candidate.timed_out = True
                    candidate.modules.clear()
                    candidate.detail = (f"timing stopped at {shape.key}, m={m}: weighted cost already "
                                        f"{_ms(spent)}, over {SLOWER_CUTOFF:g}x the fastest kernel's")
                    return candidate
        except (KernelError, RuntimeError, NotImplementedError) as exc:
            first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
            return _Candidate(kernel, available=False, detail=f"{shape.key}: cannot run ({type(exc).__name__}: {first_line})")
    return candidate


def _best_cost(candidates: Sequence[_Candidate], shapes: Sequence[LinearShape], require_invariant: bool) -> float:
    """The lowest weighted cost among the fully timed candidates that can be chosen (row-invariant ones
    when required), or infinity."""
    costs = [c.cost(shapes) for c in candidates if c.available and not c.timed_out
             and (c.invariant or not require_invariant)]
    return min(costs, default=math.inf)


def _rows_to_check(seconds: Mapping[int, float]) -> tuple[int, ...]:
    """Row counts of the invariance check for a layer, given its timings: all up to 17, larger ones while
    the predicted call time (from the 16-row time) stays within :data:`LARGE_CALL_SECONDS`."""
    per_row = seconds[max(TIMED_ROWS)] / max(TIMED_ROWS)
    return tuple(m for m in INVARIANCE_ROWS if m <= FULL_CHECK_ROWS or per_row * m <= LARGE_CALL_SECONDS)


def _check_candidate(candidate: _Candidate, shapes: Sequence[LinearShape], layers: Mapping[str, tuple],
                     repeats: int) -> None:
    """Check one candidate on every shape (stopping at the first failing shape); keep per shape the first
    row-invariant variant and re-time the layer when that is not the variant timed."""
    notes = []
    kernel = candidate.kernel
    for shape in shapes:
        weight, bias, x = layers[shape.key]
        timed = (candidate.params[shape.key], candidate.modules.pop(shape.key))
        try:
            found, module, note = _invariant_variant(kernel, weight, bias, x,
                                                     _rows_to_check(candidate.seconds[shape.key]), timed)
            notes.append(f"{shape.key}: {note}")
            if found is None:
                candidate.invariant, candidate.detail = False, f"NOT row-invariant: {notes[-1]}"
                candidate.modules.clear()
                return
            if dict(found) != candidate.params[shape.key]:
                candidate.params[shape.key] = dict(found)
                candidate.seconds[shape.key] = _time_layer(module, x, repeats)
            del module
        except (KernelError, RuntimeError, NotImplementedError) as exc:
            candidate.invariant = False
            candidate.detail = f"{shape.key}: check failed to run ({type(exc).__name__}: {str(exc)[:160]})"
            return
    candidate.invariant, candidate.detail = True, "row-invariant: " + "; ".join(notes)


@torch.inference_mode()
def _invariant_variant(kernel: LinearKernel, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor,
                       rows: Sequence[int], built: tuple[Mapping, nn.Module]) -> tuple[Mapping | None, nn.Module | None, str]:
    """The first of the kernel's variants that is row-invariant for this layer over ``rows``, its module, and a
    note: which variant and the rows checked, or why each variant failed. ``built``: a variant's module that
    already exists (the timed one), used instead of building it again."""
    failures = []
    for variant in kernel.variants:
        module = built[1] if dict(variant) == dict(built[0]) else kernel.build(weight, bias, variant)
        result = check_row_invariance(module, x, rows)
        label = ",".join(f"{k}={v}" for k, v in variant.items())
        if result.invariant:
            return variant, module, f"{label + ': ' if label else ''}{result.detail}"
        failures.append(f"{label + ': ' if label else ''}{result.detail}")
        del module
    return None, None, "; ".join(failures)


def _pick(trials: Sequence[KernelTrial], shapes: Sequence[LinearShape], require_invariant: bool, forced: bool
          ) -> tuple[KernelTrial, str]:
    """The cheapest usable trial and the reason string (a forced kernel is returned as it is; the caller
    refuses it when unusable, after caching).

    Raises:
        KernelError: no usable candidate.
    """
    if forced:
        return trials[0], f"{trials[0].name} (forced; weighted cost {_ms(trials[0].cost(shapes))})"
    usable = [t for t in trials if t.available and (t.invariant or not require_invariant) and t.cost(shapes) is not None]
    if not usable:
        raise KernelError("no usable kernel: " + "; ".join(f"{t.name} ({t.detail})" for t in trials))
    best = min(usable, key=lambda t: t.cost(shapes))
    reason = (f"{best.name}: {'row-invariant, ' if require_invariant else ''}weighted cost {_ms(best.cost(shapes))} "
              f"(m=1: {_ms(best.total_seconds(1, shapes))})")
    slower = [t for t in trials if t.available and t is not best and t.invariant is not False]
    if slower:
        reason += "; beats " + ", ".join(f"{t.name} {_cost_text(t, shapes)}" for t in slower)
    refused = [t for t in trials if not t.available or (require_invariant and t.invariant is False)]
    if refused:
        reason += "; refused: " + ", ".join(
            f"{t.name} ({'unavailable' if not t.available else 'not row-invariant'}"
            f"{'' if not t.available else ', ' + _ms(t.cost(shapes))})" for t in refused)
    return best, reason


def _load_average() -> tuple[float, ...] | None:
    """``os.getloadavg()`` rounded, or None where the OS has none."""
    try:
        return tuple(round(v, 2) for v in os.getloadavg())
    except OSError:
        return None


def _cost_text(trial: KernelTrial, shapes: Sequence[LinearShape]) -> str:
    cost = trial.cost(shapes)
    return "(timing stopped)" if cost is None else _ms(cost)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _cache_key(mode: str, shapes: Sequence[LinearShape], kernels: Sequence[LinearKernel], require_invariant: bool,
               threads: int, check_all: bool) -> dict:
    flags = cpu_flags()
    return {"schema": CACHE_SCHEMA, "cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
            "cpu_flags_sha": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16],
            "torch": torch.__version__, "threads": threads, "mode": mode, "require_invariant": require_invariant,
            "shapes": [[s.out_features, s.in_features, s.count] for s in shapes],
            "kernels": [k.name for k in kernels], "check_all": check_all, "weights": {str(m): w for m, w in COST_WEIGHTS.items()}}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _read_cached(path: Path, key: dict, kernels: Sequence[LinearKernel]) -> KernelChoice | None:
    """The cached choice at ``path`` if it exists and matches ``key``, else None (a bad file is logged)."""
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        raw = data["choice"]
        by_name = {k.name: k for k in kernels}
        shapes = tuple(LinearShape(int(o), int(i), int(c), str(n)) for o, i, c, n in raw["shapes"])
        return KernelChoice(kernel=by_name[raw["name"]], mode=raw["mode"], require_invariant=bool(raw["require_invariant"]),
                            shapes=shapes, trials=tuple(KernelTrial.from_dict(t) for t in raw["trials"]),
                            reason=str(raw["reason"]), cpu=str(raw["cpu"]), threads=int(raw["threads"]),
                            torch_version=str(raw["torch_version"]), selftest_seconds=float(raw["selftest_seconds"]),
                            load_average=None if raw.get("load_average") is None else tuple(raw["load_average"]),
                            cached=True)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring unreadable kernel cache %s: %s", path, exc)
        return None


# ------------------------------------------------------------------------------------------------- machine
def _read_cpuinfo(path: Path) -> tuple[str, frozenset[str]]:
    """``(model name, flags)`` of the first processor in a ``/proc/cpuinfo``-format file (empty when absent)."""
    model, flags = "", frozenset()
    try:
        text = path.read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and not model:
            model = value.strip()
        elif name == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere, or ``"unknown CPU"``)."""
    return _read_cpuinfo(cpuinfo)[0] or platform.processor() or "unknown CPU"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    return _read_cpuinfo(cpuinfo)[1]


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """One line for every printed figure: model name, CPUs, and which of :data:`RELEVANT_CPU_FLAGS` the CPU
    has and lacks, e.g. ``"AMD EPYC, 2 CPUs; has avx2 fma; lacks avx512f ... amx_bf16"``."""
    model, flags = _read_cpuinfo(cpuinfo)
    model = model or platform.processor() or "unknown CPU"
    if not flags:
        return f"{model}, {os.cpu_count()} CPUs; flags unknown"
    has = [f for f in RELEVANT_CPU_FLAGS if f in flags]
    lacks = [f for f in RELEVANT_CPU_FLAGS if f not in flags]
    return f"{model}, {os.cpu_count()} CPUs; has {' '.join(has) or 'none of them'}; lacks {' '.join(lacks) or 'none'}"


def measure_dram_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, *, threads: int | None = None) -> float:
    """Streaming read bandwidth of main memory, bytes/s: ``torch.sum`` over an fp32 buffer of ``nbytes``
    (much larger than the last-level cache), the fastest of ``repeats`` passes after one warm-up pass.

    The fastest pass, not the median: it is the figure a weight-streaming lower bound per token
    (weight bytes / bandwidth) needs. Uses ``threads`` intra-op threads (default: torch's current setting);
    logged with the result. About 0.3-1 s for 512 MiB.

    Raises:
        ValueError: ``nbytes`` under 1 MiB or ``repeats`` < 1.
    """
    if nbytes < (1 << 20) or repeats < 1:
        raise ValueError(f"need nbytes >= 1 MiB and repeats >= 1, got {nbytes} and {repeats}")
    with _torch_threads(threads) as n_threads:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # written once: pages are mapped before timing
        torch.sum(buffer)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.sum(buffer)
            best = min(best, time.perf_counter() - t0)
        del buffer
    bandwidth = (nbytes // 4 * 4) / best
    logger.info("DRAM read bandwidth %.1f GB/s (%d MiB, %d threads, best of %d)", bandwidth / 1e9, nbytes >> 20,
                n_threads, repeats)
    return bandwidth
