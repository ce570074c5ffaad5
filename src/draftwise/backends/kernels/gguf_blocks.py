"""GGUF's other block formats on the row-invariant C++ kernels: Q6_K, Q8_0 and Q5_0, the file's weights regrouped.

Formats (ggml's ``ggml-common.h``; dequantization as ``dequantize_row_q6_K`` / ``_q8_0`` / ``_q5_0`` of
``ggml-quants.c``, and as the ``gguf`` package's ``gguf.quants.dequantize``):

- Q6_K: super-blocks of 256 weights, 210 bytes: ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), 16 int8
  scales (one per 16 weights), fp16 ``d``; ``w = d * sc * (q - 32)``, q in 0..63.
- Q8_0: blocks of 32, 34 bytes: fp16 ``d``, 32 int8 quants; ``w = d * q``.
- Q5_0: blocks of 32, 22 bytes: fp16 ``d``, 32 fifth bits, 16 bytes of nibbles (low: weight j, high: j + 16);
  ``w = d * (q - 16)``, q in 0..31.

A packed weight holds the GGUF rows' bytes, ``[out, in / block * block_bytes]`` uint8: no second rounding, and the
bytes streamed per weight are llama.cpp's. The rows are regrouped (:func:`regroup`) so that 8 weight rows sit side
by side, as Q4_K's do: one vector load holds 8 weights of each of 8 rows. The kernels (``q4k.cpp``) quantize each
activation row on its own to int8 (per 256 for Q6_K, per 32 for Q8_0 and Q5_0), sum each block in integers
and accumulate in fp32 in one fixed order: row-invariant by construction, as the Q4_K kernel
(:mod:`draftwise.backends.kernels.q4k`, whose extension holds them all).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draftwise.backends.kernels.layers import KernelError, _KernelLinear
from draftwise.backends.kernels.q4k import GGUFOpLinear, Q4KLinear, load_q4k_ops, pack_gguf_q4k, row_groups

__all__ = ["BlockFormat", "BLOCK_FORMATS", "block_format", "quantize_blocks", "dequantize_blocks", "quantize_q6k",
           "regroup", "file_rows", "GGUFBlockLinear", "SegmentedLinear", "gguf_linear"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format with a kernel of its own.

    Attributes:
        ggml_type: the ``gguf.GGMLQuantizationType`` name (``"Q6_K"``).
        mode: the kernel mode (:data:`draftwise.backends.kernels.settings.KERNEL_MODES`).
        kernel_name: the kernel's name in :data:`draftwise.backends.kernels.LINEAR_KERNELS`.
        op: the op of ``torch.ops.draftwise_q4k``.
        block_weights: weights per block (``in_features`` must be a multiple).
        block_bytes: bytes per block.
    """

    ggml_type: str
    mode: str
    kernel_name: str
    op: str
    block_weights: int
    block_bytes: int

    @property
    def bytes_per_weight(self) -> float:
        """Stored bytes per weight, scales included."""
        return self.block_bytes / self.block_weights


#: The formats with a kernel besides Q4_K, by ``GGMLQuantizationType`` name.
BLOCK_FORMATS: dict[str, BlockFormat] = {
    f.ggml_type: f for f in (
        BlockFormat("Q6_K", "q6k", "q6k-cpp", "linear_q6_k", 256, 210),
        BlockFormat("Q8_0", "q8_0", "q8_0-cpp", "linear_q8_0", 32, 34),
        BlockFormat("Q5_0", "q5_0", "q5_0-cpp", "linear_q5_0", 32, 22),
    )
}


def block_format(ggml_type: str) -> BlockFormat:
    """The :class:`BlockFormat` of a ``GGMLQuantizationType`` name.

    Raises:
        KernelError: a type without a kernel here.
    """
    try:
        return BLOCK_FORMATS[ggml_type]
    except KeyError:
        raise KernelError(f"no kernel for GGUF type {ggml_type}; kernels exist for Q4_K, "
                          f"{', '.join(BLOCK_FORMATS)}") from None


def _ggml_type(fmt: BlockFormat):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[fmt.ggml_type]


def _check_width(fmt: BlockFormat, in_features: int) -> int:
    if in_features % fmt.block_weights:
        raise KernelError(f"{fmt.ggml_type} needs in_features divisible by {fmt.block_weights}, got {in_features}")
    return in_features // fmt.block_weights


# ------------------------------------------------------------------------------------------ format helpers
def quantize_q6k(weight: np.ndarray) -> np.ndarray:
    """Float ``weight [out, in]`` (``in`` a multiple of 256) -> GGUF Q6_K rows ``[out, in / 256 * 210]`` uint8:
    per 16 weights a scale putting the largest magnitude at -32 (ggml's sign convention), the 16 scales on int8
    against the super-block's fp16 ``d``, quants rounded against the scale as dequantized (a plain fit, without
    ggml's iterative search of ``make_qx_quants``)."""
    out, in_features = weight.shape
    nb = in_features // 256
    x = np.asarray(weight, dtype=np.float64).reshape(out, nb, 16, 16)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]  # [out, nb, 16] signed
    scale = peak / -32.0
    d = (np.abs(scale).max(-1) / 127.0).astype(np.float16)  # [out, nb]
    d32 = d.astype(np.float32)
    sc = np.clip(np.rint(np.divide(scale, d32[..., None], out=np.zeros_like(scale), where=d32[..., None] > 0)),
                 -128, 127).astype(np.int8)
    step = (d32[..., None] * sc.astype(np.float32)).astype(np.float64)  # what dequantization multiplies by
    q = np.divide(x, step[..., None], out=np.zeros_like(x), where=step[..., None] != 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(out, nb, 2, 4, 32)  # [.., half, k, l]
    ql = (q[..., 0:2, :] & 0x0F) | ((q[..., 2:4, :] & 0x0F) << 4)  # [.., half, 2, 32]
    qh = sum(((q[..., k, :] >> 4) << (2 * k)) for k in range(4)).astype(np.uint8)  # [.., half, 32]
    blocks = np.empty((out, nb, 210), dtype=np.uint8)
    blocks[..., 0:128] = ql.reshape(out, nb, 128)
    blocks[..., 128:192] = qh.reshape(out, nb, 64)
    blocks[..., 192:208] = sc.view(np.uint8)
    blocks[..., 208:210] = d.reshape(out, nb, 1).view(np.uint8)
    return blocks.reshape(out, nb * 210)


def quantize_blocks(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Float ``weight [out, in]`` -> its GGUF rows in ``fmt`` ``[out, in / block * block_bytes]`` uint8 (Q8_0 and
    Q5_0 by the ``gguf`` package's quantizers, Q6_K by :func:`quantize_q6k`).

    Raises:
        KernelError: ``in`` not a multiple of the block.
    """
    _check_width(fmt, weight.shape[1])
    floats = weight.detach().to(torch.float32).cpu().contiguous().numpy()
    if fmt.ggml_type == "Q6_K":
        raw = quantize_q6k(floats)
    else:
        from gguf.quants import quantize

        raw = quantize(floats, _ggml_type(fmt))
    return torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8))


def dequantize_blocks(packed: torch.Tensor | np.ndarray, fmt: BlockFormat) -> torch.Tensor:
    """GGUF rows ``[out, nb * block_bytes]`` -> float32 ``[out, nb * block_weights]``, as ``gguf`` dequantizes
    them (ggml's ``dequantize_row_*``)."""
    from gguf.quants import dequantize

    raw = packed.contiguous().numpy() if isinstance(packed, torch.Tensor) else np.asarray(packed)
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, _ggml_type(fmt)), dtype=np.float32))


def _q6k_fields(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q6_K rows ``[out, nb * 210]`` -> quants ``[out, nb, 256]`` 0..63, scale bytes ``[out, nb, 16]``, fp16 d
    bytes ``[out, nb, 2]`` (``dequantize_row_q6_K``'s reading: weight ``128h + 32k + l`` has its low 4 bits in
    ``ql[64h + 32(k % 2) + l]`` (high nibble for k >= 2) and its high 2 bits at ``2k`` of ``qh[32h + l]``)."""
    blocks = raw.reshape(raw.shape[0], -1, 210)
    ql = blocks[..., :128].reshape(*blocks.shape[:2], 2, 2, 32)      # [h, k % 2, l]
    qh = blocks[..., 128:192].reshape(*blocks.shape[:2], 2, 1, 32)   # [h, -, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)              # [h, k, l], k = 0..3
    high = np.concatenate([(qh >> (2 * k)) & 3 for k in range(4)], axis=-2)
    quants = (low | (high << 4)).reshape(*blocks.shape[:2], 256)
    return quants, blocks[..., 192:208], blocks[..., 208:210]


#: the quant parts of a regrouped Q6_K super-block in reading order: ("ql", p) low nibbles of sub-blocks 2p, 2p + 1;
#: ("qh", h) the high bits of sub-blocks 4h..4h + 3
_Q6K_PARTS = (("ql", 0), ("qh", 0), ("ql", 1), ("ql", 2), ("qh", 1), ("ql", 3))

#: bytes per weight row and block of each plane of a regrouped format, in the packed tensor's order
_PLANE_BYTES = {"Q6_K": (192, 18), "Q8_0": (32, 2), "Q5_0": (16, 4, 2)}


def _q6k_planes(raw: np.ndarray, rows: int) -> list[np.ndarray]:
    """Q6_K rows ``[g * rows, nb * 210]`` -> quants (per super-block the parts of :data:`_Q6K_PARTS`, each
    ``[4, rows, 8]``: 8 weights of each row side by side) and meta (scales ``[8, rows, 2]``, fp16 ``d [rows]``)."""
    quants, scales, d = _q6k_fields(raw)
    g, nb = raw.shape[0] // rows, quants.shape[1]
    q = quants.reshape(g, rows, nb, 8, 4, 8)                                          # [g, r, b, sub, k, i]
    low, high = q & 0x0F, q >> 4
    nibbles = (low[:, :, :, 0::2] | (low[:, :, :, 1::2] << 4)).transpose(0, 2, 3, 4, 1, 5)  # [g, b, p, k, r, i]
    bits = high.reshape(g, rows, nb, 2, 4, 4, 8)                                      # [g, r, b, h, c, k, i]
    bits = sum(bits[:, :, :, :, c] << (2 * c) for c in range(4)).astype(np.uint8).transpose(0, 2, 3, 4, 1, 5)
    parts = {"ql": nibbles, "qh": bits}
    plane = np.concatenate([parts[kind][:, :, j].reshape(g, nb, 32 * rows) for kind, j in _Q6K_PARTS], axis=2)
    meta = np.concatenate([scales.reshape(g, rows, nb, 8, 2).transpose(0, 2, 3, 1, 4).reshape(g, nb, 16 * rows),
                           d.reshape(g, rows, nb, 2).transpose(0, 2, 1, 3).reshape(g, nb, 2 * rows)], axis=2)
    return [plane, meta]


def _q6k_blocks(planes: list[np.ndarray], rows: int) -> np.ndarray:
    """The inverse of :func:`_q6k_planes`: GGUF Q6_K blocks ``[g * rows, nb, 210]``."""
    g, nb = planes[0].shape[:2]
    count = g * rows
    block = planes[0].reshape(g, nb, 6, 4, rows, 8)
    parts = {part: block[:, :, n].transpose(0, 3, 1, 2, 4) for n, part in enumerate(_Q6K_PARTS)}  # [g, r, b, k, i]
    low = np.stack([np.stack([parts["ql", p] & 0x0F, parts["ql", p] >> 4], axis=3) for p in range(4)], axis=3)
    high = np.stack([np.stack([(parts["qh", h] >> (2 * c)) & 3 for c in range(4)], axis=3) for h in range(2)], axis=3)
    quants = (low.reshape(g, rows, nb, 8, 4, 8) | (high.reshape(g, rows, nb, 8, 4, 8) << 4)).reshape(count, nb, 2, 4, 32)
    meta = planes[1]
    scales = meta[..., :16 * rows].reshape(g, nb, 8, rows, 2).transpose(0, 3, 1, 2, 4).reshape(count, nb, 16)
    d = meta[..., 16 * rows:].reshape(g, nb, rows, 2).transpose(0, 2, 1, 3).reshape(count, nb, 2)
    ql = (quants[:, :, :, 0:2] & 0x0F) | ((quants[:, :, :, 2:4] & 0x0F) << 4)       # [h, k % 2, l]
    qh = sum(((quants[:, :, :, k] >> 4) & 3) << (2 * k) for k in range(4)).astype(np.uint8)  # [h, l]
    return np.concatenate([ql.reshape(count, nb, 128), qh.reshape(count, nb, 64), scales, d], axis=2)


def _q5_0_quants(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks ``[..., 22]`` -> quants ``[..., 32]`` 0..31 (``dequantize_row_q5_0``: the low nibble of byte
    j is weight j, the high nibble weight j + 16, bit j of ``qh`` its fifth bit)."""
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0]
    nibbles = np.concatenate([blocks[..., 6:22] & 0x0F, blocks[..., 6:22] >> 4], axis=-1)
    fifth = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return (nibbles | (fifth.astype(np.uint8) << 4)).astype(np.uint8)


def _block32_planes(kind: str, blocks: np.ndarray, rows: int) -> list[np.ndarray]:
    """Q8_0 or Q5_0 blocks ``[g * rows, nb, block bytes]`` -> the planes, each ``[g, nb, bytes per row * rows]``:
    Q8_0: quants ``[4, rows, 8]`` (q + 128), d; Q5_0: nibbles ``[2, rows, 8]`` (low: weight 8j + i, high: 16 + 8j + i),
    fifth bits ``[4, rows, 8]`` (one bit each, packed little-endian), d. ``d`` is ``[rows]`` fp16 bytes."""
    count, nb = blocks.shape[:2]
    g = count // rows
    d = blocks[..., 0:2].reshape(g, rows, nb, 2).transpose(0, 2, 1, 3).reshape(g, nb, 2 * rows)
    if kind == "Q8_0":
        q = (blocks[..., 2:34] ^ 0x80).reshape(g, rows, nb, 4, 8).transpose(0, 2, 3, 1, 4)
        return [q.reshape(g, nb, 32 * rows), d]
    q = _q5_0_quants(blocks).reshape(g, rows, nb, 4, 8).transpose(0, 2, 3, 1, 4)  # [g, b, k, r, i]
    nibbles = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)
    bits = np.packbits((q >> 4).reshape(g, nb, 32 * rows), axis=-1, bitorder="little")
    return [nibbles.reshape(g, nb, 16 * rows), bits, d]


def _block32_blocks(kind: str, planes: list[np.ndarray], rows: int) -> np.ndarray:
    """The inverse of :func:`_block32_planes`: GGUF blocks ``[g * rows, nb, block bytes]``."""
    g, nb = planes[0].shape[:2]
    count = g * rows
    blocks = np.empty((count, nb, BLOCK_FORMATS[kind].block_bytes), np.uint8)
    blocks[..., 0:2] = planes[-1].reshape(g, nb, rows, 2).transpose(0, 2, 1, 3).reshape(count, nb, 2)
    if kind == "Q8_0":
        blocks[..., 2:34] = planes[0].reshape(g, nb, 4, rows, 8).transpose(0, 3, 1, 2, 4).reshape(count, nb, 32) ^ 0x80
        return blocks
    nibbles = planes[0].reshape(g, nb, 2, rows, 8)
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)                     # [g, b, k, r, i]
    fifth = np.unpackbits(planes[1], axis=-1, bitorder="little").reshape(g, nb, 4, rows, 8)
    q = (low | (fifth << 4)).transpose(0, 3, 1, 2, 4).reshape(count, nb, 32)
    qh = (((q >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    blocks[..., 2:6] = qh.astype("<u4")[..., None].view(np.uint8)
    blocks[..., 6:22] = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)
    return blocks


def _plane_spans(fmt: BlockFormat, out: int, nb: int, first: int, count: int) -> list[slice]:
    """Where rows ``[first, first + count)`` lie in each plane of a packed ``[out, nb * block_bytes]`` weight."""
    spans, start = [], 0
    for width in _PLANE_BYTES[fmt.ggml_type]:
        spans.append(slice(start + first * nb * width, start + (first + count) * nb * width))
        start += out * nb * width
    return spans


def regroup(fmt: BlockFormat, raw: np.ndarray) -> torch.Tensor:
    """GGUF rows ``[out, nb * block_bytes]`` -> the kernel's layout, the same size (``q4k.cpp``): planes (bytes per
    row and block: Q6_K 192 of quants, 18 of scales and d; Q8_0 32 of quants, 2 of d; Q5_0 16 of nibbles, 4 of
    fifth bits, 2 of d), one after the other, each in groups of 8 weight rows (the last may hold fewer) as
    :func:`_q6k_planes` and :func:`_block32_planes` lay them out. 64-byte aligned."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out, nb = raw.shape[0], raw.shape[1] // fmt.block_bytes
    packed = torch.empty((out, nb * fmt.block_bytes), dtype=torch.uint8)  # c10's allocator: 64-byte aligned
    flat = packed.view(-1).numpy()
    for first, count, rows in row_groups(out):
        part = raw[first:first + count]
        planes = (_q6k_planes(part, rows) if fmt.ggml_type == "Q6_K"
                  else _block32_planes(fmt.ggml_type, part.reshape(count, nb, fmt.block_bytes), rows))
        for span, plane in zip(_plane_spans(fmt, out, nb, first, count), planes):
            flat[span] = plane.reshape(-1)
    return packed


def file_rows(fmt: BlockFormat, packed: torch.Tensor) -> np.ndarray:
    """The inverse of :func:`regroup`: the GGUF rows ``[out, nb * block_bytes]``."""
    out, nb = packed.shape[0], packed.shape[1] // fmt.block_bytes
    flat = packed.contiguous().view(-1).numpy()
    blocks = np.empty((out, nb, fmt.block_bytes), np.uint8)
    for first, count, rows in row_groups(out):
        planes = [flat[span].reshape(count // rows, nb, -1) for span in _plane_spans(fmt, out, nb, first, count)]
        blocks[first:first + count] = (_q6k_blocks(planes, rows) if fmt.ggml_type == "Q6_K"
                                       else _block32_blocks(fmt.ggml_type, planes, rows))
    return blocks.reshape(out, nb * fmt.block_bytes)


# -------------------------------------------------------------------------------------------- the modules
class GGUFBlockLinear(GGUFOpLinear):
    """``y = x W^T + b`` with ``W`` in GGUF rows of a :class:`BlockFormat` (Q6_K, Q8_0, Q5_0) on its row-invariant
    kernel: ``x [m, in]`` fp32 -> ``[m, out]`` fp32.

    Args:
        fmt: the format.
        packed: ``[out, in / block * block_bytes]`` uint8, the file's rows or :func:`quantize_blocks`' output
            (regrouped here for the kernel: :func:`regroup`).
        bias: ``[out]`` or None.

    Raises:
        KernelError: the kernel is not available here (a :class:`draftwise.backends.kernels.q4k.Q4KError`), or
            ``packed`` is not a uint8 matrix of whole blocks.
    """

    def __init__(self, fmt: BlockFormat, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] % fmt.block_bytes:
            raise KernelError(f"{fmt.ggml_type} weights are [out, nb * {fmt.block_bytes}] uint8, got "
                              f"{tuple(packed.shape)} {packed.dtype}")
        super().__init__(packed.shape[0], packed.shape[1] // fmt.block_bytes * fmt.block_weights, bias)
        load_q4k_ops()
        self.format = fmt
        self.kernel_name = fmt.kernel_name
        packed = regroup(fmt, packed.contiguous().numpy())
        self._bind(packed, getattr(torch.ops.draftwise_q4k, fmt.op).default)

    def gguf_rows(self) -> torch.Tensor:
        """The weight as the file's rows ``[out, in / block * block_bytes]`` uint8 (a copy)."""
        return torch.from_numpy(file_rows(self.format, self.packed))

    @classmethod
    def from_float(cls, fmt: BlockFormat, weight: torch.Tensor, bias: torch.Tensor | None = None) -> GGUFBlockLinear:
        """Quantize ``weight [out, in]`` to ``fmt`` (:func:`quantize_blocks`)."""
        return cls(fmt, quantize_blocks(weight, fmt), bias)



class SegmentedLinear(_KernelLinear):
    """A linear layer whose output features come in consecutive segments of different formats (a fused q/k/v
    projection with q and k in Q4_K and v in Q6_K): ``x [m, in]`` -> the segments' outputs side by side
    ``[m, sum out]``. Row-invariant when every segment is: each output element is computed by one segment's
    kernel alone. The segments are not registered as submodules (``model.modules()`` lists this layer once,
    with the segments' bytes in :attr:`weight_bytes`).

    Args:
        layers: the segments' modules in output order, all with the same ``in_features``.

    Raises:
        KernelError: no segments, or different input widths.
    """

    def __init__(self, layers: Sequence[_KernelLinear]) -> None:
        if not layers or len({layer.in_features for layer in layers}) != 1:
            raise KernelError("segments need one input width and at least one layer")
        super().__init__(sum(layer.out_features for layer in layers), layers[0].in_features, None)
        # a plain tuple, not submodules: the model's layer walks (shapes, weight bytes) see this one layer
        self.segments = tuple(layers)
        self.kernel_name = "+".join(layer.kernel_name for layer in layers)

    @property
    def weight_bytes(self) -> int:
        return sum(layer.weight_bytes for layer in self.segments)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(rows) for layer in self.segments], dim=-1)  # [m, out]


def gguf_linear(ggml_type: str, raw: np.ndarray, bias: torch.Tensor | None = None) -> _KernelLinear:
    """The kernel layer for GGUF rows ``raw [out, row bytes]`` uint8 of type ``ggml_type`` (``"Q4_K"`` repacked
    for :class:`Q4KLinear`; Q6_K, Q8_0, Q5_0 regrouped by :class:`GGUFBlockLinear`).

    Raises:
        KernelError: a type without a kernel, or the kernel not available here.
    """
    if ggml_type == "Q4_K":
        return Q4KLinear(pack_gguf_q4k(raw), bias)
    return GGUFBlockLinear(block_format(ggml_type), torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8)), bias)
