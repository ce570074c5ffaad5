"""Choosing K, the number of draft tokens per verification pass.

The engine asks a per-request controller for K before every step and reports each verification back.
:class:`FixedK` always speculates the configured maximum; adaptive controllers live beside it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["KController", "FixedK"]


class KController(ABC):
    """Per-request policy for K. One instance serves one request."""

    @abstractmethod
    def choose_k(self) -> int:
        """K for the next step (0 means a plain decoding step)."""

    def observe(self, num_drafted: int, num_accepted: int, draft_time_s: float, target_time_s: float) -> None:
        """Record the outcome of one step (tokens, seconds). Default: ignore."""

    def notes(self) -> list[str]:
        """Human-readable events worth surfacing in the request's statistics (e.g. speculation disabled)."""
        return []


class FixedK(KController):
    """Always propose ``k`` tokens (the engine still clamps K near max_tokens and the context end)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"K must be >= 0, got {k}")
        self.k = k

    def choose_k(self) -> int:
        return self.k
