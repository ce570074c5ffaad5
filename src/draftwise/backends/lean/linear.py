"""Row-invariant linear layers for the lean runtime, by quantization mode.

``int8``: :class:`draftwise.backends.quantization.Int8Linear` (exact by construction). ``none``: float32 weights
through the BLAS GEMM, with the input rows zero-padded to a multiple R for which the GEMM gives a row the same
bits whatever the row count (measured per shape at first use: R = 4 on MKL / AMD Zen3; R = 1 where the GEMM is
already invariant).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from draftwise.backends.quantization import Int8Linear, parse_quantization

if TYPE_CHECKING:
    from draftwise.backends.kernels import KernelChoice, LinearShape

__all__ = ["PaddedLinear", "linear_factory", "gemm_row_multiple", "lean_linear_shapes", "select_lean_kernel",
           "selected_linear_factory"]

logger = logging.getLogger(__name__)

_MULTIPLES = (1, 2, 4, 8, 16)
#: Kernels of :mod:`draftwise.backends.kernels` the lean runtime may pick per mode.
_SAME_NUMERICS = {"int8": ("fbgemm-int8", "onednn-int8"), "none": ("fp32-mkl-pad", "onednn-fp32")}
_TEST_ROWS = (1, 2, 3, 5, 6, 7, 9, 13, 17, 33)


@functools.lru_cache(maxsize=None)
def gemm_row_multiple(in_features: int, out_features: int, threads: int) -> int:
    """The smallest row padding (of 1, 2, 4, 8, 16) making ``F.linear`` row-invariant for this shape here.

    Raises:
        RuntimeError: none is.
    """
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(max(_TEST_ROWS), in_features, generator=generator)
    for multiple in _MULTIPLES:
        alone = [_padded(x[i:i + 1], weight, None, multiple) for i in range(max(_TEST_ROWS))]
        if all(torch.equal(_padded(x[:m], weight, None, multiple)[i], alone[i][0]) for m in _TEST_ROWS for i in range(m)):
            return multiple
    raise RuntimeError(f"no row padding makes a {in_features}x{out_features} float GEMM row-invariant on this CPU")


def _padded(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, multiple: int) -> torch.Tensor:
    m = x.shape[0]
    target = -(-m // multiple) * multiple
    if target != m:
        x = torch.cat([x, x.new_zeros(target - m, x.shape[1])])
    return F.linear(x, weight, bias)[:m]


class PaddedLinear(nn.Module):
    """``y = x W^T + b`` in float32 with rows zero-padded to a multiple of :func:`gemm_row_multiple`.

    Args:
        weight: ``[out, in]``; bias: ``[out]`` or None.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.multiple = gemm_row_multiple(weight.shape[1], weight.shape[0], torch.get_num_threads())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[m, in] -> [m, out]``."""
        return _padded(x, self.weight, self.bias, self.multiple)

    def nbytes(self) -> int:
        """Bytes stored (float32 weight and bias)."""
        return 4 * (self.weight.numel() + (0 if self.bias is None else self.bias.numel()))


def selected_linear_factory(quantization: str | None, config, q4k_source=None):
    """The linear layers the machine's kernel self-test picks for a lean model's shapes
    (:func:`draftwise.backends.kernels.select_linear_kernel`: fastest row-invariant kernel of the mode, measured
    once per machine and cached), falling back to :func:`linear_factory`'s layer for a shape the self-test did
    not cover (an FR-Spec subset head).

    Args:
        quantization: ``"none"``, ``"int8"`` or ``"q4k"`` (a kernel per GGUF block type, row-invariant by
            construction: :func:`draftwise.backends.kernels.gguf_source.q4k_linear_factory`; the load-time
            self-test on the real weights checks it).
        config: the model's :class:`draftwise.backends.lean.model.LeanConfig`.
        q4k_source: the GGUF file's quantized rows (:class:`draftwise.backends.kernels.gguf_source.GGUFSource`)
            or None.
    """
    from draftwise.backends.kernels import KernelError

    mode = parse_quantization(quantization)
    if mode == "q4k":
        return linear_factory(mode, q4k_source=q4k_source)
    fallback = linear_factory(mode)
    choice = select_lean_kernel(mode, config)
    logger.info("lean runtime: %s linear layers through %s (%s)", mode, choice.name, choice.reason)

    def build(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        try:
            return choice.build(weight, bias)
        except KernelError:
            return fallback(weight, bias)

    return build


def lean_linear_shapes(config) -> tuple[LinearShape, ...]:
    """The linear layers of one forward pass of a lean model (``config``: its
    :class:`draftwise.backends.lean.model.LeanConfig`): fused q/k/v, o, fused gate/up and down per layer, and the
    LM head (:func:`draftwise.backends.kernels.llama_linear_shapes`)."""
    from draftwise.backends.kernels import llama_linear_shapes

    return llama_linear_shapes(hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                               intermediate=config.intermediate_size, vocab=config.vocab_size,
                               layers=config.num_layers, head_dim=config.head_dim)


def select_lean_kernel(mode: str, config) -> KernelChoice:
    """The kernel self-test's choice for ``mode`` on a lean model's shapes (:func:`lean_linear_shapes`;
    :func:`draftwise.backends.kernels.select_linear_kernel`, measured once per machine and cached). The one call
    behind both the lean runtime's layers (:func:`selected_linear_factory`) and ``--quantization auto``'s
    comparison of modes (:mod:`draftwise.models.auto_quantization`), so they share one cached measurement.

    Candidates: for ``"int8"`` and ``"none"`` only the kernels of the mode's numerics (int8 = 8-bit weights x
    7-bit per-row activations: fbgemm and oneDNN give the same bits, so a model's output does not depend on which
    one this machine measured faster); for another mode (``"q4k"``) every kernel of the mode.

    Raises:
        KernelError: an unknown mode, or no candidate of it that is available and row-invariant here (shapes the
            kernels cannot serve included).
        ValueError: malformed shapes in ``config``.
    """
    from draftwise.backends.kernels import linear_kernels, select_linear_kernel

    names = _SAME_NUMERICS.get(mode)
    candidates = [k for k in linear_kernels(mode) if names is None or k.name in names]
    return select_linear_kernel(mode, candidates=candidates, shapes=lean_linear_shapes(config))


def linear_factory(quantization: str | None, q4k_source=None):
    """The row-invariant linear layer factory ``(weight [out, in], bias) -> module`` of a quantization mode:
    :class:`Int8Linear` for ``"int8"``, :class:`PaddedLinear` for ``"none"``, and for ``"q4k"``
    :func:`draftwise.backends.kernels.gguf_source.q4k_linear_factory` (the GGUF file's blocks from ``q4k_source``
    when given).

    Raises:
        ValueError: unknown mode. draftwise.backends.kernels.q4k.Q4KError: q4k without its kernel here.
    """
    mode = parse_quantization(quantization)
    if mode == "q4k":
        from draftwise.backends.kernels.gguf_source import q4k_linear_factory

        return q4k_linear_factory(q4k_source)
    return Int8Linear if mode == "int8" else PaddedLinear
