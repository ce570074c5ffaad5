"""Sharing the CPUs with other processes: compute threads that follow the CPUs other processes leave free.

An agent runs its own tools (tests, builds) on the machine that serves it. A compute thread pool sized to every
CPU then loses most of its time at its barriers: each parallel region (an OpenMP region of torch or of the GGUF
kernels, a graph node of llama.cpp, whose barrier spins) waits for the one thread the kernel has preempted for
the other process, a scheduler time slice at a time. A decoder step crosses hundreds of barriers, so a step on two
threads beside one busy process took several times a step on one thread (measurements in
``docs/benchmarks/sharing.md``).

:class:`CpuContention` estimates how many CPUs other processes keep busy, from the system's CPU time
(``/proc/stat``) less this process's own (``/proc/self/stat``), over the last interval. :class:`ThreadGovernor`
turns that into a thread count (the CPUs left free, at least one) and hands it to the setters it was given: the
draft's llama.cpp threads, and torch's intra-op threads when the target's numerics were checked not to depend on
the thread count (a setting that changed the target's logits would change the output). The engine calls
:meth:`ThreadGovernor.update` once per step, so a change takes effect between passes, never inside one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["CpuTimes", "read_cpu_times", "CpuContention", "ThreadGovernor"]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds at one moment.

    Attributes:
        busy_s: seconds all CPUs spent busy since boot (user, nice, system, irq, softirq, and steal: time the
            hypervisor gave to others), summed over CPUs.
        own_s: seconds this process's threads spent on a CPU (user + system).
        wall_s: ``time.monotonic()`` when read.
    """

    busy_s: float
    own_s: float
    wall_s: float


def read_cpu_times(stat: Path = Path("/proc/stat"), own: Path = Path("/proc/self/stat")) -> CpuTimes | None:
    """The system's and this process's CPU seconds now; None where ``/proc`` cannot be read (not Linux)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        own_fields = own.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    own_ticks = int(own_fields[11]) + int(own_fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return CpuTimes((user + nice + system + irq + softirq + steal) / _CLOCK_TICKS, own_ticks / _CLOCK_TICKS,
                    time.monotonic())


class CpuContention:
    """How many CPUs other processes kept busy over the last ``interval_s`` seconds (a float, 0 when idle).

    Args:
        interval_s: the shortest interval between two readings (``/proc`` counts in 10 ms ticks: shorter
            intervals are noisy).
        read: the reading function (tests pass a scripted one).
        clock: the clock of :attr:`CpuTimes.wall_s` (``time.monotonic``), looked at before reading ``/proc``, so
            a call within the interval (the engine calls once per step) reads no file.
    """

    def __init__(self, interval_s: float = 0.5, read: Callable[[], CpuTimes | None] = read_cpu_times,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._read = read
        self._clock = clock
        self._last = read()
        self.busy_elsewhere: float | None = None  # the latest estimate (CPUs), None before the first interval
        self.readings = 0  # estimates made so far

    def sample(self) -> float | None:
        """The estimate, re-read when ``interval_s`` has passed since the last reading; None before the first
        interval ends, or where ``/proc`` cannot be read."""
        if self._last is None or self._clock() - self._last.wall_s < self.interval_s:
            return self.busy_elsewhere
        now = self._read()
        if now is None or now.wall_s - self._last.wall_s < self.interval_s:
            return self.busy_elsewhere
        elapsed = now.wall_s - self._last.wall_s
        others = (now.busy_s - self._last.busy_s) - (now.own_s - self._last.own_s)
        self.busy_elsewhere = max(0.0, others / elapsed)
        self._last = now
        self.readings += 1
        return self.busy_elsewhere


class ThreadGovernor:
    """Keeps the compute threads at the CPUs other processes leave free (see the module docstring).

    The count is ``round(cpus - busy_elsewhere)``, clamped to 1..``cpus``, and it changes only after two readings
    in a row agree on the new count (one burst of another process does not move it).

    Args:
        cpus: the CPUs this process may use (the most threads).
        setters: each called with the new thread count when it changes (e.g. ``torch.set_num_threads``, a
            llama.cpp backend's ``set_threads``), in the thread that runs the passes.
        contention: the measurement (default: :class:`CpuContention` over 0.5 s).
        names: what each setter sets, for the log.

    Raises:
        ValueError: ``cpus`` < 1 or no setter.
    """

    def __init__(self, cpus: int, setters: Sequence[Callable[[int], object]], contention: CpuContention | None = None,
                 names: Sequence[str] = ()) -> None:
        if cpus < 1:
            raise ValueError(f"cpus must be >= 1, got {cpus}")
        if not setters:
            raise ValueError("a thread governor needs at least one setter")
        self.cpus = cpus
        self.setters = tuple(setters)
        self.names = tuple(names)
        self.contention = contention or CpuContention()
        self.threads = cpus
        self.changes = 0
        self._pending: int | None = None
        self._readings = 0
        logger.info("compute threads follow the CPUs other processes leave free, now %d (%s)", cpus,
                    "; ".join(self.names) or "set")

    def update(self) -> int:
        """Read the contention (at most once per interval) and apply a new thread count when two readings in a
        row call for it; returns the thread count in force."""
        busy = self.contention.sample()
        if busy is None or self.contention.readings == self._readings:
            return self.threads
        self._readings = self.contention.readings
        wanted = min(self.cpus, max(1, round(self.cpus - busy)))
        if wanted == self.threads:
            self._pending = None
        elif wanted == self._pending:
            self._apply(wanted, busy)
        else:
            self._pending = wanted
        return self.threads

    def _apply(self, threads: int, busy: float) -> None:
        for setter in self.setters:
            setter(threads)
        logger.info("%.1f of %d CPUs busy with other processes: %d compute thread(s) (%s)", busy, self.cpus, threads,
                    ", ".join(self.names) or "set")
        self.threads = threads
        self.changes += 1
        self._pending = None
