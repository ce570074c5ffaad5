"""Per-request speculative decoding statistics.

Terms (as in vLLM's spec-decode metrics):
- *draft tokens*: tokens a proposer offered for verification;
- *accepted tokens*: draft tokens the target agreed with and that were committed to the output;
- *bonus / correction token*: the one token the target adds after each verification;
- acceptance rate ``alpha = accepted / drafted``;
- mean accepted length ``tau = committed tokens / verification passes`` (bonus token included), which
  equals ``1 + accepted / drafts`` when no stop truncates a step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["SpeculativeStats"]


@dataclass
class SpeculativeStats:
    """Counters and timings of one request. Times are in seconds; counts in tokens unless named otherwise."""

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens whose KV state came from the prefix cache (not prefilled)
    num_generated_tokens: int = 0
    num_drafts: int = 0  # verification passes that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_passes: int = 0  # decode-phase target forward passes (prefill excluded)
    num_step_tokens: int = 0  # tokens committed by decode-phase passes (bonus included)
    num_tree_nodes: int = 0  # draft-tree nodes verified (tree methods; a chain counts 0)
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    k_history: list[int] = field(default_factory=list)  # K used at each decode step
    step_end_s: list[float] = field(default_factory=list)  # seconds since request start at each step's end
    step_tokens: list[int] = field(default_factory=list)  # tokens committed by each decode step
    prefill_time_s: float = 0.0
    target_time_s: float = 0.0  # decode-phase target forward time
    draft_time_s: float = 0.0  # proposer time
    total_time_s: float = 0.0
    finish_reason: str = ""
    warnings: list[str] = field(default_factory=list)

    def record_step(self, num_drafted: int, num_accepted: int, num_committed: int) -> None:
        """Count one verification pass: ``num_drafted`` offered, ``num_accepted`` of them committed,
        ``num_committed`` tokens added to the output by this pass (accepted + bonus, after stop truncation)."""
        self.num_target_passes += 1
        self.num_step_tokens += num_committed
        self.k_history.append(num_drafted)
        self.step_tokens.append(num_committed)
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self._grow(num_drafted)
        for position in range(num_drafted):
            self.drafted_per_position[position] += 1
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def _grow(self, length: int) -> None:
        while len(self.drafted_per_position) < length:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)

    @property
    def acceptance_rate(self) -> float:
        """alpha = accepted / drafted (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau = committed tokens per decode-phase target pass, bonus token included."""
        return self.num_step_tokens / self.num_target_passes if self.num_target_passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of drafts whose token at each position was accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time, prefill included."""
        return self.num_generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second of decode time (prefill excluded)."""
        decode = self.total_time_s - self.prefill_time_s
        return self.num_generated_tokens / decode if decode > 0 else 0.0

    @property
    def overhead_time_s(self) -> float:
        """Wall time spent outside prefill, target and proposer calls (the engine's own work)."""
        return max(0.0, self.total_time_s - self.prefill_time_s - self.target_time_s - self.draft_time_s)

    def to_dict(self) -> dict:
        """A JSON-ready dict: the raw counters plus the derived rates."""
        data = asdict(self)
        data.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            overhead_time_s=self.overhead_time_s,
        )
        return data
