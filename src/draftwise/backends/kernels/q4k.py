"""The ``q4k`` mode: 4-bit weights in GGUF's Q4_K super-blocks on a row-invariant C++ kernel.

Format (ggml's k-quants, as GGUF stores them): an ``[out, in]`` weight is cut along ``in`` into super-blocks of
256 weights, each 8 sub-blocks of 32 with a 6-bit scale ``sc`` and a 6-bit min ``m``, and a super-block's
float scales ``d`` and ``dmin``; a weight is ``d * sc * q - dmin * m`` with ``q`` in 0..15 (4.5 bits per
weight in GGUF, 4.75 in the repacked form here, where the 6-bit scales are stored decoded as bytes and ``d``,
``dmin`` as fp32: 152 bytes per 256 weights, with 8 weight rows interleaved so that the kernel keeps each row's
sums in a vector lane of its own; see :func:`_pack`).

Arithmetic (``draftwise_q4k::linear``, ``q4k.cpp``): each activation row is quantized on its own to int8 per
256 (scale ``amax / 127``), super-block dot products are exact integer sums, and the fp32 accumulation runs
in one fixed order per output element. So a row's output does not depend on the other rows of the call:
row-invariant by construction (the self-test checks it anyway).

Where the blocks come from (:class:`draftwise.backends.kernels.gguf_source.GGUFSource`): a weight row that
equals, bit for bit, the dequantization of a row of a Q4_K tensor of the model's GGUF file keeps that row's
blocks as they are (the same weights llama.cpp runs); a weight of a float checkpoint is quantized here
(:func:`quantize_q4k`, min-max per sub-block).

The extension (``q4k.cpp``) also holds the kernels of GGUF's Q6_K, Q8_0 and Q5_0 blocks
(:mod:`draftwise.backends.kernels.gguf_blocks`). It is compiled once per machine at first use
(``torch.utils.cpp_extension``, with ``-march=native``: AVX2 intrinsics where the CPU has them, a portable path
elsewhere; about a minute) into ``$DRAFTWISE_HOME/extensions/``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from draftwise.backends.kernels.layers import KernelError, _PackedLinear
from draftwise.files import draftwise_home

__all__ = ["SUPER_BLOCK", "PACKED_BLOCK_BYTES", "Q4KError", "q4k_available", "load_q4k_ops", "q4k_linear",
           "quantize_q4k", "dequantize_q4k", "pack_gguf_q4k", "GGUFOpLinear", "Q4KLinear"]

logger = logging.getLogger(__name__)

#: Weights per super-block (``in_features`` must be a multiple of it).
SUPER_BLOCK = 256
#: Bytes of one repacked super-block: fp32 d and dmin, 8 scale bytes, 8 min bytes, 128 bytes of nibbles.
PACKED_BLOCK_BYTES = 152
#: Bytes of one GGUF Q4_K super-block: fp16 d and dmin, 12 bytes of packed 6-bit scales and mins, 128 of nibbles.
GGUF_BLOCK_BYTES = 144
#: the extension's sources: the GGUF block kernels, and the lean runtime's attention and per-row operations
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("q4k.cpp", "attention.cpp", "lean_ops.cpp"))
#: headers the sources include (part of the build key, so an edit rebuilds)
_HEADERS = (Path(__file__).with_name("native_math.h"),)
#: -march=native: the build is for this CPU (the cache key holds its model and flags); -ffp-contract=off: no
#: fused multiply-adds but the written ones, so the rounding is the source's.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")


class Q4KError(KernelError):
    """The Q4_K kernel cannot be built or used here (no C++ compiler, an unsupported shape)."""


# --------------------------------------------------------------------------------------------- the extension
def build_key() -> str:
    """A hash of the extension's sources, headers and flags, torch's version and this CPU: its build directory's
    name, and part of the kernel self-test's cache key."""
    from draftwise.machine import cpu_flags, cpu_model_name

    digest = hashlib.sha256()
    parts = (*(path.read_bytes() for path in _SOURCES + _HEADERS), " ".join(_CFLAGS).encode(),
             torch.__version__.encode(), cpu_model_name().encode(), " ".join(sorted(cpu_flags())).encode())
    for part in parts:
        digest.update(part)
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def load_q4k_ops() -> str:
    """Compile (once per machine, cached on disk) and load the extension (the Q4_K, Q6_K, Q8_0 and Q5_0 ops of
    ``torch.ops.draftwise_q4k``, and the lean runtime's ``torch.ops.draftwise_native``); returns the library's
    path.

    Raises:
        Q4KError: the build failed (no compiler, missing ninja) or the library does not load.
    """
    try:
        from torch.utils import cpp_extension
    except ImportError as exc:  # pragma: no cover - part of every torch build
        raise Q4KError(f"torch.utils.cpp_extension unavailable: {exc}") from exc
    key = build_key()
    build_dir = draftwise_home() / "extensions" / f"q4k-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    name = f"draftwise_q4k_{key}"
    library = build_dir / f"{name}.so"
    if not library.exists():
        logger.info("compiling the GGUF kernels for this CPU into %s (once)", build_dir)
    try:
        cpp_extension.load(
            name=name, sources=[str(source) for source in _SOURCES], build_directory=str(build_dir),
            is_python_module=False, extra_cflags=list(_CFLAGS),
            extra_ldflags=[f"-L{torch_lib}", "-lgomp", f"-Wl,-rpath,{torch_lib}"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - a compiler or loader failure of any kind means "not here"
        raise Q4KError(f"building the Q4_K kernel failed ({type(exc).__name__}): {_first_error(str(exc))}") from exc
    return str(library)


def _first_error(message: str) -> str:
    """The compiler's first ``error:`` line of a build log, else the log's last line (at most 300 characters)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors[0] if errors else lines[-1] if lines else "no output")[:300]


def q4k_available() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    try:
        load_q4k_ops()
    except Q4KError as exc:
        return str(exc)
    return None


def q4k_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [m, in]`` fp32 times the packed weight ``[out, in / 256 * 152]`` uint8 -> ``[m, out]`` fp32.

    Raises:
        Q4KError: the kernel is not available; RuntimeError: shapes that do not match.
    """
    load_q4k_ops()
    empty = x.new_empty(0)
    return torch.ops.draftwise_q4k.linear(x, packed, empty if bias is None else bias)


# ------------------------------------------------------------------------------------------ format helpers
def _check_in_features(in_features: int) -> int:
    if in_features % SUPER_BLOCK:
        raise Q4KError(f"Q4_K needs in_features divisible by {SUPER_BLOCK}, got {in_features}")
    return in_features // SUPER_BLOCK


#: weight rows interleaved per group in the packed layout (the kernel's lanes)
GROUP_ROWS = 8


def _pack(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, qs: np.ndarray) -> torch.Tensor:
    """``d, dmin [out, nb]`` fp32, ``sc, mn [out, nb, 8]`` uint8, ``qs [out, nb, 128]`` uint8 (GGUF nibble
    order) -> packed ``[out, nb * 152]`` uint8 in the kernel's layout (``q4k.cpp``): groups of 8 weight rows (the
    last one holds ``out % 8`` rows when that is not 0), each ``nb`` super-blocks of quants ``[4, 4, rows, 8]``,
    scales ``[8, rows]``, mins ``[4, rows, 2]``, ``d [rows]`` and ``dmin [rows]`` fp32; 64-byte aligned."""
    out, nb = d.shape
    packed = torch.empty((out, nb * PACKED_BLOCK_BYTES), dtype=torch.uint8)  # c10's allocator: 64-byte aligned
    flat = packed.view(-1).numpy()
    parts = (d.astype("<f4"), dmin.astype("<f4"), sc, mn, np.ascontiguousarray(qs, dtype=np.uint8))
    for first, count, rows in row_groups(out):
        block = _interleave(*(part[first:first + count] for part in parts), rows)
        flat[first * nb * PACKED_BLOCK_BYTES:(first + count) * nb * PACKED_BLOCK_BYTES] = block.reshape(-1)
    return packed


def row_groups(out: int) -> list[tuple[int, int, int]]:
    """``(first row, rows, rows per group)`` of the packed layout's parts: the full groups of 8 from row 0, then
    the last group of ``out % 8`` rows; a part without rows is left out."""
    full = out // GROUP_ROWS * GROUP_ROWS
    parts = ((0, full, GROUP_ROWS), (full, out - full, out - full))
    return [part for part in parts if part[1]]


def _interleave(d, dmin, sc, mn, qs, rows: int) -> np.ndarray:
    """Weight rows ``[g * rows, nb, ...]`` -> ``[g, nb, 152 * rows]`` bytes, each group's super-block laid out
    as :func:`_pack` says."""
    groups, nb = d.shape[0] // rows, d.shape[1]
    q = qs.reshape(groups, rows, nb, 4, 4, 8).transpose(0, 2, 3, 4, 1, 5).reshape(groups, nb, 128 * rows)
    scales = sc.reshape(groups, rows, nb, 8).transpose(0, 2, 3, 1).reshape(groups, nb, 8 * rows)
    mins = mn.reshape(groups, rows, nb, 4, 2).transpose(0, 2, 3, 1, 4).reshape(groups, nb, 8 * rows)
    floats = [np.ascontiguousarray(v.reshape(groups, rows, nb).transpose(0, 2, 1)).view(np.uint8) for v in (d, dmin)]
    return np.concatenate([q, scales, mins, *floats], axis=2)


def _unpack(packed: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Packed ``[out, nb * 152]`` -> ``d, dmin [out, nb]``, ``sc, mn [out, nb, 8]``, ``qs [out, nb, 128]``."""
    out, nb = packed.shape[0], packed.shape[1] // PACKED_BLOCK_BYTES
    flat = packed.contiguous().view(-1).numpy()
    d, dmin = np.empty((out, nb), np.float32), np.empty((out, nb), np.float32)
    sc, mn = np.empty((out, nb, 8), np.uint8), np.empty((out, nb, 8), np.uint8)
    qs = np.empty((out, nb, 128), np.uint8)
    for first, count, rows in row_groups(out):
        groups = count // rows
        block = flat[first * nb * PACKED_BLOCK_BYTES:(first + count) * nb * PACKED_BLOCK_BYTES]
        block = block.reshape(groups, nb, PACKED_BLOCK_BYTES * rows)
        span = slice(first, first + count)
        qs[span] = block[..., :128 * rows].reshape(groups, nb, 4, 4, rows, 8).transpose(0, 4, 1, 2, 3, 5).reshape(
            count, nb, 128)
        sc[span] = block[..., 128 * rows:136 * rows].reshape(groups, nb, 8, rows).transpose(0, 3, 1, 2).reshape(
            count, nb, 8)
        mn[span] = block[..., 136 * rows:144 * rows].reshape(groups, nb, 4, rows, 2).transpose(0, 3, 1, 2, 4).reshape(
            count, nb, 8)
        for target, at in ((d, 144), (dmin, 148)):
            raw = np.ascontiguousarray(block[..., at * rows:(at + 4) * rows]).view("<f4")  # [groups, nb, rows]
            target[span] = raw.transpose(0, 2, 1).reshape(count, nb)
    return d, dmin, sc, mn, qs


def _nibbles_to_quants(qs: np.ndarray) -> np.ndarray:
    """``qs [..., 128]`` (GGUF order) -> ``[..., 8, 32]`` quants 0..15 per sub-block."""
    lo, hi = qs.reshape(*qs.shape[:-1], 4, 32) & 0x0F, qs.reshape(*qs.shape[:-1], 4, 32) >> 4
    return np.stack([lo, hi], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _quants_to_nibbles(q: np.ndarray) -> np.ndarray:
    """``q [..., 8, 32]`` 0..15 -> ``[..., 128]`` bytes in GGUF order (sub-block 2j low, 2j+1 high)."""
    pairs = q.reshape(*q.shape[:-2], 4, 2, 32).astype(np.uint8)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:-2], 128)


def dequantize_q4k(packed: torch.Tensor) -> torch.Tensor:
    """Packed ``[out, nb * 152]`` -> float32 weight ``[out, nb * 256]`` (``d*sc*q - dmin*m`` in fp32, the
    operation order of gguf's dequantizer, so GGUF-sourced rows come back bit for bit)."""
    d, dmin, sc, mn, qs = _unpack(packed)
    scale = d[..., None] * sc.astype(np.float32)  # [out, nb, 8]
    offset = dmin[..., None] * mn.astype(np.float32)
    q = _nibbles_to_quants(qs).astype(np.float32)
    weight = scale[..., None] * q - offset[..., None]
    return torch.from_numpy(np.ascontiguousarray(weight.reshape(packed.shape[0], -1), dtype=np.float32))


def quantize_q4k(weight: torch.Tensor) -> torch.Tensor:
    """Float ``weight [out, in]`` -> packed Q4_K ``[out, in / 256 * 152]`` uint8: per sub-block of 32 the
    min-max range (min clamped to <= 0) on 16 levels, the 8 sub-block scales and mins on 6 bits against
    the super-block's largest (ggml's Q4_K layout; a plain min-max fit, without ggml's iterative search).

    Raises:
        Q4KError: ``in`` not a multiple of 256.
    """
    out, in_features = weight.shape
    nb = _check_in_features(in_features)
    x = weight.detach().to(torch.float64).cpu().numpy().reshape(out, nb, 8, 32)
    low = np.minimum(x.min(axis=-1), 0.0)
    high = np.maximum(x.max(axis=-1), low)
    step, offset = (high - low) / 15.0, -low  # [out, nb, 8]
    d = (step.max(axis=-1) / 63.0).astype(np.float32)
    dmin = (offset.max(axis=-1) / 63.0).astype(np.float32)
    sc = np.clip(np.rint(np.divide(step, d[..., None], out=np.zeros_like(step), where=d[..., None] > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(offset, dmin[..., None], out=np.zeros_like(offset),
                                   where=dmin[..., None] > 0)), 0, 63)
    scale = d.astype(np.float64)[..., None] * sc
    shift = dmin.astype(np.float64)[..., None] * mn
    q = np.divide(x + shift[..., None], scale[..., None], out=np.zeros_like(x), where=scale[..., None] > 0)
    q = np.clip(np.rint(q), 0, 15)
    return _pack(d, dmin, sc.astype(np.uint8), mn.astype(np.uint8), _quants_to_nibbles(q))


def pack_gguf_q4k(raw: np.ndarray) -> torch.Tensor:
    """GGUF Q4_K rows ``[out, nb * 144]`` uint8 -> packed ``[out, nb * 152]`` (the same weights, scales
    decoded; fp16 ``d``/``dmin`` widen to fp32 exactly)."""
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, GGUF_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view("<f2")[..., 0].astype(np.float32)
    scales = blocks[..., 4:16].astype(np.uint8)
    sc = np.empty(scales.shape[:-1] + (8,), dtype=np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = scales[..., 0:4] & 63
    mn[..., :4] = scales[..., 4:8] & 63
    sc[..., 4:] = (scales[..., 8:12] & 0x0F) | ((scales[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (scales[..., 8:12] >> 4) | ((scales[..., 4:8] >> 6) << 4)
    return _pack(d, dmin, sc, mn, np.ascontiguousarray(blocks[..., 16:]))


# -------------------------------------------------------------------------------------------- the module
class GGUFOpLinear(_PackedLinear):
    """A linear layer on one of the extension's row-invariant ops over GGUF blocks (Q4_K, Q6_K, Q8_0, Q5_0):
    ``packed [out, bytes per row]`` uint8 and an op ``(x [m, in] fp32, packed, bias) -> [m, out] fp32``.
    Subclasses check their format and call :meth:`_bind`."""

    def _bind(self, packed: torch.Tensor, op) -> None:
        """Keep ``packed`` and ``op`` as plain attributes (read on every call, no module lookup)."""
        self.packed = packed.contiguous()
        self._bias = self.bias.data if self.bias is not None else torch.empty(0)
        self._op = op

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + (0 if self.bias is None else 4 * self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._op(rows, self.packed, self._bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]``; ``[m, in]`` fp32 goes straight to the kernel."""
        if x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] == self.in_features:
            return self._op(x, self.packed, self._bias)
        return super().forward(x)


class Q4KLinear(GGUFOpLinear):
    """``y = x W^T + b`` with ``W`` in packed Q4_K blocks on the row-invariant kernel
    (``draftwise_q4k::linear``): ``x [m, in]`` fp32 -> ``[m, out]`` fp32.

    Args:
        packed: ``[out, in / 256 * 152]`` uint8 from :func:`quantize_q4k` or :func:`pack_gguf_q4k` (a GGUF file's
            rows, :class:`draftwise.backends.kernels.gguf_source.GGUFSource`).
        bias: ``[out]`` or None.

    Raises:
        Q4KError: the kernel is not available here, or ``packed`` has another width.
    """

    kernel_name = "q4k-cpp"

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] % PACKED_BLOCK_BYTES:
            raise Q4KError(f"packed Q4_K weights are [out, nb * {PACKED_BLOCK_BYTES}] uint8, got "
                           f"{tuple(packed.shape)} {packed.dtype}")
        super().__init__(packed.shape[0], packed.shape[1] // PACKED_BLOCK_BYTES * SUPER_BLOCK, bias)
        load_q4k_ops()
        if packed.data_ptr() % 64:
            packed = packed.clone()  # the kernel's aligned loads need 64-byte alignment (c10 gives 64)
        self._bind(packed, torch.ops.draftwise_q4k.linear.default)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q4KLinear:
        """Quantize ``weight [out, in]`` (``in`` a multiple of 256) with :func:`quantize_q4k`."""
        return cls(quantize_q4k(weight), bias)

