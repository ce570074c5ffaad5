"""The candidate kernels (:class:`LinearKernel`), one quantization mode each: :data:`LINEAR_KERNELS`."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from draftwise.backends.kernels.layers import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    KernelError,
    OneDnnFloatLinear,
    OneDnnInt8Linear,
    PaddedFloatLinear,
    _float_weight,
)
from draftwise.backends.kernels.settings import INT4_GROUP_SIZES, KERNEL_MODES, PAD_ROWS
from draftwise.backends.quantization import Int8Linear, int8_kernels_available

logger = logging.getLogger(__name__)


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
        probe_in_features: input width of the availability probe (a width the kernel accepts).
    """

    name: str
    mode: str
    numerics: str
    factory: Callable[..., nn.Module] = field(repr=False)
    variants: tuple[Mapping, ...] = ({},)
    bytes_per_weight: float = 4.0
    bytes_per_scale_group: tuple[int, int | None] | None = None
    row_invariant_by_construction: bool = False
    probe_in_features: int = 128

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
                width = self.probe_in_features
                module = self.factory(torch.randn(32, width), torch.randn(32), **self.variants[0])
                y = module(torch.randn(3, width))
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


def _build_q4k(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    from draftwise.backends.kernels.q4k import Q4KLinear

    return Q4KLinear.from_float(_float_weight(weight), bias)


def _build_gguf_blocks(ggml_type: str) -> Callable[..., nn.Module]:
    def build(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        from draftwise.backends.kernels.gguf_blocks import GGUFBlockLinear, block_format

        return GGUFBlockLinear.from_float(block_format(ggml_type), _float_weight(weight), bias)
    return build


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
    LinearKernel("q4k-cpp", "q4k", "GGUF Q4_K weights (4-bit, 6-bit scales and mins per 32), activations per row "
                 "to int8 per 256, integer sums, fixed-order fp32 accumulation (draftwise's C++ kernel)",
                 _build_q4k, bytes_per_weight=0.5, bytes_per_scale_group=(24, 256), row_invariant_by_construction=True,
                 probe_in_features=256),
    LinearKernel("q6k-cpp", "q6k", "GGUF Q6_K weights, regrouped 8 rows at a time (6-bit, an int8 scale per 16), "
                 "activations per row to int8 per 256, integer sums, fixed-order fp32 accumulation (draftwise's C++ kernel)",
                 _build_gguf_blocks("Q6_K"), bytes_per_weight=210 / 256, row_invariant_by_construction=True,
                 probe_in_features=256),
    LinearKernel("q8_0-cpp", "q8_0", "GGUF Q8_0 weights, regrouped 8 rows at a time (8-bit, an fp16 scale per 32), "
                 "activations per row to int8 per 32, integer sums, fixed-order fp32 accumulation (draftwise's C++ kernel)",
                 _build_gguf_blocks("Q8_0"), bytes_per_weight=34 / 32, row_invariant_by_construction=True,
                 probe_in_features=256),
    LinearKernel("q5_0-cpp", "q5_0", "GGUF Q5_0 weights, regrouped 8 rows at a time (5-bit, an fp16 scale per 32), "
                 "activations per row to int8 per 32, integer sums, fixed-order fp32 accumulation (draftwise's C++ kernel)",
                 _build_gguf_blocks("Q5_0"), bytes_per_weight=22 / 32, row_invariant_by_construction=True,
                 probe_in_features=256),
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


