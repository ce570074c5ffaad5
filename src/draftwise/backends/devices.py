"""Devices and dtypes, checked before anything is loaded.

``--device cuda`` on a machine without CUDA used to end in a traceback once the weights had been read and were
moved to the device. :func:`check_device` and :func:`check_dtype` refuse, up front and in one sentence, a device
this machine lacks (a PyTorch built without CUDA, no GPU, ``cuda:3`` with two GPUs, ``mps`` off Apple
silicon, a name PyTorch does not know) and a dtype the device cannot compute in.
"""

from __future__ import annotations

import logging

import torch

from draftwise.backends.torch_backend import default_device, default_dtype

__all__ = ["DeviceError", "check_device", "check_dtype", "parse_dtype", "DTYPE_NAMES", "DEVICE_TYPES"]

logger = logging.getLogger(__name__)

#: Device types draftwise runs models on.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

#: The dtype names :func:`parse_dtype` takes (plus ``"auto"``: the device's default).
DTYPE_NAMES = tuple(_DTYPES)


class DeviceError(ValueError):
    """A device this machine lacks, or a dtype the device cannot compute in; the message says which."""


def parse_dtype(dtype: str | torch.dtype | None, device: str, *, drafting: bool = False) -> torch.dtype:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or a torch dtype) to a torch dtype; None picks the default
    (:func:`~draftwise.backends.torch_backend.default_dtype`: fp32, bf16 for a draft model on a GPU).

    Raises:
        ValueError: unknown dtype name.
    """
    if dtype is None or dtype == "auto":
        return default_dtype(device, drafting=drafting)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def check_device(device: str | None) -> str:
    """The device to load on: ``device`` when this machine has it, else the default (CUDA when present).

    Raises:
        DeviceError: a name PyTorch does not know, a device type draftwise does not run on (``meta``...), a
            device type this machine lacks, or an index past the number of devices of its type.
    """
    if device is None:
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceError(f"unknown device {device!r} ({exc}); use one of cpu, cuda, cuda:N, mps, xpu") from None
    if parsed.type not in DEVICE_TYPES:
        raise DeviceError(f"device {device!r}: draftwise runs models on {', '.join(DEVICE_TYPES)}, not "
                          f"{parsed.type}")
    if parsed.type == "cpu":
        return device
    count = _device_count(parsed.type)
    if count == 0:
        raise DeviceError(f"device {device!r} is not available on this machine: {_why_missing(parsed.type)}")
    if parsed.index is not None and parsed.index >= count:
        raise DeviceError(f"device {device!r} is not available: this machine has {count} {parsed.type} "
                          f"device{'s' if count > 1 else ''} ({_device_range(parsed.type, count)})")
    return device


def check_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """``dtype`` as a torch dtype (None or ``"auto"``: the device's default) once a small matrix product in
    it has run on ``device`` (the device must exist: see :func:`check_device`).

    Raises:
        ValueError: an unknown dtype name.
        DeviceError: the device cannot compute in that dtype.
    """
    torch_dtype = parse_dtype(dtype, device)
    try:
        _matmul_probe(torch_dtype, device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"dtype {_dtype_name(torch_dtype)} is not supported on {device}: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return torch_dtype


def _matmul_probe(dtype: torch.dtype, device: str) -> None:
    """A 2x2 matrix product in ``dtype`` on ``device`` (what every layer of a model runs)."""
    x = torch.ones(2, 2, dtype=dtype, device=device)
    (x @ x).sum().item()


def _device_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "mps":
        return 1 if torch.backends.mps.is_available() else 0
    xpu = getattr(torch, "xpu", None)
    return xpu.device_count() if xpu is not None and xpu.is_available() else 0


def _why_missing(kind: str) -> str:
    if kind == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"this PyTorch ({torch.__version__}) was built without CUDA; run on cpu instead"
        return "no CUDA GPU was found (check the driver and CUDA_VISIBLE_DEVICES), or run on cpu"
    if kind == "mps":
        if not torch.backends.mps.is_built():
            return f"this PyTorch ({torch.__version__}) was built without MPS (Apple silicon); run on cpu instead"
        return "MPS needs Apple silicon and macOS 12.3 or later; run on cpu instead"
    return f"no Intel GPU (xpu) was found by this PyTorch ({torch.__version__}); run on cpu instead"


def _device_range(kind: str, count: int) -> str:
    return f"{kind}:0" if count == 1 else f"{kind}:0 to {kind}:{count - 1}"


def _dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, value in _DTYPES.items() if value is dtype and len(name) <= 4), str(dtype))
