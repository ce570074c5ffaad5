"""Per-request speculative decoding statistics.

Terms (as in vLLM's spec-decode metrics):
- *draft tokens*: tokens a proposer offered for verification;
- *accepted tokens*: draft tokens the target agreed with and that were committed to the output;
- *bonus / correction token*: the one token the target adds after each verification;
- acceptance rate ``accepted / drafted`` (None when nothing was drafted);
- per-token acceptance ``a``: the probability that a draft token is accepted given the earlier ones were,
  the ``alpha`` of Leviathan et al. 2023's formula (``accepted / drafted`` is not);
- mean accepted length ``tau = 1 + accepted / verification passes`` (1.0 for plain decoding);
- hybrid steps: the ``hybrid`` method's verification passes by the side that drafted them, ``suffix`` or
  ``draft_model``, and ``plain`` for a pass without draft tokens (no suffix match, and the draft model not
  expected to pay); passes the hybrid was not asked to draft for (K = 0) are not counted.

A stop token inside an accepted draft ends the step there: the drafted and accepted counts stop at it.
The definitions live in :mod:`draftwise.speculation.cost_model`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from draftwise.speculation import cost_model

__all__ = ["SpeculativeStats", "HYBRID_SIDES", "hybrid_step_side", "total_hybrid_steps", "hybrid_steps_line",
           "choices_stats"]

#: The hybrid method's sides, in report order (:attr:`SpeculativeStats.hybrid_steps` keys).
HYBRID_SIDES = ("suffix", "draft_model", "plain")


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
    num_jump_forward_tokens: int = 0  # tokens a grammar forced, drafted for free (not counted as drafts above)
    processor_time_s: float = 0.0  # logits processors (grammar masks) on the target's rows and the drafts
    hybrid_steps: dict[str, int] | None = None  # hybrid only: passes per HYBRID_SIDES side; None for other methods
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    rejected_per_position: list[int] = field(default_factory=list)  # drafts whose first rejection was there
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
        """Count one verification pass: ``num_drafted`` offered, the first ``num_accepted`` of them accepted
        (both counted up to a stop token, see the module docstring), ``num_committed`` tokens added to the
        output by this pass (accepted + bonus, after stop truncation).

        Raises:
            ValueError: ``num_accepted`` outside ``0..num_drafted``.
        """
        if not (0 <= num_accepted <= num_drafted):
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafted tokens")
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
        if num_accepted < num_drafted:
            self.rejected_per_position[num_accepted] += 1

    def start_hybrid_steps(self) -> None:
        """Count the hybrid's passes from here (every side at 0), so that a hybrid request no pass of which was
        drafted (a one-token answer) reports zeros, not None (which says another method ran)."""
        if self.hybrid_steps is None:
            self.hybrid_steps = dict.fromkeys(HYBRID_SIDES, 0)

    def record_hybrid_step(self, side: str, num_drafted: int) -> None:
        """Count one verification pass of the hybrid method by the side that drafted it (``"suffix"`` or
        ``"draft_model"``, as :meth:`record_step` counted its ``num_drafted``); a pass that carried no draft token
        counts as ``"plain"``, whichever side was chosen.

        Raises:
            ValueError: ``side`` is not one of :data:`HYBRID_SIDES`.
        """
        self.start_hybrid_steps()
        self.hybrid_steps[hybrid_step_side(side, num_drafted)] += 1

    def _grow(self, length: int) -> None:
        while len(self.drafted_per_position) < length:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
            self.rejected_per_position.append(0)

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (None when nothing was drafted); :func:`draftwise.speculation.cost_model.acceptance_rate`."""
        return cost_model.acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def token_acceptance(self) -> float | None:
        """Per-token acceptance probability ``a`` (None when nothing was judged);
        :func:`draftwise.speculation.cost_model.token_acceptance`."""
        return cost_model.token_acceptance(self.accepted_per_position, self.rejected_per_position)

    @property
    def mean_accepted_length(self) -> float:
        """tau = 1 + accepted / decode-phase target passes (1.0 without any);
        :func:`draftwise.speculation.cost_model.mean_accepted_length`."""
        return cost_model.mean_accepted_length(self.num_accepted_tokens, self.num_target_passes)

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
            token_acceptance=self.token_acceptance,
            mean_accepted_length=self.mean_accepted_length,
            acceptance_by_position=self.acceptance_by_position,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            overhead_time_s=self.overhead_time_s,
        )
        return data


def hybrid_step_side(side: str, num_drafted: int) -> str:
    """Which :data:`HYBRID_SIDES` count a hybrid pass goes to: ``side`` (``"suffix"`` or ``"draft_model"``, the
    side chosen) when it carried draft tokens, else ``"plain"``.

    Raises:
        ValueError: ``side`` is not one of :data:`HYBRID_SIDES`.
    """
    if side not in HYBRID_SIDES:
        raise ValueError(f"unknown hybrid side {side!r}; expected one of {HYBRID_SIDES}")
    return side if num_drafted else "plain"


def total_hybrid_steps(per_request: Iterable[Mapping[str, int] | None]) -> dict[str, int] | None:
    """Sum requests' hybrid steps (:attr:`SpeculativeStats.hybrid_steps`, or the server's
    ``usage.speculative.hybrid_steps``) by side; None when no request has any (no hybrid ran)."""
    found = [steps for steps in per_request if steps]
    if not found:
        return None
    return {side: sum(int(steps.get(side, 0)) for steps in found) for side in HYBRID_SIDES}


def hybrid_steps_line(steps: Mapping[str, int]) -> str:
    """``hybrid steps: suffix 12, draft model 5, plain 3``: the one-line form the CLI and reports print."""
    return "hybrid steps: " + ", ".join(f"{side.replace('_', ' ')} {int(steps.get(side, 0))}" for side in HYBRID_SIDES)


def choices_stats(parts: Sequence[SpeculativeStats]) -> SpeculativeStats:
    """One request's statistics over its ``n`` choices (sequences sharing one prompt): the prompt counted once
    (the first choice's, which prefilled it, with its cached tokens), every count summed, per-position counts
    summed position by position, hybrid steps summed by side; seconds of the target, drafting and processors
    summed (the choices shared passes, so this counts a shared pass once per choice), wall times (prefill,
    total) the longest. A single choice's statistics are returned as they are.

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("no statistics to combine")
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    combined = SpeculativeStats(num_prompt_tokens=first.num_prompt_tokens,
                                num_cached_prompt_tokens=first.num_cached_prompt_tokens,
                                finish_reason=first.finish_reason)
    for name in ("num_generated_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_target_passes",
                 "num_step_tokens", "num_tree_nodes", "num_jump_forward_tokens", "processor_time_s",
                 "target_time_s", "draft_time_s"):
        setattr(combined, name, sum(getattr(part, name) for part in parts))
    combined.prefill_time_s = max(part.prefill_time_s for part in parts)
    combined.total_time_s = max(part.total_time_s for part in parts)
    combined._grow(max(len(part.drafted_per_position) for part in parts))
    for part in parts:
        for position in range(len(part.drafted_per_position)):
            combined.drafted_per_position[position] += part.drafted_per_position[position]
            combined.accepted_per_position[position] += part.accepted_per_position[position]
            combined.rejected_per_position[position] += part.rejected_per_position[position]
        combined.k_history += part.k_history
        combined.step_tokens += part.step_tokens
        combined.warnings += [w for w in part.warnings if w not in combined.warnings]
    combined.hybrid_steps = total_hybrid_steps(part.hybrid_steps for part in parts)
    return combined
