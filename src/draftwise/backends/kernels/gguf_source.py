"""The ``q4k`` mode's layers: a GGUF file's quantized rows, found by value, on their own kernels.

A model loaded from a ``.gguf`` file arrives as float weights (the file's blocks dequantized), often fused or
reordered (q/k/v in one projection, permuted heads). :class:`GGUFSource` maps such a float weight back to the
file's blocks, row by row, so every layer runs on the blocks llama.cpp runs, with no second rounding:
Q4_K rows on :class:`draftwise.backends.kernels.q4k.Q4KLinear`, Q6_K, Q8_0 and Q5_0 rows on
:class:`draftwise.backends.kernels.gguf_blocks.GGUFBlockLinear`, and a weight whose rows come from tensors of
different types (a fused projection) on one module per consecutive run of a type
(:class:`draftwise.backends.kernels.gguf_blocks.SegmentedLinear`).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn

from draftwise.backends.kernels.gguf_blocks import (
    BLOCK_FORMATS,
    SegmentedLinear,
    block_format,
    dequantize_blocks,
    gguf_linear,
)
from draftwise.backends.kernels.q4k import (
    SUPER_BLOCK,
    Q4KLinear,
    dequantize_q4k,
    load_q4k_ops,
    pack_gguf_q4k,
    quantize_q4k,
)

__all__ = ["SERVED_TYPES", "GGUFSource", "q4k_linear_factory", "Q4KKernel"]

logger = logging.getLogger(__name__)

#: GGUF tensor types with a row-invariant kernel (``GGMLQuantizationType`` names).
SERVED_TYPES = ("Q4_K", *BLOCK_FORMATS)
_DEQUANTIZE_ROWS = 8192  # rows dequantized at a time while reading (bounds the float copy of a large tensor)


def _row_key(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


class GGUFSource:
    """The quantized rows of a GGUF file (types :data:`SERVED_TYPES`), found by value: ``blocks_for(weight)`` gives
    the file's blocks of a float weight whose every row is the exact dequantization of some row of the file
    (fused or permuted projections included), ``linear_for(weight, bias)`` the kernel layer over them.

    Args:
        path: the ``.gguf`` file. Reading dequantizes every served tensor once (numpy; tens of seconds for
            1.5B weights) and keeps a 16-byte digest per row, not the floats.
    """

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader
        from gguf.quants import dequantize

        self.path = str(path)
        self._reader = GGUFReader(self.path)
        self._rows: dict[bytes, tuple[int, int]] = {}
        self._tensors: list[tuple[str, np.ndarray]] = []  # (type name, raw rows [rows, row bytes])
        for tensor in self._reader.tensors:
            kind = tensor.tensor_type.name
            if kind not in SERVED_TYPES:
                continue
            raw = np.asarray(tensor.data).reshape(int(tensor.shape[-1]) if tensor.shape.size > 1 else 1, -1)
            index = len(self._tensors)
            self._tensors.append((kind, raw))
            for start in range(0, raw.shape[0], _DEQUANTIZE_ROWS):
                chunk = raw[start:start + _DEQUANTIZE_ROWS]
                floats = dequantize(chunk, tensor.tensor_type).astype(np.float32, copy=False)
                for r in range(floats.shape[0]):
                    self._rows.setdefault(_row_key(floats[r]), (index, start + r))
        logger.info("%s: %d quantized rows in %d tensors (%s)", self.path, len(self._rows), len(self._tensors),
                    ", ".join(f"{n} {t}" for t, n in sorted(self.tensor_types().items())))

    def __len__(self) -> int:
        return len(self._rows)

    def tensor_types(self) -> Counter:
        """How many served tensors the file has of each type (``{"Q4_K": 169, ...}``)."""
        return Counter(kind for kind, _ in self._tensors)

    def blocks_for(self, weight: torch.Tensor) -> list[tuple[str, np.ndarray]] | None:
        """The file's rows of ``weight [out, in]`` fp32 as ``[(type, raw rows [n, row bytes] uint8), ...]``, one
        entry per consecutive run of output rows of one type, when every row is a row of the file (checked bit
        for bit: the raw rows dequantize to the weight's), else None."""
        floats = weight.detach().to(torch.float32).contiguous()
        found = []
        for row in floats.numpy():
            hit = self._rows.get(_row_key(row))
            if hit is None:
                return None
            found.append(hit)
        segments: list[tuple[str, list[np.ndarray]]] = []
        for t, r in found:
            kind, raw = self._tensors[t]
            if not segments or segments[-1][0] != kind:
                segments.append((kind, []))
            segments[-1][1].append(raw[r])
        blocks = [(kind, np.stack(rows)) for kind, rows in segments]
        if not torch.equal(torch.cat([_dequantize(kind, raw) for kind, raw in blocks]), floats):
            logger.warning("%s: rows matched by digest did not dequantize to the weight; not using them", self.path)
            return None
        return blocks

    def linear_for(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module | None:
        """The kernel layer over the file's rows of ``weight [out, in]`` (``bias [out]`` or None): one module
        when all rows have one type, a :class:`SegmentedLinear` otherwise; None when a row is not in the file.

        Raises:
            KernelError: the kernels are not available here.
        """
        blocks = self.blocks_for(weight)
        if blocks is None:
            return None
        layers, start = [], 0
        for kind, raw in blocks:
            part = None if bias is None else bias[start:start + raw.shape[0]]
            layers.append(gguf_linear(kind, raw, part))
            start += raw.shape[0]
        return layers[0] if len(layers) == 1 else SegmentedLinear(layers)


def _dequantize(kind: str, raw: np.ndarray) -> torch.Tensor:
    """Raw rows of type ``kind`` -> float32 as the kernel sees them (Q4_K through its repacked form)."""
    return dequantize_q4k(pack_gguf_q4k(raw)) if kind == "Q4_K" else dequantize_blocks(raw, block_format(kind))


class Q4KKernel:
    """The q4k mode as a ``kernel=`` for :func:`draftwise.backends.quantization.quantize_model`."""

    mode = "q4k"
    name = "q4k-cpp"

    def __init__(self, source: GGUFSource | None = None) -> None:
        self._build = q4k_linear_factory(source)

    def build(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """The layer for ``weight [out, in]`` (the file's blocks or Q4_K where it can, else int8)."""
        return self._build(weight, bias)


def q4k_linear_factory(source: GGUFSource | None = None):
    """The lean runtime's layer factory for the ``q4k`` mode: ``build(weight [out, in], bias) -> nn.Module``.

    With a GGUF ``source``, a weight whose rows are all rows of the file's Q4_K, Q6_K, Q8_0 or Q5_0 tensors runs
    on those blocks (:meth:`GGUFSource.linear_for`); any other weight of that file (a float tensor, a row
    found nowhere) stays int8, as re-quantizing an already quantized weight would compound two roundings.
    Without a source (a float checkpoint), every weight with ``in`` a multiple of 256 is quantized to Q4_K
    (:func:`draftwise.backends.kernels.q4k.quantize_q4k`). Weights of other widths run int8.

    Raises:
        Q4KError: the kernels cannot be built here.
    """
    from importlib import import_module

    Int8Linear = import_module("draftwise.backends.quantization").Int8Linear  # noqa: N806 - below layers
    load_q4k_ops()

    def build(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        if source is not None:
            layer = source.linear_for(weight, bias)
            if layer is not None:
                return layer
        elif weight.shape[1] % SUPER_BLOCK == 0:
            return Q4KLinear(quantize_q4k(weight), bias)
        return Int8Linear(weight, bias)

    return build
