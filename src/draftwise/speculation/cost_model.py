"""The one definition of acceptance and the one cost model of speculative decoding.

Everything that reports acceptance or predicts a speed-up (the statistics, ``check``, ``bench`` and the
auto-K controller) uses this module, so a number means the same thing everywhere.

Acceptance. A verification pass looks at the draft positions in order and stops at the first rejection,
so there are two different quantities:

- the *draft acceptance rate* ``accepted / drafted`` (vLLM's ``acceptance rate``; what the statistics
  report): it counts the positions after a rejection as drafted, so it falls with K even for a proposer
  whose every token is equally likely to be right;
- the *per-token acceptance probability* ``a``: the probability that a draft token is accepted given that
  all earlier ones were. This is the ``alpha`` of Leviathan et al. 2023 (Eq. 1, ``E[tokens per step] =
  (1 - a^(K+1)) / (1 - a)``). It is estimated by maximum likelihood from the positions the target actually
  judged: each accepted position is a success, each rejection a failure, positions after a rejection are
  not observed and a fully accepted draft is censored, so ``a = accepted / (accepted + rejections)``
  (:func:`token_acceptance`). Position by position, ``accepted_i / (accepted_i + rejected_i)`` is the
  conditional rate of position i (:func:`conditional_acceptance`).

A proposer right 90% of the time at K=8 accepts about 5.1 of 8 draft tokens (rate 0.64, which put into Eq. 1
would predict 2.78 tokens per step); its ``a`` is 0.9, which predicts the 6.1 tokens per step it delivers.

Costs. :class:`CostModel` holds what one step costs in seconds: the target's verify curve (a pass over
``j`` new tokens), the proposer's time per draft token, a draft model's prefill time per token when it has
to catch up on context it has not seen (the prompt, or tokens committed by plain steps), and how the
target's and the draft's pass times grow with the context length. Leviathan et al. 2023, Sec. 3.4 /
Theorem 3.8, with measured costs instead of their linear one: the speed-up of K draft tokens per step over
plain decoding is ``E(a, K) * verify(1) / (K * draft + verify(K + 1))``. A step also pays the engine's own work
(verification, sampling, bookkeeping, the caller's per-step work: :class:`StepOverhead`, measured by the engine),
a plain step as much as a speculative one: ``E(a, K) * (verify(1) + o) / (K * draft + verify(K + 1) + o)``, so
where passes are short (a small model, a GPU) longer steps pay more than the passes alone say.

Batches. When one pass verifies the drafts of several sequences (continuous batching,
:mod:`draftwise.engine.core`), a step's time is the pass over all rows: :class:`PassCostCurve` holds the measured
seconds of a pass over n rows, and :func:`plan_batch_k` picks every sequence's K together to maximise the
batch's expected committed tokens per second, ``sum_i E_i(K_i) / (T(rows + sum_i K_i) + draft(K))``. A draft
row is worth ``prod_{j <= K_i + 1} a_ij`` expected tokens to its own sequence but delays every sequence in the
batch, so at high batch sizes, where T grows with each row, K falls (to 0), and it rises again when the load
drops.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "CostModel",
    "PassCostCurve",
    "StepOverhead",
    "acceptance_rate",
    "batch_step_rate",
    "break_even_acceptance",
    "catch_up_passes",
    "conditional_acceptance",
    "draft_stop_thresholds",
    "expected_tokens",
    "expected_tokens_per_step",
    "mean_accepted_length",
    "plan_batch_k",
    "predicted_speedup",
    "predicted_speedup_of_steps",
    "rejections_from_counts",
    "token_acceptance",
]


# ---------------------------------------------------------------------------------------------- acceptance
def acceptance_rate(num_accepted: int, num_drafted: int) -> float | None:
    """The draft acceptance rate ``accepted / drafted`` (None when nothing was drafted). Not the per-token
    probability of Leviathan's formula: see :func:`token_acceptance`."""
    return num_accepted / num_drafted if num_drafted else None


def mean_accepted_length(num_accepted: int, num_passes: int) -> float:
    """tau: tokens resolved per decode-phase target pass, ``1 + accepted / passes`` (each pass adds the
    target's own token to the accepted drafts). 1.0 for plain decoding and for a request that ran no decode
    pass (its one token came from the prefill)."""
    return 1.0 + num_accepted / num_passes if num_passes else 1.0


def conditional_acceptance(
    accepted_per_position: Sequence[float], rejected_per_position: Sequence[float]
) -> list[float | None]:
    """Per draft position i, ``accepted_i / (accepted_i + rejected_i)``: the probability that position i is
    accepted given positions before it were (None where the target never judged position i)."""
    return [a / (a + r) if a + r > 0 else None for a, r in zip(accepted_per_position, rejected_per_position)]


def token_acceptance(accepted_per_position: Sequence[float], rejected_per_position: Sequence[float]) -> float | None:
    """The per-token acceptance probability ``a`` (maximum likelihood under a constant ``a``; see the module
    docstring): ``sum(accepted) / (sum(accepted) + sum(rejected))``. None when nothing was judged."""
    accepted, rejected = sum(accepted_per_position), sum(rejected_per_position)
    return accepted / (accepted + rejected) if accepted + rejected > 0 else None


def rejections_from_counts(drafted_per_position: Sequence[int], accepted_per_position: Sequence[int]) -> list[int]:
    """Rejections per position rebuilt from drafted and accepted counts alone (records written before the
    statistics counted rejections). Exact when every draft had the same length: the drafts that reached
    position i are those that accepted position i - 1."""
    rejected = []
    for i, (drafted, accepted) in enumerate(zip(drafted_per_position, accepted_per_position)):
        reached = drafted if i == 0 else min(drafted, accepted_per_position[i - 1])
        rejected.append(max(0, reached - accepted))
    return rejected


def expected_tokens(acceptance: Sequence[float]) -> float:
    """Expected tokens one step commits when it drafts ``len(acceptance)`` tokens, the target's own token
    included: ``1 + sum_j prod_{i <= j} acceptance[i]``, where ``acceptance[i]`` is position i's conditional
    acceptance probability. A constant ``a`` gives Leviathan et al. 2023, Eq. 1."""
    total, reach = 1.0, 1.0
    for rate in acceptance:
        reach *= rate
        total += reach
    return total


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """``(1 - a^(k+1)) / (1 - a)`` (``k + 1`` at a = 1): Leviathan et al. 2023, Eq. 1.

    Raises:
        ValueError: ``alpha`` outside [0, 1] or ``k`` < 0.
    """
    if not (0.0 <= alpha <= 1.0) or k < 0:
        raise ValueError(f"need alpha in [0, 1] and k >= 0, got {alpha}, {k}")
    return float(k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float) -> float:
    """Expected speed-up over plain decoding (Leviathan et al. 2023, Theorem 3.8 with a measured verify cost).

    Args:
        alpha: per-token acceptance probability ``a`` in [0, 1] (:func:`token_acceptance`, not
            accepted / drafted).
        k: draft tokens per step (K).
        cost_ratio: c, proposer time per draft token / target time of a one-token pass.
        verify_cost: target time of the (K + 1)-token verification pass / one-token pass.
    """
    return expected_tokens_per_step(alpha, k) / (k * cost_ratio + verify_cost)


def predicted_speedup_of_steps(alpha: float, drafted: Sequence[int], cost_ratio: float,
                               verify_cost: Callable[[int], float], catch_up: float = 0.0) -> float:
    """:func:`predicted_speedup` over the steps a run actually took: step s drafted ``drafted[s]`` tokens (a
    confidence stop or the end of the answer cuts chains short of K; 0 is a plain step), is worth
    ``(1 - a^(d+1)) / (1 - a)`` tokens and costs ``d c + v_(d+1)`` one-token passes; the speed-up is the sum of
    the first over the sum of the second plus ``catch_up``. With every step K deep and no catch-up it is
    :func:`predicted_speedup`.

    Args:
        alpha: per-token acceptance probability in [0, 1]; drafted: tokens drafted per step (non-empty);
        cost_ratio: c; verify_cost: ``n -> v_n`` (a pass over n tokens / a one-token pass).
        catch_up: a draft model's prefill of the prompt before its first draft, in one-token target passes
            (prompt tokens x the draft's prefill seconds per token / the target's one-token seconds; see
            :func:`catch_up_passes`); 0 for proposers without one.

    Raises:
        ValueError: no steps, ``alpha`` outside [0, 1], or a negative ``catch_up``.
    """
    if not drafted:
        raise ValueError("need at least one step")
    if catch_up < 0:
        raise ValueError(f"catch_up must be >= 0 one-token passes, got {catch_up}")
    tokens = sum(expected_tokens_per_step(alpha, d) for d in drafted)
    return tokens / (sum(d * cost_ratio + verify_cost(d + 1) for d in drafted) + catch_up)


def catch_up_passes(tokens: int, draft_prefill_seconds_per_token: float, target_one_token_seconds: float) -> float:
    """A draft model's catch-up of ``tokens`` context tokens in one-token target passes (the unit of
    :func:`predicted_speedup_of_steps`): ``tokens x prefill seconds per token / one target token's seconds``.

    Raises:
        ValueError: negative ``tokens`` or prefill time, or a one-token time <= 0.
    """
    if tokens < 0 or draft_prefill_seconds_per_token < 0 or target_one_token_seconds <= 0:
        raise ValueError("catch_up_passes needs tokens >= 0, a prefill time >= 0 and a one-token time > 0, got "
                         f"{tokens}, {draft_prefill_seconds_per_token}, {target_one_token_seconds}")
    return tokens * draft_prefill_seconds_per_token / target_one_token_seconds


def break_even_acceptance(k: int, cost_ratio: float, verify_cost: float) -> float | None:
    """The per-token acceptance ``a`` at which K draft tokens per step match plain decoding.

    Solves ``(1 - a^(K+1)) / (1 - a) = K * c + v_(K+1)`` by bisection (the left side grows from 1 at a = 0 to
    K + 1 at a = 1). Returns 0.0 when even a = 0 breaks even, None when no a in [0, 1] does.
    """
    step_cost = k * cost_ratio + verify_cost
    if step_cost <= 1.0:
        return 0.0
    if step_cost > k + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_step(mid, k) < step_cost else (low, mid)
    return high


# ---------------------------------------------------------------------------------------------- costs
@dataclass(frozen=True)
class CostModel:
    """What one speculative step costs, in seconds.

    Attributes:
        verify_seconds: ``verify_seconds[j - 1]`` is the target's forward time over j new tokens
            (j = 1..len) at ``context_len`` tokens of context; a step with K draft tokens verifies K + 1
            tokens. Beyond the measured range the curve is extended linearly from its last two points.
        draft_seconds_per_token: the proposer's time per drafted token (a draft model: about one 1-token
            forward of the draft; n-gram lookup: about 0).
        source: where the numbers come from (for reports), e.g. ``"measured"`` or ``"scripted"``.
        draft_prefill_seconds_per_token: a draft model's time per token to catch up on context it has not
            seen (the prompt, tokens committed by plain steps); 0 for proposers with nothing to catch up.
        context_len: tokens of context under the measured passes (0: costs do not depend on context).
        target_context_growth, draft_context_growth: relative growth of the target's and the draft's pass
            times per token of context beyond ``context_len`` (e.g. 2e-4: 20% slower 1,000 tokens later).
        draft_step_seconds: a drafting step's fixed cost beyond K x ``draft_seconds_per_token`` (a draft
            model's first pass feeds the previous step's last draft token and the bonus token, which on
            llama.cpp costs about 1.4 one-token passes); 0 by default, learned online by
            :class:`draftwise.speculation.controller.AutoK`.
        step_overhead_seconds: the engine's own time per step beyond the model passes (verification, sampling,
            bookkeeping, the caller's work between steps; :class:`StepOverhead`), paid by a plain step too, so
            it favours fewer, longer steps; 0 by default, measured by the engine and handed to
            :class:`draftwise.speculation.controller.AutoK`.

    Raises:
        ValueError: empty or non-positive verify times, or negative costs.
    """

    verify_seconds: tuple[float, ...]
    draft_seconds_per_token: float = 0.0
    source: str = "scripted"
    draft_prefill_seconds_per_token: float = 0.0
    context_len: int = 0
    target_context_growth: float = 0.0
    draft_context_growth: float = 0.0
    draft_step_seconds: float = 0.0
    step_overhead_seconds: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "verify_seconds", tuple(float(v) for v in self.verify_seconds))
        if not self.verify_seconds or min(self.verify_seconds) <= 0:
            raise ValueError(f"verify_seconds must be non-empty and positive, got {self.verify_seconds}")
        for name in ("draft_seconds_per_token", "draft_prefill_seconds_per_token", "context_len",
                     "target_context_growth", "draft_context_growth", "draft_step_seconds", "step_overhead_seconds"):
            if not (getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def max_k(self) -> int:
        """The largest K whose verify pass (K + 1 tokens) was measured."""
        return len(self.verify_seconds) - 1

    @property
    def cost_ratio(self) -> float:
        """c: draft time per token / target one-token pass time (at the measured context)."""
        return self.draft_seconds_per_token / self.verify_seconds[0]

    def _growth(self, rate: float, context_len: int | None) -> float:
        if context_len is None or not self.context_len:
            return 1.0
        return 1.0 + rate * max(0, context_len - self.context_len)

    def target_growth(self, context_len: int | None) -> float:
        """Target pass time at ``context_len`` tokens of context / at the measured context (>= 1)."""
        return self._growth(self.target_context_growth, context_len)

    def draft_growth(self, context_len: int | None) -> float:
        """Draft pass time at ``context_len`` tokens of context / at the measured context (>= 1)."""
        return self._growth(self.draft_context_growth, context_len)

    def verify_cost(self, num_tokens: int, context_len: int | None = None) -> float:
        """Seconds of a target forward over ``num_tokens`` (>= 1) new tokens on ``context_len`` tokens of
        context (None: the measured context).

        Raises:
            ValueError: ``num_tokens`` < 1.
        """
        if num_tokens < 1:
            raise ValueError(f"a verify pass has at least 1 token, got {num_tokens}")
        return self.verify_curve.seconds(num_tokens) * self.target_growth(context_len)

    @property
    def verify_curve(self) -> PassCostCurve:
        """The verify times as the one pass-cost curve (:class:`PassCostCurve`, rows = tokens of one sequence):
        the batched engine's curve type, read the same way (non-decreasing, extended from the last two
        points)."""
        curve = self.__dict__.get("_verify_curve")
        if curve is None:
            curve = PassCostCurve(smoothing=1.0, points={j + 1: s for j, s in enumerate(self.verify_seconds)})
            object.__setattr__(self, "_verify_curve", curve)
        return curve

    def relative_verify_cost(self, num_tokens: int) -> float:
        """v_j: a j-token pass / a one-token pass, at the measured context."""
        return self.verify_cost(num_tokens) / self.verify_cost(1)

    def draft_cost(self, k: int, context_len: int | None = None) -> float:
        """Seconds the proposer takes to draft ``k`` tokens at ``context_len`` tokens of context: ``k`` x the
        time per token, plus the step's fixed cost when ``k`` > 0."""
        if k <= 0:
            return 0.0
        return (k * self.draft_seconds_per_token + self.draft_step_seconds) * self.draft_growth(context_len)

    def step_cost(self, k: int, context_len: int | None = None) -> float:
        """Seconds of one step with K draft tokens (K = 0: a plain step): ``draft_cost(K) + verify_cost(K + 1)``
        plus the engine's :attr:`step_overhead_seconds`."""
        return self.draft_cost(k, context_len) + self.verify_cost(k + 1, context_len) + self.step_overhead_seconds

    def catch_up_cost(self, num_tokens: int, context_len: int | None = None) -> float:
        """Seconds a draft model needs to prefill ``num_tokens`` unseen tokens ending at ``context_len``."""
        if num_tokens <= 0:
            return 0.0
        middle = None if context_len is None else max(0, context_len - num_tokens // 2)
        return num_tokens * self.draft_prefill_seconds_per_token * self.draft_growth(middle)

    def speedup(self, acceptance: float | Sequence[float], k: int, context_len: int | None = None) -> float:
        """Predicted speed-up of K draft tokens per step over plain decoding, steady state (catch-up not
        included). ``acceptance``: a per-token probability ``a`` or per-position conditional rates."""
        rates = [acceptance] * k if isinstance(acceptance, (int, float)) else list(acceptance)[:k]
        if len(rates) < k:
            raise ValueError(f"need {k} acceptance rates, got {len(rates)}")
        return expected_tokens(rates) * self.step_cost(0, context_len) / self.step_cost(k, context_len)

    def best_k(self, acceptance: float | Sequence[float], max_k: int, context_len: int | None = None) -> int:
        """argmax over K in 0..max_k of :meth:`speedup` (the smallest K on ties; 0: plain decoding)."""
        best, best_speedup = 0, 1.0
        for k in range(1, max_k + 1):
            speedup = self.speedup(acceptance, k, context_len)
            if speedup > best_speedup * (1 + 1e-9):
                best, best_speedup = k, speedup
        return best

    def break_even_acceptance(self, max_k: int, context_len: int | None = None) -> float:
        """Smallest constant ``a`` at which some K in 1..max_k beats plain decoding (1.0 if none does)."""
        if self.best_k(1.0, max_k, context_len) == 0:
            return 1.0
        low, high = 0.0, 1.0
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (low, mid) if self.best_k(mid, max_k, context_len) > 0 else (mid, high)
        return high

    @classmethod
    def from_forward_costs(cls, costs, draft_seconds_per_token: float, source: str = "measured", **extra) -> CostModel:
        """Build from a measured :class:`draftwise.speculation.calibration.ForwardCosts` (``seconds`` by token count, at
        ``context_len``); its token counts must be 1..n without gaps. ``extra``: further fields.

        Raises:
            ValueError: a gap in the token counts.
        """
        n = max(costs.seconds)
        missing = [j for j in range(1, n + 1) if j not in costs.seconds]
        if missing:
            raise ValueError(f"forward costs miss token counts {missing}")
        return cls(tuple(costs.seconds[j] for j in range(1, n + 1)), draft_seconds_per_token, source,
                    **{"context_len": costs.context_len, **extra})

    def to_dict(self) -> dict:
        """JSON-ready fields (inverse: :meth:`from_dict`)."""
        return {"verify_seconds": list(self.verify_seconds), "draft_seconds_per_token": self.draft_seconds_per_token,
                "source": self.source, "draft_prefill_seconds_per_token": self.draft_prefill_seconds_per_token,
                "context_len": self.context_len, "target_context_growth": self.target_context_growth,
                "draft_context_growth": self.draft_context_growth, "draft_step_seconds": self.draft_step_seconds,
                "step_overhead_seconds": self.step_overhead_seconds}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """Inverse of :meth:`to_dict`; fields missing from older files take their defaults.

        Raises:
            KeyError, ValueError: missing verify times or invalid values.
        """
        return cls(tuple(data["verify_seconds"]), float(data.get("draft_seconds_per_token", 0.0)),
                   str(data.get("source", "")), float(data.get("draft_prefill_seconds_per_token", 0.0)),
                   int(data.get("context_len", 0)), float(data.get("target_context_growth", 0.0)),
                   float(data.get("draft_context_growth", 0.0)), float(data.get("draft_step_seconds", 0.0)),
                   float(data.get("step_overhead_seconds", 0.0)))


# ---------------------------------------------------------------------------------------------- draft stop
#: The worth of a committed token in one-token target passes that :func:`draft_stop_thresholds` assumes: a further
#: draft token pays when its path probability is at least this many times its cost. In the marginal-rate argument
#: below it stands for the speculative speed-up; 1.5 was fitted by replaying recorded draft chains (26 Spec-Bench
#: prompts, Qwen2.5-Coder 0.5B draft / 1.5B target, K=8; ``scripts/confidence_replay.py --stop-values``): at draft
#: cost ratios c of 0.16-0.55 and verify curves v_9 of 1.31-1.90 it came within 1% of the best constant threshold
#: of each setting, where each constant lost up to 10% elsewhere (docs/draft_trees.md).
DRAFT_STOP_VALUE = 1.5


def draft_stop_thresholds(costs: CostModel, max_k: int, value: float = DRAFT_STOP_VALUE) -> tuple[float, ...]:
    """Per-depth path-probability thresholds for a draft chain, from the measured costs.

    Extending a chain of j proposed tokens by one more costs a draft pass and one more verify row:
    ``c + v_(j+2) - v_(j+1)`` one-token target passes (c = :attr:`CostModel.cost_ratio`, v = the relative verify
    curve; the step-cost model of Leviathan et al. 2023, Sec. 3.4). The token is worth about the probability that
    the whole path is right, which the draft's path probability estimates (EAGLE-2's reading of draft confidence,
    Li et al. 2024). A step maximises tokens per second when it grows while a token's expected worth times the
    speed-up exceeds its cost, so the chain grows past depth j only while its path probability is at least
    ``value * (c + v_(j+2) - v_(j+1))``. A cheap draft and a flat verify curve draft deep; an expensive draft, or
    verify rows that cost more where the target's passes turn compute-bound, stop early.

    Args:
        costs: the calibrated costs; its verify curve is read as far as ``max_k + 1`` tokens (extended past the
            measured points like every reader of it).
        max_k: the chain's longest K (>= 1).
        value: :data:`DRAFT_STOP_VALUE`.

    Returns:
        ``thresholds[j - 1]`` for j = 1..max_k - 1 proposed tokens (empty for max_k 1); values may exceed 1 (the
        chain never grows past that depth).

    Raises:
        ValueError: ``max_k`` < 1 or ``value`` <= 0.
    """
    if max_k < 1 or not value > 0:
        raise ValueError(f"need max_k >= 1 and value > 0, got {max_k}, {value}")
    c = costs.cost_ratio
    v = [costs.relative_verify_cost(n) for n in range(1, max_k + 2)]  # v[n - 1] = v_n
    return tuple(value * (c + max(0.0, v[j + 1] - v[j])) for j in range(1, max_k))


# ---------------------------------------------------------------------------------------------- batches
class PassCostCurve:
    """Seconds of one forward pass as a function of its row count (all sequences of a batch together), plus a
    fixed cost per sequence in the pass (``per_sequence``: a batched pass runs attention once per sequence and
    layer, whatever its rows; 0 when not measured).

    Measured points are kept per row count as running averages (the first measurement of a count is taken
    as is, later ones with weight ``smoothing``); a count between measured ones is interpolated linearly, a
    count beyond the largest one is extended from the last two points (never with a negative slope), and
    one below the smallest takes the smallest's time. The curve is read non-decreasing (a running maximum over
    the counts), so a noisy measurement never makes more rows look cheaper.

    Args:
        smoothing: weight of a new measurement in a count's running average, in (0, 1].
        points: initial ``{rows: seconds}`` (e.g. a short calibration or a scripted curve), per-row part only.
        per_sequence: seconds each sequence in a pass adds whatever its rows (>= 0).

    Raises:
        ValueError: ``smoothing`` outside (0, 1], a row count < 1, non-positive seconds or a negative
            ``per_sequence``.
    """

    def __init__(self, smoothing: float = 0.2, points: dict[int, float] | None = None,
                 per_sequence: float = 0.0) -> None:
        if not (0.0 < smoothing <= 1.0):
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if not per_sequence >= 0:
            raise ValueError(f"per_sequence must be >= 0, got {per_sequence}")
        self.smoothing = smoothing
        self.per_sequence = per_sequence
        self._seconds: dict[int, float] = {}
        self._samples: dict[int, int] = {}
        self._sorted: list[tuple[int, float]] | None = None
        for rows, seconds in (points or {}).items():
            self.observe(rows, seconds)

    def __len__(self) -> int:
        return len(self._seconds)

    @property
    def points(self) -> dict[int, float]:
        """The averaged measurements ``{rows: seconds}``."""
        return dict(self._seconds)

    def observe(self, rows: int, seconds: float, sequences: int = 0) -> None:
        """Fold one measured pass (``rows`` >= 1 rows of ``sequences`` sequences, ``seconds`` > 0) into the
        curve: the per-row part is the time less ``per_sequence * sequences`` (at least a tenth of the time).

        Raises:
            ValueError: out-of-range arguments.
        """
        if rows < 1 or not seconds > 0 or sequences < 0:
            raise ValueError(f"need rows >= 1, seconds > 0 and sequences >= 0, got {rows}, {seconds}, {sequences}")
        seconds = max(0.1 * seconds, seconds - self.per_sequence * sequences)
        samples = self._samples.get(rows, 0) + 1
        self._samples[rows] = samples
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else old + self.smoothing * (seconds - old)
        self._sorted = None

    def seconds(self, rows: int) -> float:
        """Predicted seconds of a pass over ``rows`` rows (0 for 0 rows).

        Raises:
            ValueError: no measurement yet, or ``rows`` < 0.
        """
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        if not self._seconds:
            raise ValueError("the pass cost curve has no measurement yet")
        if rows == 0:
            return 0.0
        curve = self._curve()
        if rows <= curve[0][0]:
            return curve[0][1]
        for (n0, s0), (n1, s1) in zip(curve, curve[1:]):
            if rows <= n1:
                return s0 + (s1 - s0) * (rows - n0) / (n1 - n0)
        if len(curve) == 1:
            return curve[0][1] * rows / curve[0][0]  # one point: proportional beyond it
        (n0, s0), (n1, s1) = curve[-2], curve[-1]
        return s1 + max(0.0, (s1 - s0) / (n1 - n0)) * (rows - n1)

    def pass_seconds(self, rows: int, sequences: int) -> float:
        """Predicted seconds of a pass over ``rows`` rows of ``sequences`` sequences."""
        return self.seconds(rows) + self.per_sequence * sequences

    def _curve(self) -> list[tuple[int, float]]:
        if self._sorted is None:
            top, points = 0.0, []
            for rows in sorted(self._seconds):
                top = max(top, self._seconds[rows])
                points.append((rows, top))
            self._sorted = points
        return self._sorted


class StepOverhead:
    """The engine's own seconds per step beyond its model passes: verification, sampling, bookkeeping, and what
    the caller does between two steps while requests run (a server streams each step's text). A plain step pays
    it as much as a speculative one, so it is worth pricing where passes are short (a small model, a GPU): there
    it favours fewer, longer steps, which the pass costs alone never show.

    The estimate is the median of the last ``window`` measured steps (a step's wall time less its target pass
    and drafting, plus the gap since the previous step while the engine was busy), so a caller pausing once
    does not move it (a caller slow at every step is part of every step's cost, and is priced). 0 before any
    measurement.

    Args:
        window: steps the median is taken over (>= 1).

    Raises:
        ValueError: ``window`` < 1.
    """

    def __init__(self, window: int = 32) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._samples: deque[float] = deque(maxlen=window)
        self._median: float | None = 0.0

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, seconds: float) -> None:
        """Fold one step's overhead (seconds; a negative value from timer noise counts as 0)."""
        self._samples.append(max(0.0, float(seconds)))
        self._median = None

    @property
    def seconds(self) -> float:
        """The current estimate (seconds per step)."""
        if self._median is None:
            self._median = statistics.median(self._samples)
        return self._median


def batch_step_rate(expected: Sequence[float], pass_seconds: float, draft_seconds: float = 0.0) -> float:
    """Expected committed tokens per second of one batched step: ``sum(expected) / (pass + draft)``.

    Args:
        expected: per decoding sequence, the tokens its verification is expected to commit
            (:func:`expected_tokens` of its conditional acceptance rates at its K; 1 for K = 0).
        pass_seconds: the target pass over every row of the step (seconds).
        draft_seconds: the drafting time of the step (seconds).
    """
    total = pass_seconds + draft_seconds
    return sum(expected) / total if total > 0 else 0.0


def plan_batch_k(
    acceptance: Sequence[Sequence[float]],
    max_k: Sequence[int],
    base_rows: int,
    pass_seconds,
    draft_pass_seconds=None,
    max_draft_rows: int | None = None,
) -> list[int]:
    """Choose every decoding sequence's K for one batched pass (marginal allocation).

    Each sequence i starts at K_i = 0 (its one row, the last committed token, is in ``base_rows``). One more
    draft token for sequence i adds ``prod_{j <= K_i + 1} a_ij`` expected tokens (the probability that every
    draft token up to it is accepted; Leviathan et al. 2023, Eq. 1, position by position) and one row to the
    pass. Draft tokens are added in order of that gain, largest first (ties: the lower sequence index), and
    the plan kept is the prefix of those additions with the highest :func:`batch_step_rate` (so a bump in a
    measured curve does not stop the search early). K = 0 for all is kept unless some plan beats it.

    Args:
        acceptance: per sequence, conditional acceptance rates of draft positions 1..max_k[i] (in [0, 1]).
        max_k: per sequence, the most draft tokens it may get (>= 0; e.g. the tokens its proposer offered).
        base_rows: rows of the pass without any draft token (one per decoding sequence, plus prefill rows).
        pass_seconds: ``rows -> seconds`` of a target pass (e.g. :meth:`PassCostCurve.seconds`).
        draft_pass_seconds: ``rows -> seconds`` of one draft-model pass, or None when drafting costs nothing
            worth counting (n-gram or suffix lookup). A draft model runs one pass per draft depth, over the
            sequences drafting that deep: ``draft(K) = sum_d draft_pass_seconds(#{i: K_i > d})``.
        max_draft_rows: at most this many draft tokens over the whole batch (None: no limit).

    Returns:
        ``[K_i]``, one per sequence.

    Raises:
        ValueError: mismatched lengths, a negative max_k, or fewer rates than max_k.
    """
    if len(acceptance) != len(max_k):
        raise ValueError(f"{len(acceptance)} acceptance lists for {len(max_k)} sequences")
    for rates, cap in zip(acceptance, max_k):
        if cap < 0 or len(rates) < cap:
            raise ValueError(f"need 0 <= max_k <= len(rates), got {cap} and {len(rates)} rates")
    n = len(max_k)
    ks = [0] * n
    reach = [1.0] * n  # probability that the next draft token of i is reached and accepted: prod a_ij so far
    depth_counts: list[int] = []  # sequences drafting at least d + 1 tokens, per depth d

    def draft_seconds() -> float:
        if draft_pass_seconds is None:
            return 0.0
        return sum(draft_pass_seconds(count) for count in depth_counts if count)

    expected = float(n)
    rows = base_rows
    best_rate = batch_step_rate([expected], pass_seconds(rows), draft_seconds())
    best_plan = list(ks)
    budget = sum(max_k) if max_draft_rows is None else min(sum(max_k), max(0, max_draft_rows))
    for _ in range(budget):
        candidates = [(reach[i] * acceptance[i][ks[i]], -i) for i in range(n) if ks[i] < max_k[i]]
        if not candidates:
            break
        gain, negative_index = max(candidates)
        i = -negative_index
        if gain <= 0:
            break
        reach[i] *= acceptance[i][ks[i]]
        if len(depth_counts) <= ks[i]:
            depth_counts.append(0)
        depth_counts[ks[i]] += 1
        ks[i] += 1
        expected += gain
        rows += 1
        rate = batch_step_rate([expected], pass_seconds(rows), draft_seconds())
        if rate > best_rate * (1 + 1e-9):
            best_rate, best_plan = rate, list(ks)
    return best_plan
