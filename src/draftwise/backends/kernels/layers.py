"""The linear modules the kernels build (padded fp32, oneDNN fp32/bf16/int8, weight-only int8/int4)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from draftwise.backends.kernels.settings import INT4_GROUP_SIZES
from draftwise.backends.quantization import _ACT_ZERO_POINT, quantize_weight_rows, row_grid_scale

logger = logging.getLogger(__name__)


class KernelError(ValueError):
    """A kernel cannot be used: unknown name, not available here, unsupported shape, or not row-invariant
    where invariance is required."""


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
        to_grid = row_grid_scale(rows)  # [m, 1]
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


