"""The measured half of ``draftwise check``: greedy acceptance on a few prompts, forward-pass costs on this
machine, and the speed-up they predict for each K (Leviathan et al. 2023, Sec. 3.4).

- acceptance probe: a :class:`~draftwise.engine.SpeculativeEngine` with a
  :class:`~draftwise.proposers.draft_model.DraftModelProposer` decodes a few prompts greedily at a fixed K;
  the per-token acceptance ``a`` over all of them (:func:`draftwise.speculation.cost_model.token_acceptance`: accepted
  / (accepted + rejections), not accepted / drafted, which falls with K). Under the usual i.i.d. assumption
  one ``a`` serves every K.
- costs: :func:`~draftwise.speculation.calibration.measure_forward_costs` for the target's verify curve
  ``v_k`` (k = 1..max_k + 1) and the draft's one-token time, whose ratio to the target's is ``c``.
- prediction: :meth:`draftwise.speculation.cost_model.CostModel.speedup` for K = 1..max_k.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from draftwise.benchmark import BenchPrompt, encode_turn
from draftwise.speculation import cost_model
from draftwise.speculation.calibration import ForwardCosts, measure_forward_costs
from draftwise.speculation.cost_model import CostModel
from draftwise.config import SamplingParams
from draftwise.builder import assemble_engine
from draftwise.models.loading import LoadedModel
from draftwise.proposers.draft_model import DraftModelProposer

__all__ = [
    "DEFAULT_PROBE_CATEGORIES",
    "CostMeasurement",
    "ProbePromptResult",
    "ProbeResult",
    "SpeedupPrediction",
    "measure_costs",
    "predict_speedups",
    "run_acceptance_probe",
    "select_probe_prompts",
]

logger = logging.getLogger(__name__)

#: Spec-Bench categories probed first: short prompts of different kinds (the long summarization and RAG
#: prompts would make the probe slow on a CPU).
DEFAULT_PROBE_CATEGORIES = ("coding", "math_reasoning", "writing", "qa", "translation")
#: Tokens in the cache under the timed passes (capped by the context length).
COST_CONTEXT_TOKENS = 200


def select_probe_prompts(
    prompts: Sequence[BenchPrompt], count: int, preferred: Sequence[str] = DEFAULT_PROBE_CATEGORIES
) -> list[BenchPrompt]:
    """Up to ``count`` prompts taken round-robin across categories, ``preferred`` categories first.

    Raises:
        ValueError: ``count`` below 1.
    """
    if count < 1:
        raise ValueError(f"the probe needs at least one prompt, got {count}")
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    order = [c for c in preferred if c in by_category] + [c for c in by_category if c not in preferred]
    chosen: list[BenchPrompt] = []
    for rank in range(max((len(v) for v in by_category.values()), default=0)):
        for category in order:
            if rank < len(by_category[category]) and len(chosen) < count:
                chosen.append(by_category[category][rank])
    return chosen


@dataclass(frozen=True)
class ProbePromptResult:
    """One probe prompt: token counts and the time spent decoding (seconds, prefill excluded)."""

    prompt_id: str
    category: str
    prompt_tokens: int
    generated_tokens: int
    draft_tokens: int
    accepted_tokens: int
    target_passes: int
    step_tokens: int
    decode_time_s: float
    accepted_per_position: tuple[int, ...] = ()
    rejected_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted on this prompt (None when nothing was drafted)."""
        return cost_model.acceptance_rate(self.accepted_tokens, self.draft_tokens)


@dataclass
class ProbeResult:
    """The acceptance probe over all prompts, at a fixed K and greedy decoding.

    Attributes:
        k: draft tokens per step. ``max_tokens``: tokens generated per prompt at most.
        prompts: per-prompt results. ``skipped``: ids of prompts too long for the context.
    """

    k: int
    max_tokens: int
    prompts: list[ProbePromptResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def draft_tokens(self) -> int:
        return sum(p.draft_tokens for p in self.prompts)

    @property
    def accepted_tokens(self) -> int:
        return sum(p.accepted_tokens for p in self.prompts)

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted over every prompt (None when nothing was drafted)."""
        return cost_model.acceptance_rate(self.accepted_tokens, self.draft_tokens)

    @property
    def token_acceptance(self) -> float | None:
        """The per-token acceptance ``a`` over every prompt, the alpha of Leviathan's formula (None when the
        target judged no draft token)."""
        accepted = [n for p in self.prompts for n in p.accepted_per_position]
        rejected = [n for p in self.prompts for n in p.rejected_per_position]
        return cost_model.token_acceptance(accepted, rejected)

    @property
    def mean_accepted_length(self) -> float | None:
        """tau = 1 + accepted / verification passes, over every prompt (None without prompts)."""
        passes = sum(p.target_passes for p in self.prompts)
        return cost_model.mean_accepted_length(self.accepted_tokens, passes) if self.prompts else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Speculative decode rate (prefill excluded), tokens per second."""
        seconds = sum(p.decode_time_s for p in self.prompts)
        return sum(p.step_tokens for p in self.prompts) / seconds if seconds > 0 else None

    def to_dict(self) -> dict:
        return {"k": self.k, "max_tokens": self.max_tokens, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "token_acceptance": self.token_acceptance,
                "mean_accepted_length": self.mean_accepted_length,
                "decode_tokens_per_s": self.decode_tokens_per_s, "skipped": list(self.skipped),
                "prompts": [{**asdict(p), "acceptance_rate": p.acceptance_rate} for p in self.prompts]}


def run_acceptance_probe(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: Sequence[BenchPrompt],
    *,
    k: int = 4,
    max_tokens: int = 32,
    chat: bool = True,
) -> ProbeResult:
    """Decode each prompt greedily with the draft proposing ``k`` tokens per step; count what is accepted.

    Prompts that leave no room for ``max_tokens`` new tokens in the target's context are skipped.

    Raises:
        ValueError: ``k`` or ``max_tokens`` below 1, or target and draft sharing one backend.
    """
    if k < 1 or max_tokens < 1:
        raise ValueError(f"probe K and max_tokens must be >= 1, got {k} and {max_tokens}")
    if target.backend is draft.backend:
        raise ValueError("target and draft share one backend (one KV cache); load the model twice to probe it "
                         "as its own draft")
    # full K-deep chains (no confidence stop): the probe measures acceptance at every position up to K, which the
    # prediction from it reads
    proposer = DraftModelProposer(draft.backend, target.backend.vocab_size, confidence_threshold=0.0)
    engine = assemble_engine(target, proposer, k)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    result = ProbeResult(k=k, max_tokens=max_tokens)
    for prompt in prompts:
        ids = encode_turn(target, prompt, 0, (), chat)  # the first turn, with the chat template when asked
        if len(ids) + max_tokens > target.backend.max_context:
            logger.warning("probe prompt %s (%d tokens) does not fit the context; skipped", prompt.id, len(ids))
            result.skipped.append(prompt.id)
            continue
        stats = engine.generate(ids, params).stats
        result.prompts.append(ProbePromptResult(
            prompt_id=prompt.id, category=prompt.category, prompt_tokens=len(ids),
            generated_tokens=stats.num_generated_tokens, draft_tokens=stats.num_draft_tokens,
            accepted_tokens=stats.num_accepted_tokens, target_passes=stats.num_target_passes,
            step_tokens=stats.num_step_tokens,
            decode_time_s=stats.total_time_s - stats.prefill_time_s,
            accepted_per_position=tuple(stats.accepted_per_position),
            rejected_per_position=tuple(stats.rejected_per_position),
        ))
        logger.info("probe %s (%s): %d/%d draft tokens accepted", prompt.id, prompt.category,
                    stats.num_accepted_tokens, stats.num_draft_tokens)
    return result


@dataclass(frozen=True)
class CostMeasurement:
    """Forward-pass costs on this machine.

    Attributes:
        target: the target's median forward times over k = 1..max_k + 1 new tokens.
        draft_1_token_s: the draft's median one-token forward time (seconds).
    """

    target: ForwardCosts
    draft_1_token_s: float

    @property
    def cost_ratio(self) -> float:
        """c = draft one-token time / target one-token time."""
        return self.draft_1_token_s / self.target.seconds[1]

    def cost_model(self) -> CostModel:
        """The measurement as a :class:`~draftwise.speculation.cost_model.CostModel` (seconds at the timed context). Its
        verify curve reads non-decreasing (:class:`~draftwise.speculation.cost_model.PassCostCurve`, the one rule for a
        noisy pass time), so a k-token pass timed faster than a shorter one counts as the shorter one."""
        return CostModel.from_forward_costs(self.target, self.draft_1_token_s)

    def warnings(self) -> list[str]:
        """Signs of a noisy measurement (a busy machine): k-token passes timed faster than one token."""
        low = [k for k in sorted(self.target.seconds) if self.target.relative(k) < 1.0]
        if not low:
            return []
        shown = ", ".join(f"v{k}={self.target.relative(k):.2f}" for k in low)
        return [f"{shown} below 1: a multi-token pass was timed faster than one token, so the timings are noisy "
                "(is the machine busy?); predictions read the curve non-decreasing there; rerun on an idle machine"]

    def to_dict(self) -> dict:
        return {"target": self.target.to_dict(), "draft_1_token_s": self.draft_1_token_s,
                "cost_ratio": self.cost_ratio, "warnings": self.warnings()}


def measure_costs(target: LoadedModel, draft: LoadedModel, max_k: int, *, repeats: int = 5) -> CostMeasurement:
    """Time the target over 1..max_k + 1 new tokens and the draft over one, on a cache of up to
    :data:`COST_CONTEXT_TOKENS` tokens (both caches are reset afterwards).

    Raises:
        ValueError: ``max_k`` below 1, or a context too short to time ``max_k + 1`` tokens.
    """
    if max_k < 1:
        raise ValueError(f"max_k must be >= 1, got {max_k}")
    room = min(target.backend.max_context, draft.backend.max_context) - (max_k + 1)
    if room < 1:
        raise ValueError(f"a context of {target.backend.max_context} tokens is too short to time K={max_k}")
    context_len = min(COST_CONTEXT_TOKENS, room)
    target_costs = measure_forward_costs(target.backend, range(1, max_k + 2), context_len=context_len,
                                         repeats=repeats)
    draft_costs = measure_forward_costs(draft.backend, [1], context_len=context_len, repeats=repeats)
    return CostMeasurement(target=target_costs, draft_1_token_s=draft_costs.seconds[1])


@dataclass(frozen=True)
class SpeedupPrediction:
    """The predicted speed-up of K draft tokens per step over plain decoding.

    Attributes:
        k: draft tokens per step. ``cost_ratio``: c. ``verify_cost``: v_(K+1), the (K+1)-token pass relative
        to a one-token pass. ``tokens_per_step``: expected tokens committed per target pass.
        ``speedup``: tokens_per_step / (K * c + v_(K+1)).
    """

    k: int
    cost_ratio: float
    verify_cost: float
    tokens_per_step: float
    speedup: float


def predict_speedups(alpha: float, costs: CostMeasurement, max_k: int) -> list[SpeedupPrediction]:
    """Predicted speed-up for K = 1..max_k (only the K whose verify pass was timed, without gaps), with
    the measurement's cost model (its non-decreasing verify curve) for v_(K+1).

    Args:
        alpha: the per-token acceptance ``a`` (:attr:`ProbeResult.token_acceptance`), not accepted / drafted.
    """
    model = costs.cost_model()
    predictions = []
    for k in range(1, min(max_k, model.max_k) + 1):
        predictions.append(SpeedupPrediction(
            k=k, cost_ratio=model.cost_ratio, verify_cost=model.relative_verify_cost(k + 1),
            tokens_per_step=cost_model.expected_tokens_per_step(alpha, k), speedup=model.speedup(alpha, k)))
    return predictions
