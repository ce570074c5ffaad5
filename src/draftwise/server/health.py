"""Whether the engine serves requests, as ``/health`` reports it to a load balancer (:class:`EngineHealth`)."""

from __future__ import annotations

import threading

__all__ = ["EngineHealth"]


class EngineHealth:
    """Counts engine failures in a row; unhealthy after ``unhealthy_after`` of them with no success in between,
    healthy again at the next success. Thread-safe.

    Every failure after a request was queued counts, whatever the exception's type (a ``ValueError`` raised
    inside a backend is the server's fault too): a client's fault never reaches the engine, since request
    validation refuses it first (:class:`draftwise.server.errors.RequestError`, the one source of 4xx).

    Args:
        unhealthy_after: consecutive engine failures that make it unhealthy (>= 1).

    Raises:
        ValueError: ``unhealthy_after`` < 1.
    """

    def __init__(self, unhealthy_after: int = 3) -> None:
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        self.unhealthy_after = unhealthy_after
        self._lock = threading.Lock()
        self._consecutive = 0
        self._last_error = ""

    def failed(self, error: BaseException) -> None:
        """Count one engine failure (a request or step that failed inside the engine)."""
        with self._lock:
            self._consecutive += 1
            self._last_error = f"{type(error).__name__}: {error}"

    def succeeded(self) -> None:
        """The engine served a request or step: healthy again."""
        with self._lock:
            self._consecutive = 0

    @property
    def consecutive_failures(self) -> int:
        """Engine failures since the last success."""
        with self._lock:
            return self._consecutive

    def unhealthy_reason(self) -> str | None:
        """Why the engine is unhealthy, or None when it is healthy."""
        with self._lock:
            if self._consecutive < self.unhealthy_after:
                return None
            return f"the engine failed {self._consecutive} times in a row; last error: {self._last_error}"
