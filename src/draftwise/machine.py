"""Facts about this machine that every figure states: CPU model and flags, DRAM read bandwidth."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: CPU flags that decide which kernels are fast (and are printed with every figure).
RELEVANT_CPU_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                      "avx_ne_convert", "amx_tile", "amx_int8", "amx_bf16")
@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
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


def measure_dram_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, *, threads: int | None = None,
                           device: str | torch.device = "cpu") -> float:
    """Streaming read bandwidth of ``device``'s memory, bytes/s: ``torch.sum`` over an fp32 buffer of ``nbytes``
    (much larger than the last-level cache) on that device, the fastest of ``repeats`` passes after one warm-up
    pass (on a GPU each pass is timed up to a synchronize; the GPU's memory, not the host's, is measured).

    The fastest pass, not the median: it is the figure a weight-streaming lower bound per token
    (weight bytes / bandwidth) needs. Uses ``threads`` intra-op threads (default: torch's current setting;
    they matter on the CPU only); logged with the result. About 0.3-1 s for 512 MiB on a CPU.

    Raises:
        ValueError: ``nbytes`` under 1 MiB or ``repeats`` < 1.
    """
    if nbytes < (1 << 20) or repeats < 1:
        raise ValueError(f"need nbytes >= 1 MiB and repeats >= 1, got {nbytes} and {repeats}")
    device = torch.device(device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch_threads(threads) as n_threads:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # written once: pages are mapped
        torch.sum(buffer)
        synchronize()
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.sum(buffer)
            synchronize()
            best = min(best, time.perf_counter() - t0)
        del buffer
    bandwidth = (nbytes // 4 * 4) / best
    logger.info("%s memory read bandwidth %.1f GB/s (%d MiB, %d threads, best of %d)", device.type, bandwidth / 1e9,
                nbytes >> 20, n_threads, repeats)
    return bandwidth
