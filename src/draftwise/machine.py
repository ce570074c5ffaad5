"""Facts about this machine that every figure states: CPU model and flags, DRAM read bandwidth."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import threading
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


def release_openmp_threads() -> bool:
    """Release the calling thread's OpenMP worker threads (``omp_pause_resource_all(omp_pause_soft)`` of the GNU
    OpenMP runtime that PyTorch and llama.cpp share), before another thread takes over the compute.

    libgomp keeps a pool of worker threads per thread that started a parallel region, and once its pools hold
    more threads than there are CPUs it stops spinning between regions: every region then wakes its workers
    through the kernel. A server loads its models on the main thread (one pool) and decodes on an engine thread
    (a second pool), where every parallel region then costs a kernel wake-up (figures in ``docs/server.md``);
    after this call on the main thread the engine thread computes as fast as the main thread did. The main
    thread gets a new pool if it computes again. Nothing happens without libgomp (another OpenMP runtime, or
    none).

    Returns:
        True when a libgomp was found and released the calling thread's pool.
    """
    import ctypes

    path = _loaded_library("libgomp")
    if path is None:
        return False
    try:
        gomp = ctypes.CDLL(path)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError) as exc:
        logger.debug("cannot release OpenMP threads through %s: %s", path, exc)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    released = pause(1) == 0  # omp_pause_soft
    logger.debug("released the OpenMP worker threads of thread %s: %s", threading.current_thread().name, released)
    return released


def _loaded_library(stem: str) -> str | None:
    """The path of the first shared library named ``stem*.so*`` mapped into this process (Linux), else None."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        fields = line.split()  # address, perms, offset, device, inode, path (absent for anonymous mappings)
        if len(fields) >= 6 and Path(fields[5]).name.startswith(stem) and ".so" in Path(fields[5]).name:
            return fields[5]
    return None


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
