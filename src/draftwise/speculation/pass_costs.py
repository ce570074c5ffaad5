"""What a step of the engine costs: its target pass (a :class:`~draftwise.speculation.cost_model.PassCostCurve`,
timed here at the engine's start and refined by the engine with every pass), a draft model's passes, and the
engine's own seconds per step (:class:`StepClock`).

The load-aware K (:mod:`draftwise.speculation.batch_plan`) and proposers that weigh their drafts against the batch
price a step on these: ``pass_seconds(rows)`` is the target pass over ``rows`` rows plus the engine's own time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.slots import LOGITS_LAST, Piece, SlotBackend, as_slot_backend
from draftwise.speculation.cost_model import PassCostCurve, StepOverhead

__all__ = ["StepClock", "calibrate_pass_costs", "calibrate_step_costs", "calibrated_or_none", "draft_pass_seconds",
           "step_seconds"]

logger = logging.getLogger(__name__)

T = TypeVar("T")  # an engine's step record: a dataclass with ``pass_s``, ``draft_s`` and ``overhead_s``


def calibrate_pass_costs(backend: SlotBackend | LeanLlama, counts: Iterable[int], slots: Sequence[int], *,
                         repeats: int = 1, curve: PassCostCurve | None = None,
                         per_sequence: bool = False) -> PassCostCurve:
    """Time passes over ``n`` rows for each ``n`` in ``counts`` (seconds, the best of ``repeats``) on ``slots``
    (which must be free: their lengths are reset to 0 afterwards).

    Without ``per_sequence``: the rows are spread one chain per slot (a draft model's passes look like this:
    one row per drafting sequence). With it: the rows are one chain in one slot, which times the per-row part,
    and one pass over ``len(slots)`` rows spread over every slot, whose extra time over the same rows in one slot
    gives the curve's ``per_sequence`` seconds (attention runs once per sequence and layer).

    A short start for :class:`~draftwise.speculation.cost_model.PassCostCurve`, which the engine then refines with
    every pass it runs. Returns ``curve`` (a new one by default) with the points added.

    Raises:
        ValueError: no slots, or a count < 1.
    """
    if not slots:
        raise ValueError("calibration needs at least one free slot")
    backend = as_slot_backend(backend)
    curve = curve or PassCostCurve()
    vocab = backend.vocab_size
    backend.forward([Piece(slots[0], 0, [1 % vocab])])  # warm-up (first-use kernel setup)

    def timed(n: int, spread: list[int]) -> float:
        spread = spread[:backend.max_pieces]
        per_slot = [n // len(spread) + (1 if i < n % len(spread) else 0) for i in range(len(spread))]
        pieces = [Piece(slot, 0, [(7 * j + 3) % vocab for j in range(m)], logits=LOGITS_LAST)
                  for slot, m in zip(spread, per_slot) if m > 0]
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            backend.forward(pieces)
            best = min(best, time.perf_counter() - t0)
        return max(best, 1e-9)

    counts = sorted(set(int(c) for c in counts))
    if counts and counts[0] < 1:
        raise ValueError(f"row counts must be >= 1, got {counts[0]}")
    if per_sequence and len(slots) > 1:
        n = len(slots)
        extra = timed(n, list(slots)) - timed(n, [slots[0]])
        curve.per_sequence = max(0.0, extra / (n - 1))
    for n in counts:
        if per_sequence:
            curve.observe(n, timed(n, [slots[0]]), sequences=1)
        else:
            curve.observe(n, timed(n, list(slots)))
    for slot in slots:
        backend.set_length(slot, 0)
    return curve


def calibrate_step_costs(backend: SlotBackend, max_num_seqs: int, max_rows: int, *,
                         curve: PassCostCurve | None = None,
                         draft: tuple[SlotBackend, PassCostCurve] | None = None) -> PassCostCurve:
    """An engine's pass costs: the target's pass seconds for row counts up to ``max_rows`` (powers of two, and
    ``max_num_seqs`` sequences' worth) with its seconds per sequence in a pass, and a draft model's
    (``draft``: its slot backend and the curve it refines) for one row per drafting sequence, on the first
    ``max_num_seqs`` slots of each (which must be free; they are left empty). Returns the target's curve
    (``curve`` with the points added, or a new one)."""
    counts = sorted({1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows} | {max_rows, max_num_seqs})
    counts = [c for c in counts if c <= backend.max_context]  # timed in one slot; a step never holds more
    slots = list(range(max_num_seqs))
    t0 = time.perf_counter()
    curve = calibrate_pass_costs(backend, counts, slots, curve=curve, repeats=2, per_sequence=True)
    if draft is not None:
        draft_counts = sorted({1 << i for i in range(max_num_seqs.bit_length())} | {max_num_seqs})
        calibrate_pass_costs(draft[0], draft_counts, slots, curve=draft[1], repeats=2)
    logger.info("engine: pass costs measured in %.1f s: %s; %.2f ms per sequence in a pass",
                time.perf_counter() - t0,
                ", ".join(f"{n} rows {s * 1e3:.1f} ms" for n, s in sorted(curve.points.items())),
                curve.per_sequence * 1e3)
    return curve


def step_seconds(pass_costs: PassCostCurve, sequences: int, overhead_s: float) -> Callable[[int], float]:
    """``rows -> seconds`` of a step: the target pass over ``rows`` rows of ``sequences`` sequences, and the
    engine's own ``overhead_s`` per step."""
    def seconds(rows: int) -> float:
        return pass_costs.pass_seconds(rows, sequences) + overhead_s

    return seconds


def draft_pass_seconds(draft_curve: PassCostCurve | None) -> Callable[[int], float] | None:
    """``rows -> seconds`` of one pass of a draft model over one row per drafting sequence; None when it has no
    measured costs (or there is no draft model)."""
    if draft_curve is None or not len(draft_curve):
        return None

    def seconds(rows: int) -> float:
        return draft_curve.pass_seconds(rows, rows)

    return seconds


class StepClock:
    """The engine's own seconds per step: a step's wall time less its target pass and drafting.

    Time that is no per-step cost is left out: :meth:`exclude` takes a proposer observing the target's features
    (already its draft time) and a finishing sequence's export to the prefix cache (once per request). When
    sequences ran from the previous step until the next one was called, the gap counts too (the caller's own work
    per step: a server streaming each step's text).

    Attributes:
        busy_since: ``time.perf_counter()`` at the end of the last step that left sequences running (None: idle).
        excluded_s: this step's excluded seconds.
    """

    def __init__(self) -> None:
        self.busy_since: float | None = None
        self.excluded_s = 0.0

    def start_step(self) -> None:
        """A step's shared part begins: nothing excluded yet."""
        self.excluded_s = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` of this step out of the engine's own time."""
        self.excluded_s += seconds

    def own_seconds(self, entered: float | None, start: float, end: float, pass_s: float, draft_s: float) -> float:
        """The engine's own seconds in a step whose shared part ran from ``start`` to ``end`` (its pass took
        ``pass_s``, its drafting ``draft_s``), called at ``entered`` (None: the engine was idle before it)."""
        gap = entered - self.busy_since if entered is not None and self.busy_since is not None else 0.0
        return gap + (end - start) - pass_s - draft_s - self.excluded_s

    def end_step(self, step: T | None, overhead: StepOverhead, entered: float | None, start: float, busy: bool,
                 ) -> T | None:
        """A step ends: fold its own seconds into ``overhead`` and return ``step`` (its ``pass_s`` and ``draft_s``
        timed the shared part begun at ``start``) with ``overhead_s`` set to the new estimate; ``step`` None (a
        failed or retried step) is not measured. ``busy``: sequences still run after it."""
        now = time.perf_counter()
        if step is not None:
            overhead.observe(self.own_seconds(entered, start, now, step.pass_s, step.draft_s))
            step = dataclasses.replace(step, overhead_s=overhead.seconds)
        self.busy_since = now if busy else None
        return step


def calibrated_or_none(calibrate: Callable[[], PassCostCurve], name: str, reset: Callable[[], None],
                       ) -> PassCostCurve | None:
    """``calibrate()`` for a proposer (``name``) that prices its drafts on the engine's measured step, or None
    where the backend cannot be timed that way: pricing is an optimisation, so the failure is logged, ``reset()``
    clears what the attempt left in the cache slots, and the steps go unpriced (the proposer uses its own costs)."""
    try:
        return calibrate()
    except Exception as exc:  # noqa: BLE001 - decoding works without pricing
        logger.warning("engine: could not measure the pass costs for %s's pricing (%s: %s); it uses its own costs",
                       name, type(exc).__name__, exc)
        reset()
        return None
