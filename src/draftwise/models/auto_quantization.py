"""``--quantization auto`` on the CPU: the exact mode whose linear layers the kernel self-test measured fastest
for the rows each target pass verifies.

Candidates (where the lean runtime runs the model on the CPU with fbgemm's int8 kernels, see
:func:`draftwise.models.loading.resolve_quantization`): ``int8`` always, and ``q4k`` only for a ``.gguf`` file
whose blocks the C++ kernels can run here (a float checkpoint stays on int8: q4k would re-quantize it to 4
bits, which is lossier). Every mode is row-invariant, so the choice changes speed, never whether speculation
keeps the output.

The timings are those of the kernel self-test (:func:`draftwise.backends.lean.linear.select_lean_kernel`, the
call the lean runtime makes when it builds its layers, so the two share one cached result per machine): the
summed linear-layer seconds of one forward pass over m = 1, 2, 4, 8, 16 rows on synthetic weights of the
model's shapes. q4k is timed as Q4_K on every layer, while a Q4_K_M file keeps some tensors in Q6_K or Q8_0
(slower per weight), so its figure is somewhat optimistic for such files.

Which mode wins depends on the rows per pass: plain decoding makes one-row passes, a speculative target
verifies K + 1 rows (:func:`target_rows_per_pass`). Measured figures: ``docs/benchmarks/gguf_vs_llama_cpp.md``.
"""

from __future__ import annotations

import bisect
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from draftwise.config import SpeculativeConfig

__all__ = ["AutoQuantization", "ModeTiming", "busy_load", "choose_quantization", "interpolate_seconds",
           "measure_mode", "q4k_obstacle", "target_rows_per_pass"]

logger = logging.getLogger(__name__)

#: The mode ``auto`` falls back to when no candidate could be measured (the rule before measuring).
FALLBACK_MODE = "int8"


@dataclass(frozen=True)
class ModeTiming:
    """One candidate mode's measurement: the linear layers' seconds of one forward pass by row count
    (``{m: seconds}``), or why it could not be measured (``failure``; then ``seconds`` is empty)."""

    mode: str
    seconds: Mapping[int, float] = field(default_factory=dict)
    failure: str | None = None
    busy_load: float | None = None  # the load average its self-test started at, when busy (:func:`busy_load`)


@dataclass(frozen=True)
class AutoQuantization:
    """What ``auto`` chose and why.

    Attributes:
        mode: the chosen quantization mode.
        rows: rows per pass the choice was made for.
        pass_seconds: each measured candidate's linear-layer seconds of one ``rows``-row pass, fastest first.
        dropped: candidates left out, with the reason (not available here, the measurement failed).
        busy_loads: the load average at which a measured candidate's self-test started, for those measured on
            a busy machine (:attr:`ModeTiming.busy_load`), by mode.
    """

    mode: str
    rows: int
    pass_seconds: Mapping[str, float]
    dropped: Mapping[str, str] = field(default_factory=dict)
    busy_loads: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """The reason part of the log line, e.g. ``measured for 1-row passes: q4k 31.2 ms, int8 48.9 ms of
        linear layers; --quantization to force``."""
        parts = []
        if self.pass_seconds:
            timed = ", ".join(f"{mode} {seconds * 1e3:.1f} ms" for mode, seconds in self.pass_seconds.items())
            parts.append(f"measured for {self.rows}-row passes: {timed} of linear layers")
        else:
            parts.append(f"nothing measured; {self.mode} as without measuring")
        if self.busy_loads:
            from draftwise.backends.kernels.selftest import kernel_cache_dir

            loads = ", ".join(f"{mode} {load:.2f}" for mode, load in self.busy_loads.items())
            parts.append(f"self-test started at load {loads} on {os.cpu_count()} CPUs, so those timings may be "
                         f"inflated: delete their entries under {kernel_cache_dir()} to measure again")
        parts.extend(f"{mode} left out: {why}" for mode, why in self.dropped.items())
        parts.append("--quantization to force")
        return "; ".join(parts)


def interpolate_seconds(seconds: Mapping[int, float], rows: int) -> float:
    """Seconds of a ``rows``-row pass from timings at some row counts (``{m: seconds}``): the timing itself at a
    measured m, linear between the two measured counts around ``rows``, and beyond the largest measured count
    the line through the two largest (a pass grows about linearly with its rows once the weights are read).

    Raises:
        ValueError: ``rows`` < 1, or no timings.
    """
    if rows < 1:
        raise ValueError(f"rows per pass must be >= 1, got {rows}")
    if not seconds:
        raise ValueError("no timings to interpolate")
    counts = sorted(seconds)
    if rows in seconds or len(counts) == 1:
        return seconds.get(rows, seconds[counts[0]])
    if rows < counts[0]:
        low, high = counts[0], counts[1]
    elif rows > counts[-1]:
        low, high = counts[-2], counts[-1]
    else:
        at = bisect.bisect_left(counts, rows)
        low, high = counts[at - 1], counts[at]
    slope = (seconds[high] - seconds[low]) / (high - low)
    return max(0.0, seconds[low] + slope * (rows - low))


def choose_quantization(timings: Sequence[ModeTiming], rows: int, *, fallback: str = FALLBACK_MODE,
                        dropped: Mapping[str, str] | None = None) -> AutoQuantization:
    """The candidate with the fewest linear-layer seconds for a ``rows``-row pass (a pure function of the
    measurements). A candidate whose measurement failed is left out with its reason; when none was measured,
    ``fallback``. Ties go to the earlier candidate in ``timings``.

    Args:
        timings: the candidates' measurements, in order of preference.
        rows: rows per target pass (1: plain decoding; K + 1: a speculative verify pass).
        fallback: the mode when no candidate has timings.
        dropped: candidates already left out before measuring, with the reason (kept in the result).

    Raises:
        ValueError: ``rows`` < 1.
    """
    if rows < 1:
        raise ValueError(f"rows per pass must be >= 1, got {rows}")
    left_out = dict(dropped or {})
    costs: dict[str, float] = {}
    busy: dict[str, float] = {}
    for timing in timings:
        if timing.failure is not None or not timing.seconds:
            left_out[timing.mode] = timing.failure or "no timings"
            continue
        costs[timing.mode] = interpolate_seconds(timing.seconds, rows)
        if timing.busy_load is not None:
            busy[timing.mode] = timing.busy_load
    ranked = dict(sorted(costs.items(), key=lambda item: item[1]))  # stable: ties keep the given order
    mode = next(iter(ranked), fallback)
    return AutoQuantization(mode=mode, rows=rows, pass_seconds=ranked, dropped=left_out, busy_loads=busy)


def busy_load(load_average: Sequence[float] | None, cpus: int | None) -> float | None:
    """The 1-minute load average a self-test started at when it was at least the CPU count (other work then
    shared the cores, and a multi-threaded kernel's time can grow many times over: cached timings measured so
    may be inflated), else None.

    Args:
        load_average: the 1/5/15-minute load averages recorded with the self-test (None: unknown).
        cpus: the machine's CPU count (None: unknown).
    """
    if not load_average or not cpus or load_average[0] < cpus:
        return None
    return float(load_average[0])


def q4k_obstacle(source: str | None, lean_config) -> str | None:
    """Why ``q4k`` is no ``auto`` candidate, or None when it is one: ``source`` (the model's path) is not a
    ``.gguf`` file (q4k would re-quantize float weights to 4 bits), there is no config to take the shapes from
    (``lean_config`` None), a layer's input width is not a multiple of Q4_K's 256-weight super-block (the
    self-test times Q4_K on every shape; Qwen2.5-Coder-0.5B's 896), or the C++ kernels do not build here
    (:func:`draftwise.backends.kernels.q4k.q4k_available`; compiled once per machine, as the lean runtime's
    native operations are anyway). Never raises."""
    if source is None or not str(source).endswith(".gguf"):
        return "not a .gguf file (q4k would re-quantize float weights to 4 bits)"
    if lean_config is None:
        return "no model config to take the layer shapes from"
    try:
        from draftwise.backends.kernels.q4k import SUPER_BLOCK, q4k_available
        from draftwise.backends.lean.linear import lean_linear_shapes

        odd = sorted({s.in_features for s in lean_linear_shapes(lean_config) if s.in_features % SUPER_BLOCK})
        if odd:
            return f"input widths {', '.join(map(str, odd))} are not multiples of Q4_K's {SUPER_BLOCK}"
        missing = q4k_available()
    except Exception as exc:  # noqa: BLE001 - auto must never fail a load; q4k is then no candidate
        missing = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None if missing is None else f"its kernels are not available here ({missing})"


def measure_mode(mode: str, lean_config) -> ModeTiming:
    """The kernel self-test's linear-layer seconds of one forward pass at m = 1, 2, 4, 8, 16 rows for ``mode``
    on the shapes of a lean model (``lean_config``, a :class:`draftwise.backends.lean.model.LeanConfig`),
    through :func:`draftwise.backends.lean.linear.select_lean_kernel` (cached per machine; the first call runs
    the self-test: seconds to a minute). Never raises: a failure (no usable kernel, shapes the kernels cannot
    serve, an extension that does not build) is returned as ``failure``; timings from a self-test that started on
    a busy machine carry its load (:func:`busy_load`)."""
    from draftwise.backends.kernels.settings import TIMED_ROWS
    from draftwise.backends.lean.linear import select_lean_kernel

    try:
        choice = select_lean_kernel(mode, lean_config)
        trial = choice.trial
        seconds = {m: t for m in TIMED_ROWS if (t := trial.total_seconds(m, choice.shapes)) is not None}
    except Exception as exc:  # noqa: BLE001 - auto must never fail a load; the candidate is dropped instead
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        return ModeTiming(mode, failure=f"self-test failed ({type(exc).__name__}: {first_line})")
    if not seconds:
        return ModeTiming(mode, failure=f"self-test of {trial.name} has no timings")
    return ModeTiming(mode, seconds=seconds, busy_load=busy_load(choice.load_average, os.cpu_count()))


def target_rows_per_pass(config: SpeculativeConfig | None) -> int:
    """Rows a target pass verifies with ``config`` (None: plain decoding, 1 row): 1 + the most draft tokens
    one step proposes. A chain proposes up to K = ``num_speculative_tokens`` (with ``k_policy="auto"`` K is the
    maximum the controller may pick; confident-chain stopping only shortens chains), a draft tree up to
    ``tree_budget`` nodes (default K x ``tree_width``), an explicit Medusa tree its nodes, and a suffix tree
    (``suffix_decoding_tree_width`` w > 1) up to w x K. The largest pass is the one ``auto`` sizes the
    quantization for: adaptive K drafts fewer tokens where acceptance is low, where speculation matters less."""
    if config is None:
        return 1
    k = config.num_speculative_tokens
    if config.tree is not None:
        nodes = len(config.tree)
    elif config.tree_width > 1:
        nodes = config.tree_budget if config.tree_budget is not None else k * config.tree_width
    else:
        nodes = k
    if config.suffix_decoding_tree_width > 1:
        nodes = max(nodes, k * config.suffix_decoding_tree_width)
    return 1 + nodes
