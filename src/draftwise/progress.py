"""Progress of long library work (dequantizing, building, self-tests, calibration) as log records.

Library code calls :func:`report`: one INFO record on the ``draftwise.progress`` logger, carrying a
:class:`ProgressEvent` as its ``progress`` attribute. Nothing shows unless logging is configured to show INFO
records (Python shows WARNING and above by default), so library users are not spammed; the CLI attaches a
:class:`ProgressLines` handler (:func:`progress_lines`) that prints lines such as::

    [target qwen2.5-coder-1.5b] building the lean decoder 3/28 layers, ETA 1m20s
    [target qwen2.5-coder-1.5b] kernel self-test (int8) 2/5 kernels
    [target qwen2.5-coder-1.5b] calibrating verify cost k=1..9 2/6 rounds, ETA 12s

to stderr. A stage is reported at its start (``done=0``) and after each unit of work; the handler estimates
the time left from the rate since the stage started. No module state besides the logger.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

__all__ = ["LOGGER_NAME", "ProgressEvent", "report", "ProgressLines", "progress_lines", "format_duration"]

#: The logger progress records go to.
LOGGER_NAME = "draftwise.progress"
#: Seconds between two printed lines of the same stage (its first and last line always print).
PRINT_INTERVAL_S = 2.0

logger = logging.getLogger(LOGGER_NAME)


@dataclass(frozen=True)
class ProgressEvent:
    """One progress step.

    Attributes:
        stage: what is happening (``"dequantizing GGUF"``, ``"kernel self-test (int8)"``).
        model: the model concerned (a spec or backend name), or None (then: the last one reported).
        done, total: units finished and in all (None: a stage without counts).
        unit: what is counted (``"layers"``, ``"kernels"``, ``"rounds"``).
        estimate: whether the units take about the same time, so that an ETA means something.
    """

    stage: str
    model: str | None = None
    done: int | None = None
    total: int | None = None
    unit: str = ""
    estimate: bool = True

    @property
    def counts(self) -> str:
        """``"3/28 layers"``, or ``""`` for a stage without counts."""
        if self.done is None or self.total is None:
            return ""
        return f"{self.done}/{self.total}" + (f" {self.unit}" if self.unit else "")

    def text(self) -> str:
        """The record's plain message: ``"[model] stage 3/28 layers"``."""
        parts = [f"[{self.model}]" if self.model else "", self.stage, self.counts]
        return " ".join(p for p in parts if p)


def report(stage: str, *, model: str | None = None, done: int | None = None, total: int | None = None,
           unit: str = "", estimate: bool = True) -> None:
    """Log a :class:`ProgressEvent` (INFO, logger :data:`LOGGER_NAME`)."""
    if logger.isEnabledFor(logging.INFO):
        event = ProgressEvent(stage, model, done, total, unit, estimate)
        logger.info("%s", event.text(), extra={"progress": event})


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"1m20s"``, ``"2h05m"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLines(logging.Handler):
    """Prints progress records as lines: ``[role model] stage done/total unit, ETA 1m20s``.

    Args:
        roles: model spec -> role (``{"qwen2.5-coder-1.5b": "target"}``, ``"target/draft"`` for a model that is
            both); a model name that is a spec or starts with one (``spec+int8+lean``) is shown as ``role name``
            with the spec's name. A path shows its file name.
        stream: where to write (default: ``sys.stderr`` at the time of each line).
        interval_s: least seconds between two lines of the same stage; its first and last always print.
        clock: monotonic seconds (tests).
    """

    def __init__(self, roles: Mapping[str, str] | None = None, *, stream: TextIO | None = None,
                 interval_s: float = PRINT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(logging.INFO)
        self._roles = {spec: role for spec, role in (roles or {}).items() if spec}
        self._stream = stream
        self._interval = interval_s
        self._clock = clock
        self._label: str | None = None
        self._started: dict[tuple[str | None, str], tuple[float, int]] = {}
        self._printed: dict[tuple[str | None, str], float] = {}

    def label(self, model: str) -> str:
        """How ``model`` is shown: its role and name (see the class docstring)."""
        matches = [spec for spec in self._roles if model == spec or model.startswith((spec + "+", spec + "["))]
        if not matches:
            return _short(model)
        spec = max(matches, key=len)
        return f"{self._roles[spec]} {_short(spec)}"

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "progress", None)
        if not isinstance(event, ProgressEvent):
            return
        try:
            line = self.render(event)
            if line is not None:
                stream = self._stream or sys.stderr
                stream.write(line + "\n")
                stream.flush()
        except Exception:  # a progress line must never break the work it reports on
            self.handleError(record)

    def render(self, event: ProgressEvent) -> str | None:
        """The line for ``event``, or None when it is throttled (see ``interval_s``)."""
        if event.model:
            self._label = self.label(event.model)
        key = (self._label, event.stage)
        now = self._clock()
        first = key not in self._started or event.done in (None, 0)
        if first:
            self._started[key] = (now, event.done or 0)
        last = event.done is not None and event.total is not None and event.done >= event.total
        if not (first or last) and now - self._printed.get(key, -float("inf")) < self._interval:
            return None
        self._printed[key] = now
        text = " ".join(p for p in (f"[{self._label}]" if self._label else "", event.stage, event.counts) if p)
        if last:
            return text + f", took {format_duration(now - self._started[key][0])}"
        eta = self._eta(key, event, now)
        return text + (f", ETA {format_duration(eta)}" if eta is not None else "")

    def _eta(self, key, event: ProgressEvent, now: float) -> float | None:
        """Seconds left at the rate since the stage started (None: no counts, nothing done yet, or finished)."""
        if not event.estimate or event.done is None or not event.total or event.done >= event.total:
            return None
        started, done_then = self._started[key]
        finished = event.done - done_then
        if finished <= 0 or now <= started:
            return None
        return (now - started) / finished * (event.total - event.done)


def _short(name: str) -> str:
    """A model's display name: the last part of a path or hub id, else the name."""
    return Path(name).name if "/" in name else name


@contextlib.contextmanager
def progress_lines(roles: Mapping[str, str] | None = None, **options) -> Iterator[ProgressLines]:
    """Show progress records as lines while inside: attaches a :class:`ProgressLines` (``options`` go to it) to
    the progress logger, at INFO and not propagated (so ``-v`` logging does not print them twice), and puts
    the logger back as it was on exit."""
    handler = ProgressLines(roles, **options)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
