"""Choosing K, the number of draft tokens per verification pass.

The engine asks a per-request controller for K before every step and reports each verification back.
:class:`FixedK` always speculates the configured maximum. :class:`AutoK` picks K from a cost model and the
request's online acceptance rates to maximise expected committed tokens per second (Leviathan et al. 2023).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from draftwise.calibration import CostModel

__all__ = [
    "KController",
    "FixedK",
    "AutoK",
    "AcceptanceEstimator",
    "expected_tokens",
    "leviathan_expected_tokens",
    "k_controller_factory",
    "SPECULATION_DISABLED_NOTE",
    "SPECULATION_UNPROFITABLE_NOTE",
]

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------------------------- adaptive K
SPECULATION_DISABLED_NOTE = "draft disagrees with target: speculation disabled"
SPECULATION_UNPROFITABLE_NOTE = (
    "speculation cannot pay with the measured costs (even a perfect draft would be slower than plain "
    "decoding): speculation disabled"
)


def expected_tokens(acceptance: Sequence[float]) -> float:
    """Expected tokens committed by one step that drafts ``len(acceptance)`` tokens, bonus token included.

    ``acceptance[i]`` is the probability that draft position i + 1 is accepted given that all earlier ones
    were: ``E = 1 + sum_j prod_{i <= j} acceptance[i]``. With a constant rate alpha this is Leviathan et al.
    2023, Eq. 1: ``(1 - alpha^(K+1)) / (1 - alpha)``.
    """
    total, reach = 1.0, 1.0
    for rate in acceptance:
        reach *= rate
        total += reach
    return total


def leviathan_expected_tokens(alpha: float, k: int) -> float:
    """``(1 - alpha^(k+1)) / (1 - alpha)`` (k + 1 when alpha = 1): Leviathan et al. 2023, Eq. 1."""
    if not (0.0 <= alpha <= 1.0) or k < 0:
        raise ValueError(f"need alpha in [0, 1] and k >= 0, got {alpha}, {k}")
    return float(k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


class AcceptanceEstimator:
    """Online per-position acceptance rates of one request, smoothed and exponentially forgotten.

    Position i's rate is the conditional probability that draft token i is accepted given tokens 1..i-1
    were. Counts (trials, successes) decay by ``decay`` at every observed draft, so about
    ``1 / (1 - decay)`` recent drafts matter. The pooled rate over all positions has a Beta prior
    (``prior_mean``, ``prior_strength`` pseudo-trials); each position's rate shrinks toward the pooled rate
    with ``position_strength`` pseudo-trials, so positions rarely drafted borrow from the others.

    Args:
        max_k: positions tracked initially (more are added on demand).
        prior_mean: acceptance assumed before any evidence, in (0, 1).
        prior_strength: weight of the prior in pseudo-trials (> 0).
        position_strength: shrinkage of each position toward the pooled rate, in pseudo-trials (>= 0).
        decay: per-draft forgetting factor in (0, 1].

    Raises:
        ValueError: on out-of-range arguments.
    """

    def __init__(
        self,
        max_k: int,
        *,
        prior_mean: float = 0.6,
        prior_strength: float = 1.0,
        position_strength: float = 4.0,
        decay: float = 0.98,
    ) -> None:
        if not (0.0 < prior_mean < 1.0) or prior_strength <= 0 or position_strength < 0 or not (0 < decay <= 1):
            raise ValueError("need 0 < prior_mean < 1, prior_strength > 0, position_strength >= 0, 0 < decay <= 1")
        self.prior_mean = prior_mean
        self.prior_strength = prior_strength
        self.position_strength = position_strength
        self.decay = decay
        self._trials = [0.0] * max(1, max_k)
        self._successes = [0.0] * max(1, max_k)
        self.num_observed = 0  # drafts observed (not decayed)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Record one verified draft: ``num_drafted`` tokens offered, the first ``num_accepted`` accepted."""
        if num_drafted <= 0:
            return
        if not (0 <= num_accepted <= num_drafted):
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafted tokens")
        while len(self._trials) < num_drafted:
            self._trials.append(0.0)
            self._successes.append(0.0)
        self.num_observed += 1
        self._trials = [t * self.decay for t in self._trials]
        self._successes = [s * self.decay for s in self._successes]
        for position in range(min(num_accepted + 1, num_drafted)):  # positions the target looked at
            self._trials[position] += 1.0
            self._successes[position] += 1.0 if position < num_accepted else 0.0

    @property
    def overall(self) -> float:
        """Pooled acceptance rate over all positions (prior included)."""
        weight = self.prior_strength
        return (sum(self._successes) + self.prior_mean * weight) / (sum(self._trials) + weight)

    def rates(self, k: int) -> list[float]:
        """Conditional acceptance rates of positions 1..k."""
        pooled = self.overall
        out = []
        for position in range(k):
            trials = self._trials[position] if position < len(self._trials) else 0.0
            successes = self._successes[position] if position < len(self._successes) else 0.0
            out.append((successes + self.position_strength * pooled) / (trials + self.position_strength)
                       if trials + self.position_strength > 0 else pooled)
        return out


class AutoK(KController):
    """Picks K in 0..max_k before every step to maximise expected committed tokens per second.

    Model (Leviathan et al. 2023, Sec. 3.4, with measured costs instead of their linear one): a step with K
    draft tokens commits ``E(K) = 1 + sum_j prod_{i<=j} a_i`` tokens on average (per-position acceptance
    ``a_i`` from :class:`AcceptanceEstimator`) and costs ``K * draft_s + verify_s(K + 1)`` seconds (from a
    :class:`~draftwise.calibration.CostModel`); K = 0 is a plain step costing ``verify_s(1)``.
    The controller returns ``argmax_K E(K) / cost(K)``, preferring the smaller K on ties.

    When the best K is 0 although a perfect draft would pay, the controller first probes with ``probe_k``
    (before any evidence, the prior alone decides nothing). Once a probe is rejected, the draft disagrees
    with the target: :data:`SPECULATION_DISABLED_NOTE` is noted once, and speculation is re-probed with a
    small K after ``probe_interval`` plain steps. A probe that is fully accepted is followed at once by
    another with twice the K (so a draft that starts agreeing, e.g. n-gram lookup entering copied text, is
    picked up within a few steps); a rejected probe doubles the interval, up to ``max_probe_interval``, or
    more when the measured probe cost needs it to stay within ``probe_budget``. A probe that drafted
    nothing (n-gram lookup without a match) stays pending, which costs nothing. When even a perfect draft
    could not pay with the measured costs, :data:`SPECULATION_UNPROFITABLE_NOTE` is noted and no probes run.

    With ``learn_costs``, the measured step times the engine reports refine the cost model: a common scale
    factor on the verify curve (exponential average of measured / predicted verify time) and the draft cost
    per token (only from steps that follow a drafting step, so a draft model's catch-up after plain steps
    does not count).

    Args:
        cost_model: calibrated or scripted costs (seconds).
        max_k: the largest K (the configured ``num_speculative_tokens``, >= 1).
        estimator: acceptance estimator (default: :class:`AcceptanceEstimator` with its defaults).
        probe_interval: plain steps before the first re-probe (>= 1).
        max_probe_interval: cap of the doubling interval (>= probe_interval).
        probe_k: K of a first probe (1..max_k).
        probe_budget: fraction of plain decoding time that failed probes may cost, in (0, 1]: a failed
            probe that took ``t`` seconds more than a plain step delays the next one by at least
            ``t / (probe_budget * plain step seconds)`` steps (measured times; ignored when they are 0).
        learn_costs: refine the costs from the times passed to :meth:`observe`.
        cost_smoothing: weight of a new time measurement in the running averages, in (0, 1].

    Raises:
        ValueError: on out-of-range arguments.

    Attributes:
        history: the K chosen at each step, in order (before the engine's clamping).
    """

    def __init__(
        self,
        cost_model: CostModel,
        max_k: int,
        *,
        estimator: AcceptanceEstimator | None = None,
        probe_interval: int = 16,
        max_probe_interval: int = 256,
        probe_k: int = 1,
        probe_budget: float = 0.02,
        learn_costs: bool = True,
        cost_smoothing: float = 0.1,
    ) -> None:
        if max_k < 1 or not (1 <= probe_k <= max_k) or not (1 <= probe_interval <= max_probe_interval):
            raise ValueError("need max_k >= 1, 1 <= probe_k <= max_k and 1 <= probe_interval <= max_probe_interval")
        if not (0.0 < probe_budget <= 1.0):
            raise ValueError(f"probe_budget must be in (0, 1], got {probe_budget}")
        if not (0.0 < cost_smoothing <= 1.0):
            raise ValueError(f"cost_smoothing must be in (0, 1], got {cost_smoothing}")
        self.cost_model = cost_model
        self.max_k = max_k
        self.estimator = estimator or AcceptanceEstimator(max_k)
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_k = probe_k
        self.probe_budget = probe_budget
        self.learn_costs = learn_costs
        self.cost_smoothing = cost_smoothing
        self.history: list[int] = []
        self.verify_scale = 1.0  # measured / calibrated verify time
        self.draft_seconds_per_token = cost_model.draft_seconds_per_token
        self._notes: list[str] = []
        self._disabled = False
        self._plain_streak = 0
        self._interval = probe_interval
        self._next_probe_k = probe_k  # > 0: probe with this K at the next step (before any evidence: at once)
        self._probing = 0  # K of the probe in flight
        self._last_drafted = 0

    # ------------------------------------------------------------------ the model
    def step_cost(self, k: int) -> float:
        """Predicted seconds of a step with K draft tokens (learned corrections included)."""
        return k * self.draft_seconds_per_token + self.verify_scale * self.cost_model.verify_cost(k + 1)

    def expected_rate(self, k: int, acceptance: Sequence[float] | None = None) -> float:
        """Predicted committed tokens per second of a step with K draft tokens."""
        rates = self.estimator.rates(k) if acceptance is None else list(acceptance)[:k]
        return expected_tokens(rates) / self.step_cost(k)

    def best_k(self, acceptance: Sequence[float] | None = None) -> int:
        """argmax over K in 0..max_k of :meth:`expected_rate` (smallest K on ties)."""
        rates = self.estimator.rates(self.max_k) if acceptance is None else list(acceptance)
        best, best_rate = 0, self.expected_rate(0, rates)
        for k in range(1, self.max_k + 1):
            rate = self.expected_rate(k, rates)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best

    def can_pay(self) -> bool:
        """Whether some K >= 1 beats a plain step when every draft token is accepted."""
        return self.best_k([1.0] * self.max_k) > 0

    def break_even_acceptance(self) -> float:
        """Smallest constant acceptance rate at which some K >= 1 beats plain decoding (1.0 if none does)."""
        if not self.can_pay():
            return 1.0
        low, high = 0.0, 1.0
        for _ in range(30):
            mid = (low + high) / 2
            if self.best_k([mid] * self.max_k) > 0:
                high = mid
            else:
                low = mid
        return high

    # ------------------------------------------------------------------ KController
    def choose_k(self) -> int:
        k = self._choose()
        self.history.append(k)
        return k

    def _choose(self) -> int:
        best = self.best_k()
        if best > 0:
            if self._disabled:
                logger.info("speculation re-enabled (acceptance %.2f): K=%d", self.estimator.overall, best)
            self._disabled, self._plain_streak, self._interval, self._next_probe_k = False, 0, self.probe_interval, 0
            return best
        if not self.can_pay():
            self._note(SPECULATION_UNPROFITABLE_NOTE)
            return 0
        if self._next_probe_k == 0:
            if not self._disabled:
                self._disabled = True
                self._note(SPECULATION_DISABLED_NOTE)
                logger.info("speculation disabled: acceptance %.2f below break-even %.2f",
                            self.estimator.overall, self.break_even_acceptance())
            if self._plain_streak < self._interval:
                self._plain_streak += 1
                return 0
            self._next_probe_k = self.probe_k
        # a first probe (before any evidence), a scheduled re-probe, or a probe chain that keeps being accepted
        self._probing, self._plain_streak = self._next_probe_k, 0
        return self._probing

    def observe(self, num_drafted: int, num_accepted: int, draft_time_s: float, target_time_s: float) -> None:
        self.estimator.observe(num_drafted, num_accepted)
        if self._probing:
            self._after_probe(num_drafted, num_accepted, draft_time_s + target_time_s)
        if self.learn_costs:
            self._learn_costs(num_drafted, draft_time_s, target_time_s)
        self._last_drafted = num_drafted

    def notes(self) -> list[str]:
        return list(self._notes)

    # ------------------------------------------------------------------ helpers
    def _after_probe(self, num_drafted: int, num_accepted: int, probe_time_s: float) -> None:
        probe, self._probing = self._probing, 0
        if num_drafted == 0:  # nothing to verify (no n-gram match, or clamped): try again next step
            self._next_probe_k = probe
        elif num_accepted == num_drafted:
            self._next_probe_k = min(2 * probe, self.max_k)
            self._interval = self.probe_interval
        else:
            self._next_probe_k = 0
            self._interval = max(min(2 * self._interval, self.max_probe_interval), self._budget_interval(probe_time_s))

    def _budget_interval(self, probe_time_s: float) -> int:
        """Plain steps needed so that a failed probe's extra time (seconds beyond a plain step, e.g. a draft
        model catching up on the skipped tokens) stays within ``probe_budget`` of the plain decoding time."""
        plain_step_s = self.step_cost(0)
        extra_s = probe_time_s - plain_step_s
        if extra_s <= 0 or plain_step_s <= 0:
            return 0
        return math.ceil(extra_s / (self.probe_budget * plain_step_s))

    def _learn_costs(self, num_drafted: int, draft_time_s: float, target_time_s: float) -> None:
        w = self.cost_smoothing
        if target_time_s > 0:
            ratio = target_time_s / self.cost_model.verify_cost(num_drafted + 1)
            self.verify_scale += w * (ratio - self.verify_scale)
        if num_drafted > 0 and self._last_drafted > 0 and draft_time_s > 0:
            per_token = draft_time_s / num_drafted
            self.draft_seconds_per_token += w * (per_token - self.draft_seconds_per_token)

    def _note(self, note: str) -> None:
        if note not in self._notes:
            self._notes.append(note)


def k_controller_factory(k_policy: str, max_k: int, cost_model: CostModel | None = None,
                         **auto_options) -> Callable[[], KController]:
    """A per-request controller factory for :class:`draftwise.engine.SpeculativeEngine`.

    Args:
        k_policy: ``"fixed"`` (always ``max_k``) or ``"auto"`` (:class:`AutoK`).
        max_k: K, or the maximum K for ``"auto"``.
        cost_model: required for ``"auto"``.
        auto_options: extra keyword arguments for :class:`AutoK`.

    Raises:
        ValueError: unknown policy or a missing cost model.
    """
    if k_policy == "fixed":
        return lambda: FixedK(max_k)
    if k_policy == "auto":
        if cost_model is None:
            raise ValueError("k_policy 'auto' needs a cost model (see draftwise.calibration.calibrate_cost_model)")
        return lambda: AutoK(cost_model, max_k, **auto_options)
    raise ValueError(f"unknown k_policy {k_policy!r}; choose 'fixed' or 'auto'")
