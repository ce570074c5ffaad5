"""Choosing K, the number of draft tokens per verification pass.

The engine asks a per-request controller for K before every step and reports each verification back.
:class:`FixedK` always speculates the configured maximum. :class:`AutoK` picks K from the cost model and
online acceptance estimates (:mod:`draftwise.speculation.cost_model`, Leviathan et al. 2023) to maximise expected
committed tokens per second, prices a draft model's catch-up prefill against what the remaining tokens can
gain, and keeps what it learned in a per-engine :class:`AutoKMemory` across requests.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from draftwise.speculation.cost_model import CostModel, expected_tokens, expected_tokens_per_step
from draftwise.methods import CATCH_UP_MODES, DEFAULT_CATCH_UP

__all__ = [
    "KController",
    "FixedK",
    "AutoK",
    "AutoKMemory",
    "AcceptanceEstimator",
    "ProbeBackoff",
    "expected_tokens",
    "leviathan_expected_tokens",
    "k_controller_factory",
    "SPECULATION_DISABLED_NOTE",
    "SPECULATION_UNPROFITABLE_NOTE",
    "CATCH_UP_NOTE",
]

logger = logging.getLogger(__name__)

#: Leviathan et al. 2023, Eq. 1 (the one definition lives in :mod:`draftwise.speculation.cost_model`).
leviathan_expected_tokens = expected_tokens_per_step


class KController(ABC):
    """Per-request policy for K. One instance serves one request."""

    def start(self, prompt_tokens: int, max_tokens: int, cached_tokens: int = 0) -> None:
        """Called once before the request's prefill: its prompt length, ``max_tokens`` and how many prompt
        tokens the prefix cache already holds (for the target and, kept with it, a draft model) (tokens).
        Default: ignore."""

    @abstractmethod
    def choose_k(self) -> int:
        """K for the next step (0 means a plain decoding step)."""

    def observe(self, num_drafted: int, num_accepted: int, draft_time_s: float, target_time_s: float, *,
                overhead_s: float = 0.0, model_drafted: bool = True) -> None:
        """Record the outcome of one step (tokens, seconds); ``overhead_s``: the engine's current estimate of its
        own time per step beyond the passes (:class:`draftwise.speculation.cost_model.StepOverhead`); ``model_drafted``:
        False when another proposer than the one the costs price drafted this step (``hybrid``'s suffix side: its
        draft model did not run and fell further behind). Default: ignore."""

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
SPECULATION_DISABLED_NOTE = ("the target rejected the proposer's draft tokens: speculation paused (re-probed with a "
                             "small K later)")
SPECULATION_UNPROFITABLE_NOTE = (
    "speculation cannot pay with the measured costs (even a perfect draft would be slower than plain "
    "decoding): speculation disabled"
)
CATCH_UP_NOTE = (
    "the draft's catch-up prefill of the context would cost more than speculating can gain (over the "
    "remaining tokens with catch_up 'eager', over the tokens generated so far with 'deferred'): decoded plainly"
)


class AcceptanceEstimator:
    """Online per-position conditional acceptance rates, split by what the previous draft did.

    Position i's rate is the probability that draft token i is accepted given tokens 1..i-1 were
    (:func:`draftwise.speculation.cost_model.conditional_acceptance`). Acceptance comes in runs (an n-gram proposer
    inside copied text, a draft model on boilerplate), so the counts are kept per *regime*: after a draft
    that was accepted in full, and after one that was rejected somewhere. Each regime's rate at a position
    shrinks toward the position's rate over both regimes (``regime_strength`` pseudo-trials), which shrinks
    toward the rate pooled over all positions (``position_strength``), which has a Beta prior
    (``prior_mean``, ``prior_strength``). Counts decay by ``decay`` at every observed draft, so about
    ``1 / (1 - decay)`` recent drafts matter.

    Args:
        max_k: positions tracked initially (more are added on demand).
        prior_mean: acceptance assumed before any evidence, in (0, 1).
        prior_strength: weight of the prior in pseudo-trials (> 0).
        position_strength: shrinkage of a position toward the pooled rate, in pseudo-trials (>= 0).
        regime_strength: shrinkage of a regime toward both regimes' rate, in pseudo-trials (>= 0).
        decay: per-draft forgetting factor in (0, 1].

    Raises:
        ValueError: on out-of-range arguments.
    """

    FULL, REJECTED = 1, 0  # regimes: what the previous draft did

    def __init__(
        self,
        max_k: int,
        *,
        prior_mean: float = 0.6,
        prior_strength: float = 1.0,
        position_strength: float = 16.0,
        regime_strength: float = 64.0,
        decay: float = 0.99,
    ) -> None:
        if not (0.0 < prior_mean < 1.0) or prior_strength <= 0 or position_strength < 0 or regime_strength < 0:
            raise ValueError("need 0 < prior_mean < 1, prior_strength > 0, position_strength >= 0, regime_strength >= 0")
        if not (0 < decay <= 1):
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.prior_mean = prior_mean
        self.prior_strength = prior_strength
        self.position_strength = position_strength
        self.regime_strength = regime_strength
        self.decay = decay
        width = max(1, max_k)
        self._trials = [[0.0] * width, [0.0] * width]  # [regime][position]
        self._successes = [[0.0] * width, [0.0] * width]
        self.regime: int | None = None  # None: no draft seen yet (rates pool both regimes)
        self.num_observed = 0  # drafts observed (not decayed)

    def seeded(self, strength: float) -> AcceptanceEstimator:
        """A fresh estimator (same settings) whose counts are this one's, scaled to at most ``strength``
        drafts: a prior that a request's own evidence outweighs after a few drafts."""
        other = AcceptanceEstimator(len(self._trials[0]), prior_mean=self.prior_mean,
                                    prior_strength=self.prior_strength, position_strength=self.position_strength,
                                    regime_strength=self.regime_strength, decay=self.decay)
        drafts = self._trials[0][0] + self._trials[1][0]
        scale = min(1.0, strength / drafts) if drafts > 0 else 0.0
        other._trials = [[t * scale for t in row] for row in self._trials]
        other._successes = [[s * scale for s in row] for row in self._successes]
        return other

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Record one verified draft: ``num_drafted`` tokens offered, the first ``num_accepted`` accepted.

        Raises:
            ValueError: ``num_accepted`` outside ``0..num_drafted``.
        """
        if num_drafted <= 0:
            return
        if not (0 <= num_accepted <= num_drafted):
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafted tokens")
        self._grow(num_drafted)
        self.num_observed += 1
        for regime in (0, 1):
            self._trials[regime] = [t * self.decay for t in self._trials[regime]]
            self._successes[regime] = [s * self.decay for s in self._successes[regime]]
        regime = self.REJECTED if self.regime is None else self.regime
        for position in range(min(num_accepted + 1, num_drafted)):  # positions the target judged
            self._trials[regime][position] += 1.0
            self._successes[regime][position] += 1.0 if position < num_accepted else 0.0
        self.regime = self.FULL if num_accepted == num_drafted else self.REJECTED

    def _grow(self, length: int) -> None:
        for rows in (self._trials, self._successes):
            for row in rows:
                row.extend([0.0] * (length - len(row)))

    @property
    def overall(self) -> float:
        """Pooled acceptance rate over all positions and regimes (prior included)."""
        successes = sum(map(sum, self._successes))
        trials = sum(map(sum, self._trials))
        return (successes + self.prior_mean * self.prior_strength) / (trials + self.prior_strength)

    def rates(self, k: int, regime: int | None = None, optimism: float = 0.0) -> list[float]:
        """Conditional acceptance rates of positions 1..k in ``regime`` (default: the current one).

        ``optimism`` z >= 0 raises each rate by z standard errors of a Beta estimate, ``sqrt(r (1 - r) / (n + 1))``
        with n the position's (decayed) trials plus ``prior_strength``: an upper confidence bound (UCB1's
        optimism under uncertainty, Auer et al. 2002) that is wide where a position has little evidence (a
        request's first drafts, positions deeper than the K tried so far) and closes as trials accumulate."""
        regime = self.regime if regime is None else regime
        pooled = self.overall
        out = []
        for position in range(k):
            trials = [row[position] if position < len(row) else 0.0 for row in self._trials]
            successes = [row[position] if position < len(row) else 0.0 for row in self._successes]
            rate = _shrunk(sum(successes), sum(trials), pooled, self.position_strength)
            if regime is not None:
                rate = _shrunk(successes[regime], trials[regime], rate, self.regime_strength)
            if optimism > 0:
                evidence = sum(trials) + self.prior_strength
                rate = min(1.0, rate + optimism * math.sqrt(rate * (1.0 - rate) / (evidence + 1.0)))
            out.append(rate)
        return out


def _shrunk(successes: float, trials: float, toward: float, strength: float) -> float:
    """``(successes + strength * toward) / (trials + strength)`` (``toward`` without any weight)."""
    return (successes + strength * toward) / (trials + strength) if trials + strength > 0 else toward


class ProbeBackoff:
    """When a speculation kept off (its acceptance looked too low) is probed again: after ``interval`` plain
    steps. A rejected probe doubles the interval up to ``maximum`` (or to a longer interval a caller's budget
    needs); an accepted one, or speculation turned back on, resets it to ``first``. The one probe schedule of
    both K policies: a request's :class:`AutoK` (16 -> 256 plain steps by default) and the engine core's
    load-aware batch plan (4 -> 64).

    Args:
        first: plain steps before the first probe (>= 1).
        maximum: cap of the doubling interval (>= first).

    Raises:
        ValueError: out-of-range arguments.
    """

    def __init__(self, first: int, maximum: int) -> None:
        if not 1 <= first <= maximum:
            raise ValueError(f"need 1 <= first <= maximum, got {first} and {maximum}")
        self.first = first
        self.maximum = maximum
        self.interval = first

    def rejected(self, at_least: int = 0) -> None:
        """A probe was rejected: double the interval (capped), or take ``at_least`` plain steps if longer."""
        self.interval = max(min(2 * self.interval, self.maximum), at_least)

    def reset(self) -> None:
        """A probe was accepted (or speculation came back): the next one is due after ``first`` steps."""
        self.interval = self.first


@dataclass
class AutoKMemory:
    """What the :class:`AutoK` controllers of one engine learn, kept across its requests.

    :func:`k_controller_factory` makes one per engine and hands it to every request's controller (the engine
    serves one request at a time). Each request seeds its own acceptance estimate from ``estimator`` and
    updates it and the learned costs as it goes.

    Attributes:
        estimator: long-memory acceptance estimate over the engine's recent drafts.
        verify_scales: ``verify_scales[j - 1]``: measured / calibrated time of a j-token verify pass
            (missing: 1.0). ``verify_samples``: passes measured per token count. ``draft_samples``: drafting
            steps the draft time per token was learned from.
        draft_seconds_per_token: learned proposer time per draft token at the calibrated context
            (None: the cost model's).
        draft_step_seconds: learned fixed cost of a drafting step beyond that (None: the cost model's); see
            :func:`fit_draft_cost`.
        draft_moments: running means ``[K, t, K^2, K t]`` of the drafting steps' K and seconds t (None before
            the first), which the two draft costs are fitted to.
        catch_up_seconds_per_token: learned draft prefill time per caught-up token (None: the cost model's).
        step_overhead_seconds: the engine's own time per step beyond the passes, as it last reported it (None:
            the cost model's).
        num_requests: requests started.
    """

    estimator: AcceptanceEstimator
    verify_scales: list[float] = dataclasses.field(default_factory=list)
    verify_samples: list[int] = dataclasses.field(default_factory=list)
    draft_seconds_per_token: float | None = None
    draft_step_seconds: float | None = None
    draft_moments: list[float] | None = None
    catch_up_seconds_per_token: float | None = None
    step_overhead_seconds: float | None = None
    draft_samples: int = 0
    num_requests: int = 0

    @classmethod
    def fresh(cls, max_k: int, prior_strength: float = 1.0) -> AutoKMemory:
        """Nothing learned yet; the long-memory estimator forgets over about 200 drafts and starts from its
        prior with ``prior_strength`` pseudo-trials (see :data:`MODEL_PRIOR_STRENGTH`)."""
        return cls(AcceptanceEstimator(max_k, decay=0.995, prior_strength=prior_strength))


class AutoK(KController):
    """Picks K in 0..max_k before every step to maximise expected committed tokens per second.

    Model (Leviathan et al. 2023, Sec. 3.4, with measured costs instead of their linear one; see
    :mod:`draftwise.speculation.cost_model`): a step with K draft tokens commits ``E(K) = 1 + sum_j prod_{i<=j} a_i``
    tokens on average (per-position conditional acceptance ``a_i`` from :class:`AcceptanceEstimator`, in the
    regime the previous draft left) and costs ``CostModel.step_cost(K)`` seconds at the request's current
    context length; K = 0 is a plain step. The controller returns ``argmax_K E(K) / cost(K)``, preferring
    the smaller K on ties. The rates it uses are upper confidence bounds (``optimism`` standard errors above the
    estimate): a few unlucky first drafts do not switch a good draft off, and positions deeper than the K tried
    so far are tried instead of being judged by the shallow ones' rate; with evidence the bound closes on the
    estimate.

    Catch-up: a draft model that has not seen the context (the prompt at the start of a request, tokens
    committed by plain steps) must prefill it before it drafts (``CostModel.catch_up_cost``). The controller
    speculates only when the time the chosen K saves over the catch-up's horizon (below) exceeds that catch-up
    (:data:`CATCH_UP_NOTE` otherwise), so a request with a long prompt and few new tokens decodes plainly and
    never pays the draft's prefill. Needs :meth:`start` (the engine calls it); without it the
    horizon is unbounded. The answer's length is not known, only its bound: with ``catch_up="eager"`` the
    horizon is the remaining ``max_tokens``, so a draft catches up at once when a full-length answer
    would repay it, and a short answer after a long prompt loses the catch-up. With ``"deferred"`` (the default,
    :data:`~draftwise.methods.DEFAULT_CATCH_UP`) the horizon is the tokens generated so far (at least
    :data:`DEFERRED_HORIZON_FLOOR`, at most the remaining ``max_tokens``): the ski-rental rule (Karlin et al.
    1988), which decodes plainly until the saving given up would have paid the catch-up, never pays a catch-up for
    an answer that ends before that, and loses at most one catch-up's worth on a long answer (docs/draft_trees.md).

    Probing: when the best K is 0 although a perfect draft would pay, the controller probes with ``probe_k``
    (at once before any evidence, and then also when the prior's best K would not repay the draft's catch-up but
    a perfect draft's would: the prior alone does not switch a draft off). Once a probe is rejected the draft
    disagrees with the target: :data:`SPECULATION_DISABLED_NOTE` is noted once, and speculation is
    re-probed with a small K after ``probe_interval`` plain steps. A probe that is fully accepted is followed
    at once by another with twice the K; a rejected probe doubles the interval, up to
    ``max_probe_interval``, or more when the probe's measured or predicted extra cost (a draft model's
    catch-up included) needs it to stay within ``probe_budget`` of the plain decoding time. A probe that
    drafted nothing (n-gram lookup without a match) stays pending, which costs nothing. A probe is skipped
    while even a perfect draft could not repay its catch-up over the remaining tokens. When even a perfect
    draft could not pay with the current costs, :data:`SPECULATION_UNPROFITABLE_NOTE` is noted; with
    ``learn_costs`` the same backed-off probes still run (they re-measure the costs, which may be stale).

    Learning (``learn_costs``): the measured step times refine the costs in ``memory``: a scale per point of
    the verify curve (running average of measured / predicted verify time of passes over that many tokens;
    unmeasured points take the last measured scale, and the curve is kept non-decreasing), the draft time
    per token (from steps whose draft was nearly in sync, or every drafting step of a proposer without
    catch-up) and a draft model's catch-up time per token (from its drafting steps after a gap). The engine's own
    time per step (``overhead_s`` of :meth:`observe`, which a plain step pays too) is priced into every step (with
    ``learn_costs``; otherwise the cost model's).

    Args:
        cost_model: calibrated or scripted costs (seconds).
        max_k: the largest K (the configured ``num_speculative_tokens``, >= 1).
        memory: the engine's :class:`AutoKMemory` (default: a fresh one, nothing kept).
        estimator: this request's acceptance estimator (default: seeded from ``memory``).
        probe_interval: plain steps before the first re-probe (>= 1).
        max_probe_interval: cap of the doubling interval (>= probe_interval).
        probe_k: K of a first probe (1..max_k).
        probe_budget: fraction of plain decoding time that failed probes may cost, in (0, 1].
        learn_costs: refine the costs from the times passed to :meth:`observe`.
        cost_smoothing: weight of a new step time in the running averages, in (0, 1].
        catch_up_smoothing: weight of a new catch-up measurement (rare, so weighted more), in (0, 1].
        memory_strength: drafts' worth of the engine's acceptance estimate a request starts from (>= 0).
        optimism: standard errors added to each acceptance rate the choice uses (>= 0; 0: the plain estimate).
        catch_up: ``"eager"`` or ``"deferred"``: the horizon a draft model's catch-up is priced against (above;
            :data:`CATCH_UP_MODES`).

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
        memory: AutoKMemory | None = None,
        estimator: AcceptanceEstimator | None = None,
        probe_interval: int = 16,
        max_probe_interval: int = 256,
        probe_k: int = 1,
        probe_budget: float = 0.02,
        learn_costs: bool = True,
        cost_smoothing: float = 0.1,
        catch_up_smoothing: float = 0.5,
        memory_strength: float = 8.0,
        optimism: float = 0.75,
        catch_up: str = DEFAULT_CATCH_UP,
    ) -> None:
        if catch_up not in CATCH_UP_MODES:
            raise ValueError(f"catch_up must be one of {', '.join(CATCH_UP_MODES)}, got {catch_up!r}")
        if max_k < 1 or not (1 <= probe_k <= max_k) or not (1 <= probe_interval <= max_probe_interval):
            raise ValueError("need max_k >= 1, 1 <= probe_k <= max_k and 1 <= probe_interval <= max_probe_interval")
        for name, value in (("probe_budget", probe_budget), ("cost_smoothing", cost_smoothing),
                            ("catch_up_smoothing", catch_up_smoothing)):
            if not (0.0 < value <= 1.0):
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if memory_strength < 0 or optimism < 0:
            raise ValueError(f"memory_strength and optimism must be >= 0, got {memory_strength}, {optimism}")
        self.cost_model = cost_model
        self.max_k = max_k
        self.memory = memory or AutoKMemory.fresh(max_k)
        self.memory.num_requests += 1
        evidence = self.memory.estimator.num_observed > 0
        self.estimator = estimator or self.memory.estimator.seeded(memory_strength)
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.backoff = ProbeBackoff(probe_interval, max_probe_interval)
        self.probe_k = probe_k
        self.probe_budget = probe_budget
        self.learn_costs = learn_costs
        self.cost_smoothing = cost_smoothing
        self.catch_up_smoothing = catch_up_smoothing
        self.optimism = optimism
        self.catch_up = catch_up
        self.history: list[int] = []
        self._notes: list[str] = []
        self._disabled = False
        self._unprofitable = False
        self._plain_streak = 0
        self._next_probe_k = 0 if evidence else probe_k  # > 0: probe with this K when due (first: at once)
        self._probing = 0  # K of the probe in flight
        self._context_len: int | None = None  # tokens in the context (None: unknown, the calibrated one)
        self._remaining: int | None = None  # tokens still allowed (None: unbounded)
        self._generated = 0  # tokens this request has generated (the deferred catch-up's horizon)
        self._draft_behind = 0  # context tokens a draft model has not seen
        self._costs: tuple[tuple, CostModel] | None = None

    # ------------------------------------------------------------------ learned costs (kept in memory)
    @property
    def verify_scale(self) -> float:
        """Measured / calibrated target time of a one-token pass."""
        return self.memory.verify_scales[0] if self.memory.verify_scales else 1.0

    @property
    def draft_seconds_per_token(self) -> float:
        """Proposer time per draft token at the calibrated context (learned, else calibrated)."""
        learned = self.memory.draft_seconds_per_token
        return self.cost_model.draft_seconds_per_token if learned is None else learned

    @property
    def draft_step_seconds(self) -> float:
        """A drafting step's fixed cost beyond K x :attr:`draft_seconds_per_token` (learned, else calibrated)."""
        learned = self.memory.draft_step_seconds
        return self.cost_model.draft_step_seconds if learned is None else learned

    @property
    def step_overhead_seconds(self) -> float:
        """The engine's own seconds per step beyond the passes (reported by the engine, else the cost model's)."""
        reported = self.memory.step_overhead_seconds
        return self.cost_model.step_overhead_seconds if reported is None else reported

    @property
    def catch_up_seconds_per_token(self) -> float:
        """A draft model's prefill time per caught-up token (learned, else calibrated)."""
        learned = self.memory.catch_up_seconds_per_token
        return self.cost_model.draft_prefill_seconds_per_token if learned is None else learned

    def costs(self) -> CostModel:
        """The cost model with the learned corrections applied."""
        key = (tuple(self.memory.verify_scales), self.draft_seconds_per_token, self.catch_up_seconds_per_token,
               self.draft_step_seconds, self.step_overhead_seconds)
        if self._costs is None or self._costs[0] != key:
            scales = list(key[0]) + [key[0][-1] if key[0] else 1.0] * len(self.cost_model.verify_seconds)
            curve = [v * scale for v, scale in zip(self.cost_model.verify_seconds, scales)]
            model = dataclasses.replace(  # read non-decreasing by its verify curve (PassCostCurve)
                self.cost_model, verify_seconds=tuple(curve),
                draft_seconds_per_token=key[1], draft_prefill_seconds_per_token=key[2], draft_step_seconds=key[3],
                step_overhead_seconds=key[4])
            self._costs = (key, model)
        return self._costs[1]

    # ------------------------------------------------------------------ the model
    def acceptance(self, k: int) -> list[float]:
        """The conditional acceptance rates of positions 1..k the choice uses: the estimator's, raised by
        ``optimism`` standard errors (:meth:`AcceptanceEstimator.rates`)."""
        return self.estimator.rates(k, optimism=self.optimism)

    def step_cost(self, k: int) -> float:
        """Predicted seconds of a step with K draft tokens at the current context."""
        return self.costs().step_cost(k, self._context_len)

    def expected_rate(self, k: int, acceptance: Sequence[float] | None = None) -> float:
        """Predicted committed tokens per second of a step with K draft tokens."""
        rates = self.acceptance(k) if acceptance is None else list(acceptance)[:k]
        return expected_tokens(rates) / self.step_cost(k)

    def best_k(self, acceptance: Sequence[float] | None = None) -> int:
        """argmax over K in 0..max_k of :meth:`expected_rate` (smallest K on ties), catch-up not included."""
        rates = self.acceptance(self.max_k) if acceptance is None else list(acceptance)
        return self.costs().best_k(rates, self.max_k, self._context_len)

    def can_pay(self) -> bool:
        """Whether some K >= 1 beats a plain step when every draft token is accepted."""
        return self.best_k([1.0] * self.max_k) > 0

    def break_even_acceptance(self) -> float:
        """Smallest constant acceptance rate at which some K >= 1 beats plain decoding (1.0 if none does)."""
        return self.costs().break_even_acceptance(self.max_k, self._context_len)

    def catch_up_cost(self) -> float:
        """Predicted seconds a draft model needs to catch up on the context before its next draft (beyond the
        one token every drafting step feeds, which the draft time per token covers)."""
        return self.costs().catch_up_cost(self._draft_behind - 1, self._context_len)

    def remaining_gain(self, k: int, acceptance: Sequence[float] | None = None) -> float:
        """Predicted seconds K draft tokens per step save over the remaining tokens, catch-up excluded
        (negative: lost; infinite when the request's length is unknown and K beats plain)."""
        rates = self.acceptance(k) if acceptance is None else list(acceptance)[:k]
        per_token = self.step_cost(0) - self.step_cost(k) / expected_tokens(rates)
        horizon = self.horizon()
        if horizon is None:
            return math.inf if per_token > 0 else per_token
        return horizon * per_token

    def horizon(self) -> int | None:
        """Tokens the catch-up is priced against: the remaining ``max_tokens`` (``catch_up="eager"``), or the
        tokens generated so far, at least :data:`DEFERRED_HORIZON_FLOOR` and at most the remaining ones
        (``"deferred"``); None when unbounded."""
        if self.catch_up == "deferred":
            floor_or_seen = max(self._generated, DEFERRED_HORIZON_FLOOR)
            return floor_or_seen if self._remaining is None else min(self._remaining, floor_or_seen)
        return self._remaining

    # ------------------------------------------------------------------ KController
    def start(self, prompt_tokens: int, max_tokens: int, cached_tokens: int = 0) -> None:
        """The request: ``prompt_tokens`` in the prompt, at most ``max_tokens`` new ones (the first comes
        from the prefill, before the first :meth:`choose_k`); a draft model kept in the prefix cache has
        ``cached_tokens`` of the prompt already, so only the rest is catch-up."""
        self._context_len = prompt_tokens + 1
        self._remaining = max(0, max_tokens - 1)
        self._generated = 1  # the prefill's token
        self._draft_behind = prompt_tokens + 1 - min(cached_tokens, prompt_tokens)

    def choose_k(self) -> int:
        k = self._choose()
        self.history.append(k)
        return k

    def _choose(self) -> int:
        rates = self.acceptance(self.max_k)
        best = self.best_k(rates)
        if best > 0:
            if self.remaining_gain(best, rates) <= self.catch_up_cost():
                if self._next_probe_k and self._probe_can_repay_catch_up():  # no evidence yet: the first probe
                    self._probing = self._next_probe_k
                    return self._probing
                self._note(CATCH_UP_NOTE)
                return 0
            if self._disabled:
                logger.info("speculation re-enabled (acceptance %.2f): K=%d", self.estimator.overall, best)
            self._disabled = self._unprofitable = False
            self._plain_streak, self._next_probe_k = 0, 0
            self.backoff.reset()
            return best
        if not self.can_pay():
            self._note(SPECULATION_UNPROFITABLE_NOTE)
            if not self._unprofitable:
                self._unprofitable = True
                self._next_probe_k = 0 if not self._probing else self._next_probe_k  # no probe before the interval
            if not self.learn_costs:
                return 0  # probes could not change the costs
            return self._probe_when_due(None)
        self._unprofitable = False
        return self._probe_when_due(SPECULATION_DISABLED_NOTE)

    def _probe_when_due(self, note: str | None) -> int:
        """K of a probe when one is due and affordable, else 0 (a plain step)."""
        if self._next_probe_k == 0:
            if not self._disabled:
                self._disabled = True
                if note:
                    self._note(note)
                    logger.info("speculation disabled: acceptance %.2f below break-even %.2f",
                                self.estimator.overall, self.break_even_acceptance())
            if self._plain_streak < max(self.backoff.interval, self._budget_interval(self._probe_extra_s(self.probe_k))):
                self._plain_streak += 1
                return 0
            self._next_probe_k = self.probe_k
        if note and not self._probe_can_repay_catch_up():
            self._note(CATCH_UP_NOTE)
            return 0
        self._probing, self._plain_streak = self._next_probe_k, 0
        return self._probing

    def _probe_extra_s(self, k: int) -> float:
        """Predicted seconds a probe of K tokens costs beyond a plain step (catch-up included)."""
        return self.catch_up_cost() + self.step_cost(k) - self.step_cost(0)

    def _probe_can_repay_catch_up(self) -> bool:
        """Whether a perfect draft could save, over the remaining tokens, more than the catch-up costs."""
        catch_up = self.catch_up_cost()
        if catch_up <= 0:
            return True
        perfect = [1.0] * self.max_k
        best = self.best_k(perfect)
        return best > 0 and self.remaining_gain(best, perfect) > catch_up

    def observe(self, num_drafted: int, num_accepted: int, draft_time_s: float, target_time_s: float, *,
                overhead_s: float = 0.0, model_drafted: bool = True) -> None:
        behind, context_len = self._draft_behind, self._context_len
        if self.learn_costs and overhead_s > 0:
            self.memory.step_overhead_seconds = overhead_s
        self.estimator.observe(num_drafted, num_accepted)
        self.memory.estimator.observe(num_drafted, num_accepted)
        if self._probing:
            self._after_probe(num_drafted, num_accepted, draft_time_s + target_time_s)
        if self.learn_costs:  # a step another proposer drafted says nothing of the draft model's costs
            self._learn_costs(num_drafted, draft_time_s if model_drafted else 0.0, target_time_s, behind, context_len)
        committed = num_accepted + 1
        if self._context_len is not None:
            self._context_len += committed
        if self._remaining is not None:
            self._remaining = max(0, self._remaining - committed)
        self._generated += committed
        self._draft_behind = 1 if num_drafted > 0 and model_drafted else self._draft_behind + committed

    def notes(self) -> list[str]:
        return list(self._notes)

    # ------------------------------------------------------------------ helpers
    def _after_probe(self, num_drafted: int, num_accepted: int, probe_time_s: float) -> None:
        probe, self._probing = self._probing, 0
        if num_drafted == 0:  # nothing to verify (no n-gram match, or clamped): try again next step
            self._next_probe_k = probe
        elif num_accepted == num_drafted and not self._unprofitable:
            self._next_probe_k = min(2 * probe, self.max_k)
            self.backoff.reset()
        else:
            self._next_probe_k = 0
            # the probe's measured time has no engine overhead in it: compare it with a plain step's passes
            self.backoff.rejected(self._budget_interval(probe_time_s + self.step_overhead_seconds - self.step_cost(0)))

    def _budget_interval(self, extra_s: float) -> int:
        """Plain steps needed so that a probe's extra time (seconds beyond a plain step, e.g. a draft model
        catching up on the skipped tokens) stays within ``probe_budget`` of the plain decoding time."""
        plain_step_s = self.step_cost(0)
        if extra_s <= 0 or plain_step_s <= 0:
            return 0
        return math.ceil(extra_s / (self.probe_budget * plain_step_s))

    def _learn_costs(self, num_drafted: int, draft_time_s: float, target_time_s: float, behind: int,
                     context_len: int | None) -> None:
        memory, model, w = self.memory, self.cost_model, self.cost_smoothing
        if target_time_s > 0 and num_drafted + 1 <= len(model.verify_seconds):
            self._learn_verify(num_drafted + 1, target_time_s / model.verify_cost(num_drafted + 1, context_len))
        if num_drafted <= 0 or draft_time_s <= 0:
            return
        growth = model.draft_growth(context_len)
        # nearly in sync, or a proposer without catch-up (n-gram lookup, heads): the time is the drafting
        if behind <= 2 or self.catch_up_seconds_per_token <= 0:
            memory.draft_samples += 1
            weight = max(w, 1.0 / memory.draft_samples)  # calibration may be stale: the first measurement wins
            t = draft_time_s / growth
            sample = [num_drafted, t, num_drafted * num_drafted, num_drafted * t]
            moments = memory.draft_moments or sample
            memory.draft_moments = [m + weight * (x - m) for m, x in zip(moments, sample)]
            memory.draft_seconds_per_token, memory.draft_step_seconds = fit_draft_cost(
                memory.draft_moments, model.draft_seconds_per_token)
            return
        drafting_s = (num_drafted * self.draft_seconds_per_token + self.draft_step_seconds) * growth
        catch_up_s = max(0.0, draft_time_s - drafting_s)
        middle = None if context_len is None else max(0, context_len - behind // 2)
        per_token = catch_up_s / ((behind - 1) * model.draft_growth(middle))
        current = self.catch_up_seconds_per_token
        memory.catch_up_seconds_per_token = current + self.catch_up_smoothing * (per_token - current)

    def _learn_verify(self, num_tokens: int, ratio: float) -> None:
        """Fold a measured / calibrated ratio of a ``num_tokens`` verify pass into its running scale (a plain
        mean over the first ``1 / cost_smoothing`` passes, an exponential average after)."""
        scales, samples = self.memory.verify_scales, self.memory.verify_samples
        while len(scales) < num_tokens:
            scales.append(scales[-1] if scales else 1.0)
            samples.append(0)
        samples[num_tokens - 1] += 1
        weight = max(self.cost_smoothing, 1.0 / samples[num_tokens - 1])
        scales[num_tokens - 1] += weight * (ratio - scales[num_tokens - 1])

    def _note(self, note: str) -> None:
        if note not in self._notes:
            self._notes.append(note)


def fit_draft_cost(moments: Sequence[float], calibrated_per_token: float) -> tuple[float, float]:
    """A drafting step's seconds as ``a + b K`` from running means ``[K, t, K^2, K t]`` of its steps: ``(b, a)``
    (seconds per draft token, fixed seconds per drafting step).

    With K spread over the steps, the least-squares line (both terms >= 0). With one K only (a request's
    first steps), the two cannot be told apart: b is the smaller of the calibrated one-token time and the
    measured time per token, and the rest is the step's fixed cost. A draft model's K = 1 step is its
    catch-up pass over two tokens (the previous draft's last token and the bonus token; about 1.4 one-token
    passes on llama.cpp), which read as a time per token made K look expensive and kept it small.
    """
    mean_k, mean_t, mean_kk, mean_kt = moments
    if mean_k <= 0:
        return calibrated_per_token, 0.0
    variance = mean_kk - mean_k * mean_k
    if variance > 0.1:
        b = (mean_kt - mean_k * mean_t) / variance
        a = mean_t - b * mean_k
        if b > 0 and a >= 0:
            return b, a
    b = min(calibrated_per_token, mean_t / mean_k) if calibrated_per_token > 0 else 0.0
    return b, max(0.0, mean_t - b * mean_k)


#: Weight (pseudo-trials) of AutoK's acceptance prior for a draft *model*. A model of the target's family is
#: expected to agree with it most of the time; with the default weight of 1, the first probe's one rejected
#: token (the opening token of a chat answer is the hardest to guess) put the estimate below break-even, and
#: the engine's memory carried that to every later request, which then decoded plainly.
MODEL_PRIOR_STRENGTH = 4.0


#: The deferred catch-up's smallest horizon (tokens): a short prompt's catch-up (a few ms) is paid at once.
DEFERRED_HORIZON_FLOOR = 16


def k_controller_factory(k_policy: str, max_k: int, cost_model: CostModel | None = None,
                         prior_strength: float = 1.0, **auto_options) -> Callable[[], KController]:
    """A per-request controller factory for one :class:`draftwise.engine.SpeculativeEngine`.

    For ``"auto"`` the factory owns one :class:`AutoKMemory` and hands it to every controller it makes, so
    what one request learns (acceptance, costs) carries to the engine's next request. Make one factory per
    engine.

    Args:
        k_policy: ``"fixed"`` (always ``max_k``) or ``"auto"`` (:class:`AutoK`).
        max_k: K, or the maximum K for ``"auto"``.
        cost_model: required for ``"auto"``.
        prior_strength: weight of the acceptance prior (:data:`MODEL_PRIOR_STRENGTH` for a draft model).
        auto_options: extra keyword arguments for :class:`AutoK`.

    Raises:
        ValueError: unknown policy or a missing cost model.
    """
    if k_policy == "fixed":
        return lambda: FixedK(max_k)
    if k_policy == "auto":
        if cost_model is None:
            raise ValueError("k_policy 'auto' needs a cost model "
                             "(see draftwise.speculation.calibration.calibrate_cost_model)")
        memory = AutoKMemory.fresh(max_k, prior_strength)
        return lambda: AutoK(cost_model, max_k, memory=memory, **auto_options)
    raise ValueError(f"unknown k_policy {k_policy!r}; choose 'fixed' or 'auto'")
