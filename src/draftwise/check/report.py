"""The result of ``draftwise check`` and its JSON form (``--json``).

JSON schema ``draftwise.check/1`` (sizes in bytes, times in seconds, rates as fractions):

- ``schema``, ``ok`` (false when a static check failed), ``target`` / ``draft``
  (:meth:`~draftwise.check.describe.ModelDescription.to_dict`), ``settings``;
- ``tokenizer``: :class:`~draftwise.check.tokenizer.TokenizerReport` fields;
- ``memory``: :class:`~draftwise.check.memory.MemoryReport` fields, or null when the tokenizer check failed;
- ``costs``, ``probe``: :class:`~draftwise.check.probe.CostMeasurement` /
  :class:`~draftwise.check.probe.ProbeResult`, or null when not measured;
- ``predictions``: ``[{"k", "cost_ratio", "verify_cost", "tokens_per_step", "speedup"}]`` by K;
- ``verdict``: :class:`~draftwise.check.verdict.Verdict` fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from draftwise.check.describe import ModelDescription
from draftwise.check.memory import MemoryReport
from draftwise.check.probe import CostMeasurement, ProbeResult, SpeedupPrediction
from draftwise.check.tokenizer import TokenizerReport
from draftwise.check.verdict import Verdict

__all__ = ["SCHEMA", "CheckReport"]

SCHEMA = "draftwise.check/1"


@dataclass
class CheckReport:
    """Everything ``draftwise check`` found about a target + draft pair (filled stage by stage)."""

    target: ModelDescription
    draft: ModelDescription
    settings: dict
    tokenizer: TokenizerReport
    verdict: Verdict
    memory: MemoryReport | None = None
    costs: CostMeasurement | None = None
    probe: ProbeResult | None = None
    predictions: list[SpeedupPrediction] = field(default_factory=list)
    draft_runtime: str | None = None  # the runtime the draft was measured on, and why (None: not loaded)

    @property
    def ok(self) -> bool:
        """True when the static checks passed: compatible tokenizers and (where a budget is known) a fit."""
        return self.tokenizer.ok and (self.memory is None or self.memory.fits is not False)

    def to_dict(self) -> dict:
        """The JSON document (see the module docstring)."""
        return {
            "schema": SCHEMA,
            "ok": self.ok,
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict(),
            "settings": dict(self.settings),
            "tokenizer": self.tokenizer.to_dict(),
            "memory": self.memory.to_dict() if self.memory else None,
            "costs": self.costs.to_dict() if self.costs else None,
            "probe": self.probe.to_dict() if self.probe else None,
            "predictions": [asdict(p) for p in self.predictions],
            "draft_runtime": self.draft_runtime,
            "verdict": self.verdict.to_dict(),
        }
