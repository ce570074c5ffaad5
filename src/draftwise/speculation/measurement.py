"""Whether a timing can be trusted: the one place that decides when a benchmark figure is doubtful.

A speed measured while something else ran on the machine is not this machine's speed, and a ratio of two
such speeds can be off by any factor (issue 21: plain decoding ran at a quarter of its speed while another job
ran, and ``bench`` printed a 3.26x speed-up where the truth was 1.16x). So every timed run records, beside its
wall time, the process's CPU time and the machine's load average (:class:`Measurement`, taken by
:func:`measure`), benchmarks repeat their baseline around the other methods (A B ... A,
:func:`with_baseline_repeat`), and the rules below turn those figures into :class:`Doubt` s that the
commands print next to the numbers they concern, store in their JSON and sum up in a closing warning.

The rules (thresholds are the named constants of this module):

- *machine busy* (code ``C``): the process got less than :data:`CPU_SHARE_MIN` of the CPU time its threads could
  have used (``cpu_s / (wall_s * threads)``: torch and llama.cpp run several threads, so CPU time may exceed
  wall time; what matters is the share of the threads the run was allowed), or the 1-minute load average,
  less the run's own threads, exceeded the cores those threads leave free by more than :data:`LOAD_TOLERANCE`;
- *baseline moved* (``B``): the repeated baseline passes differ, ``(max - min) / median`` of their times above
  :data:`BASELINE_SPREAD_MAX`;
- *far from prediction* (``P``): a measured speed-up over its cost-model prediction outside
  :data:`PREDICTION_RATIO_RANGE`;
- *noisy timings* (``N``): repeated timings of one forward pass with ``(max - min) / median`` above
  :data:`REPEAT_SPREAD_MAX` (``draftwise costs``).

No module-level state: the recorder is a value, the rules are functions of the figures.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from draftwise.backends.llama_cpp_backend import default_threads  # the CPUs this process may use

__all__ = ["BASELINE_SPREAD_MAX", "PREDICTION_RATIO_RANGE", "CPU_SHARE_MIN", "LOAD_TOLERANCE", "REPEAT_SPREAD_MAX",
           "REPEAT_SUFFIX", "Doubt", "Measurement", "Recorder", "measure", "combine", "backend_threads", "relative_spread",
           "machine_busy", "baseline_moved", "far_from_prediction", "noisy_timings", "with_baseline_repeat",
           "marker", "legend", "warning_line", "load_average", "describe", "comparison_doubts", "baseline_labels"]

#: Largest relative spread ``(max - min) / median`` of the repeated baseline passes' times before the
#: baseline counts as moved.
BASELINE_SPREAD_MAX = 0.10
#: Measured speed-up / predicted speed-up outside this range: far from the prediction.
PREDICTION_RATIO_RANGE = (0.67, 1.5)
#: Smallest CPU share ``cpu_s / (wall_s * threads)`` of a run that had the machine to itself.
CPU_SHARE_MIN = 0.7
#: Runnable threads of other work (load average less our own threads) tolerated above the free cores.
LOAD_TOLERANCE = 0.5
#: Largest relative spread of the repeated timings of one forward pass (``draftwise costs``).
REPEAT_SPREAD_MAX = 0.25
#: Label suffix of the repeated baseline method (``"plain (repeat)"``).
REPEAT_SUFFIX = " (repeat)"

CODES = {"machine busy": "C", "baseline moved": "B", "far from prediction": "P", "noisy timings": "N"}


@dataclass(frozen=True)
class Doubt:
    """Why a figure is doubtful: a one-letter ``code`` (table marker), the rule's ``reason`` and the figures
    that broke it (``detail``)."""

    code: str
    reason: str
    detail: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Doubt:
        return cls(str(data["code"]), str(data["reason"]), str(data["detail"]))


def _doubt(reason: str, detail: str) -> Doubt:
    return Doubt(CODES[reason], reason, detail)


@dataclass(frozen=True)
class Measurement:
    """Wall and CPU time of a piece of work, and the machine's load around it.

    Attributes:
        wall_s: wall-clock seconds.
        cpu_s: CPU seconds of this process (every thread; finished child processes included).
        threads: threads the work was allowed (torch intra-op threads, llama.cpp threads); a wall-weighted mean
            for a :func:`combine` d measurement; None when the work ran elsewhere (a server), which leaves the
            CPU rules out.
        cpu_count: CPUs this process may run on.
        load_before, load_after: the 1-minute load average (runnable threads, ours included) before and after;
            None where the OS has none. A combined measurement keeps the lowest before and the highest after.
    """

    wall_s: float
    cpu_s: float
    threads: float | None
    cpu_count: int | None
    load_before: float | None
    load_after: float | None

    @property
    def cpu_share(self) -> float | None:
        """``cpu_s / (wall_s * threads)``: 1.0 when every allowed thread ran all the time (None: unknown)."""
        if not self.threads or self.wall_s <= 0:
            return None
        return self.cpu_s / (self.wall_s * self.threads)

    @property
    def load(self) -> float | None:
        """The higher of the two load averages (None: unknown)."""
        loads = [v for v in (self.load_before, self.load_after) if v is not None]
        return max(loads) if loads else None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "cpu_share": self.cpu_share}

    @classmethod
    def from_dict(cls, data: dict) -> Measurement | None:
        """Inverse of :meth:`to_dict`; None for an empty dict (a record written before measurements existed)."""
        if not data:
            return None
        return cls(float(data["wall_s"]), float(data["cpu_s"]), data.get("threads"), data.get("cpu_count"),
                   data.get("load_before"), data.get("load_after"))


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _process_cpu_seconds() -> float:
    """CPU seconds of this process's threads plus its waited-for child processes."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class Recorder:
    """Context manager recording a :class:`Measurement` of the work inside it into ``.result`` (see
    :func:`measure`)."""

    def __init__(self, threads: float | None) -> None:
        self.threads = threads
        self.result: Measurement | None = None
        self._wall = self._cpu = 0.0
        self._load: float | None = None

    def __enter__(self) -> Recorder:
        self._load = load_average()
        self._cpu = _process_cpu_seconds()
        self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._wall
        cpu = _process_cpu_seconds() - self._cpu
        self.result = Measurement(wall, cpu, self.threads, default_threads(), self._load, load_average())


def measure(threads: float | None) -> Recorder:
    """``with measure(threads) as recorder: work()`` leaves the work's :class:`Measurement` in
    ``recorder.result``.

    Args:
        threads: threads the work may use (see :func:`backend_threads`); None when it runs elsewhere.
    """
    return Recorder(threads)


def combine(measurements: Iterable[Measurement | None]) -> Measurement | None:
    """One measurement for several: summed wall and CPU time, the wall-weighted mean of the threads (None when any
    is unknown), the lowest load before and the highest after. None when none is given (None entries skipped)."""
    items = [m for m in measurements if m is not None]
    if not items:
        return None
    wall = sum(m.wall_s for m in items)
    threads = None
    if wall > 0 and all(m.threads for m in items):
        threads = sum(m.threads * m.wall_s for m in items) / wall
    before = [m.load_before for m in items if m.load_before is not None]
    after = [m.load_after for m in items if m.load_after is not None]
    counts = [m.cpu_count for m in items if m.cpu_count]
    return Measurement(wall, sum(m.cpu_s for m in items), threads, max(counts) if counts else None,
                       min(before) if before else None, max(after) if after else None)


def backend_threads(backend) -> int | None:
    """Threads a backend's forward passes may use: llama.cpp's ``n_threads``, else torch's intra-op threads; None
    for a backend on a GPU (its passes leave the CPU idle, so a low CPU share says nothing about other work)."""
    device = getattr(backend, "device", None)
    if device is not None and getattr(device, "type", str(device)) != "cpu":
        return None
    threads = getattr(backend, "n_threads", None)
    if isinstance(threads, int) and threads > 0:
        return threads
    import torch

    return torch.get_num_threads()


def relative_spread(values: Sequence[float]) -> float | None:
    """``(max - min) / median`` of positive values (None for fewer than two, or a median of zero)."""
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle > 0 else None


# ---------------------------------------------------------------------------------------------- the rules
def machine_busy(measurement: Measurement | None, what: str = "") -> Doubt | None:
    """Doubt ``C`` when the work was starved of CPU or the machine was loaded by other work (module docstring);
    ``what`` names the work in the detail (e.g. ``"plain"``). None: no doubt, or nothing to judge."""
    if measurement is None or not measurement.threads:
        return None
    reasons = []
    share, threads = measurement.cpu_share, measurement.threads
    if share is not None and share < CPU_SHARE_MIN:
        reasons.append(f"got {share:.1%} of the CPU time its {threads:.3g} thread(s) could use "
                       f"(< {CPU_SHARE_MIN:.0%})")
    load, cores = measurement.load, measurement.cpu_count
    if load is not None and cores:
        others, free = load - threads, cores - threads
        if others > free + LOAD_TOLERANCE:
            left = f"the {free:.3g} core(s) it left free" if free > 0 else "no free core"
            reasons.append(f"load average {load:.2f} on {cores} cores: about {others:.1f} runnable threads of other "
                           f"work beside its {threads:.3g} thread(s), with {left}")
    if not reasons:
        return None
    return _doubt("machine busy", (f"{what}: " if what else "") + "; ".join(reasons))


def baseline_moved(pass_seconds: Sequence[float], label: str = "baseline") -> Doubt | None:
    """Doubt ``B`` when the repeated baseline passes' times (seconds, one per pass) spread by more than
    :data:`BASELINE_SPREAD_MAX`; None with fewer than two passes or within it."""
    spread = relative_spread(pass_seconds)
    if spread is None or spread <= BASELINE_SPREAD_MAX:
        return None
    times = ", ".join(f"{s:.3g}" for s in pass_seconds)
    return _doubt("baseline moved", f"the {len(pass_seconds)} {label} passes took {times} s: {spread:.1%} apart "
                                    f"(> {BASELINE_SPREAD_MAX:.0%})")


def far_from_prediction(measured: float | None, predicted: float | None) -> Doubt | None:
    """Doubt ``P`` when ``measured / predicted`` (speed-ups) falls outside :data:`PREDICTION_RATIO_RANGE`."""
    if measured is None or not predicted:
        return None
    ratio = measured / predicted
    low, high = PREDICTION_RATIO_RANGE
    if low <= ratio <= high:
        return None
    return _doubt("far from prediction", f"measured {measured:.2f}x, the cost model predicts {predicted:.2f}x "
                                         f"(ratio {ratio:.2f}, outside {low:g}..{high:g})")


def noisy_timings(samples: Sequence[float], what: str) -> Doubt | None:
    """Doubt ``N`` when repeated timings (seconds) of the same work spread by more than :data:`REPEAT_SPREAD_MAX`."""
    spread = relative_spread(samples)
    if spread is None or spread <= REPEAT_SPREAD_MAX:
        return None
    return _doubt("noisy timings", f"{what}: {len(samples)} timings {min(samples) * 1e3:.1f}..{max(samples) * 1e3:.1f} "
                                   f"ms, {spread:.1%} apart (> {REPEAT_SPREAD_MAX:.0%})")


def comparison_doubts(what: str, own: Iterable[Measurement | None],
                      baseline_passes: Sequence[tuple[str, float, Sequence[Measurement | None]]], *,
                      is_baseline: bool, measured_speedup: float | None = None,
                      predicted_speedup: float | None = None) -> list[Doubt]:
    """Every doubt of a benchmark row ``what`` (a method) compared with a repeated baseline.

    Args:
        own: the measurements of the row's runs.
        baseline_passes: ``(label, total seconds, measurements)`` per baseline pass (the baseline, its repeats).
        is_baseline: the row is one of the baseline passes (its speed-up is over itself and its repeats).
        measured_speedup, predicted_speedup: the row's speed-up and the cost model's prediction, if any.

    Returns:
        Baseline moved (the passes' seconds), machine busy during the row's runs or (another method's row) a
        baseline pass, far from prediction; in that order.
    """
    doubts = [baseline_moved([seconds for _, seconds, _ in baseline_passes], baseline_passes[0][0]
                             if baseline_passes else "baseline"),
              machine_busy(combine(own), what)]
    if not is_baseline:
        doubts += [machine_busy(combine(found), label) for label, _, found in baseline_passes]
    doubts.append(far_from_prediction(measured_speedup, predicted_speedup))
    return [d for d in doubts if d is not None]


# ---------------------------------------------------------------------------------------------- ABA order
def baseline_labels(records: Sequence) -> list[str]:
    """The baseline's label (``records[0].method``) and the labels of the records repeating it
    (``repeat_of``), in order of appearance; records: runs or turns with ``method`` and ``repeat_of``."""
    if not records:
        return []
    base = records[0].method
    return [base] + list(dict.fromkeys(r.method for r in records if getattr(r, "repeat_of", None) == base))


Method = TypeVar("Method")


def with_baseline_repeat(methods: Sequence[Method]) -> list[Method]:
    """``methods`` plus a second run of the first (the baseline) at the end, labelled ``<label> (repeat)`` with
    ``repeat_of`` = the baseline's label: the order A B ... A, so that a change of machine speed during the
    benchmark shows as a spread between the two baseline passes. Methods are dataclasses with ``label`` and
    ``repeat_of`` fields (:class:`draftwise.benchmark.MethodSpec`, :class:`draftwise.agent_bench.AgentMethod`).

    Raises:
        ValueError: no methods.
    """
    if not methods:
        raise ValueError("no methods to repeat the baseline of")
    first = methods[0]
    repeat = dataclasses.replace(first, label=first.label + REPEAT_SUFFIX, repeat_of=first.label)
    return [*methods, repeat]


# ---------------------------------------------------------------------------------------------- rendering
def describe(measurement: Measurement) -> str:
    """One line of the measured figures: CPU share of the allowed threads, wall and CPU time, load average."""
    parts = []
    if measurement.cpu_share is not None:
        parts.append(f"the process used {measurement.cpu_share:.0%} of the CPU time its {measurement.threads:.3g} "
                     f"thread(s) could")
    parts.append(f"wall {measurement.wall_s:.1f} s, CPU {measurement.cpu_s:.1f} s")
    if measurement.load is not None:
        cores = f" on {measurement.cpu_count} cores" if measurement.cpu_count else ""
        parts.append(f"load average {_fmt_load(measurement.load_before)} before, {_fmt_load(measurement.load_after)} "
                     f"after{cores}")
    return "measured: " + "; ".join(parts)


def _fmt_load(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def marker(doubts: Iterable[Doubt | dict]) -> str:
    """Table cell for a row: ``""`` when trusted, else ``"!"`` and the sorted codes (``"!BC"``)."""
    codes = sorted({d.code if isinstance(d, Doubt) else d["code"] for d in doubts})
    return "!" + "".join(codes) if codes else ""


def legend(doubts: Iterable[Doubt | dict]) -> str | None:
    """The footnote explaining the codes that occur (None when none does)."""
    reasons = {}
    for d in doubts:
        d = d if isinstance(d, Doubt) else Doubt.from_dict(d)
        reasons.setdefault(d.code, d.reason)
    if not reasons:
        return None
    return "! = doubtful figure: " + ", ".join(f"{code} {reasons[code]}" for code in sorted(reasons))


def warning_line(doubts: Iterable[tuple[str, Doubt | dict]]) -> str | None:
    """The closing warning for ``(what, doubt)`` pairs (what: the row or stage concerned), or None when there
    are none: says that the figures are doubtful, why (the first case of each rule, and how many more), and to
    re-run on an idle machine."""
    pairs = [(what, d if isinstance(d, Doubt) else Doubt.from_dict(d)) for what, d in doubts]
    if not pairs:
        return None
    marked = list(dict.fromkeys(what for what, _ in pairs))
    cases: dict[str, list[str]] = {}
    for what, d in pairs:
        detail = d.detail[len(what) + 2:] if what and d.detail.startswith(f"{what}: ") else d.detail
        cases.setdefault(d.reason, []).append(f"{what}: {detail}")
    why = "; ".join(f"{reason} ({found[0]}" + (f"; {len(found) - 1} more" if len(found) > 1 else "") + ")"
                    for reason, found in cases.items())
    names = ", ".join(marked[:3]) + (f" and {len(marked) - 3} more" if len(marked) > 3 else "")
    return (f"WARNING: {len(marked)} doubtful figure(s) ({names}; marked ! in the tables): {why}. Re-run on an idle "
            "machine (nothing else running) before quoting them.")
