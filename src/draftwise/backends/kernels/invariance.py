"""The row-invariance check: a row of an m-row call equals the same row computed alone, bit for bit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from draftwise.backends.kernels.settings import FULL_CHECK_ROWS, INVARIANCE_ROWS

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ checking
@dataclass(frozen=True)
class InvarianceResult:
    """Outcome of :func:`check_row_invariance`: ``invariant`` (None: not checked), the row counts checked and
    a one-line detail (the first differing row, or what was checked)."""

    invariant: bool | None
    checked_rows: tuple[int, ...] = ()
    detail: str = ""


def _sampled_rows(m: int) -> list[int]:
    """Rows of an m-row call compared with their one-row results: all up to :data:`FULL_CHECK_ROWS`, else
    the first two, the middle and the last."""
    return list(range(m)) if m <= FULL_CHECK_ROWS else sorted({0, 1, m // 2, m - 1})


@torch.inference_mode()
def check_row_invariance(module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                         rows: Iterable[int] = INVARIANCE_ROWS) -> InvarianceResult:
    """Check that row i of ``module(x[:m])`` equals ``module(x[i:i+1])[0]`` bit for bit (``torch.equal``),
    for each m in ``rows`` (those above ``x``'s row count are skipped); all rows of calls up to 17 rows,
    a sample of larger ones. Stops at the first difference.

    The one-row results are computed once per row and reused, so the check costs one call per m plus one
    per distinct compared row. m = 1 compares two identical calls: run-to-run determinism.

    Args:
        module: ``[m, in] -> [m, out]``.
        x: ``[M, in]`` float32 test rows.
        rows: row counts m to check.

    Returns:
        An :class:`InvarianceResult`; ``invariant`` False names the first m and row that differ.
    """
    singles: dict[int, torch.Tensor] = {}
    checked = []
    for m in sorted({m for m in rows if 1 <= m <= x.shape[0]}):
        y = module(x[:m])
        if tuple(y.shape[:1]) != (m,):
            return InvarianceResult(False, tuple(checked), f"m={m}: output has shape {tuple(y.shape)}")
        for i in _sampled_rows(m):
            if i not in singles:
                singles[i] = module(x[i:i + 1])[0]
            if not torch.equal(y[i], singles[i]):
                diff = (y[i].double() - singles[i].double()).abs().max().item()
                return InvarianceResult(False, tuple(checked),
                                        f"row {i} of an {m}-row call differs from the row alone (max |diff| {diff:.2g})")
        checked.append(m)
    return InvarianceResult(True, tuple(checked), f"rows equal for m = {_ranges(checked)}")


def _ranges(values: Sequence[int]) -> str:
    """``[1, 2, 3, 5, 32]`` -> ``"1..3, 5, 32"``."""
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(v) if start == v else f"{start}..{v}")
            start = None
    return ", ".join(parts)
