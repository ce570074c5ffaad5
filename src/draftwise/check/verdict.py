"""The one-line answer of ``draftwise check``, with its reason.

Statuses: ``helps`` (best predicted speed-up >= :data:`HELPS_AT_LEAST`), ``marginal`` (between 1 and that),
``does_not_help`` (below 1), ``unknown`` (the probe drafted nothing), and for pairs that never got measured
``incompatible`` (tokenizers), ``does_not_fit`` (memory) or ``not_measured`` (``--no-measure``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from draftwise.check.probe import SpeedupPrediction
from draftwise.speculation.cost_model import break_even_acceptance

__all__ = ["HELPS_AT_LEAST", "Verdict", "break_even_alpha", "speculation_verdict", "static_verdict"]

#: Predicted speed-ups below this are called marginal: within what a noisy machine and the i.i.d.
#: acceptance assumption can blur.
HELPS_AT_LEAST = 1.10
_TRY_NGRAM = "try n-gram (--speculative-config '{\"method\": \"ngram\"}'), which costs almost nothing per draft"


@dataclass(frozen=True)
class Verdict:
    """The answer.

    Attributes:
        status: see the module docstring. ``helps``: True only for ``helps`` (None when not measured).
        text: e.g. ``"helps: ~1.4x at K=3"``. ``reason``: the numbers behind it.
        best_k, predicted_speedup: the best K and its predicted speed-up (None when not measured).
    """

    status: str
    helps: bool | None
    text: str
    reason: str
    best_k: int | None = None
    predicted_speedup: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


#: The per-token acceptance at which K draft tokens per step break even (defined in draftwise.speculation.cost_model).
break_even_alpha = break_even_acceptance


def _fmt_x(speedup: float) -> str:
    return f"~{speedup:.2f}x" if speedup < 2 else f"~{speedup:.1f}x"


def _costs_text(prediction: SpeedupPrediction) -> str:
    return (f"the draft costs c={prediction.cost_ratio:.2f} of a target pass per token and verifying "
            f"{prediction.k + 1} tokens costs {prediction.verify_cost:.2f}x one token")


def _slowdown_reason(alpha: float, predictions: Sequence[SpeedupPrediction]) -> str:
    """Why no K pays: the costs alone (even alpha = 1 loses) or too little acceptance."""
    perfect = max(predictions, key=lambda p: (p.k + 1) / (p.k * p.cost_ratio + p.verify_cost))
    ceiling = (perfect.k + 1) / (perfect.k * perfect.cost_ratio + perfect.verify_cost)
    if ceiling < 1.0:
        return (f"even if every draft token were accepted the best would be {ceiling:.2f}x at K={perfect.k}: "
                f"{_costs_text(perfect)}")
    needed = [(break_even_alpha(p.k, p.cost_ratio, p.verify_cost), p) for p in predictions]
    alpha_needed, at = min(((a, p) for a, p in needed if a is not None), key=lambda item: item[0])
    return (f"the per-token acceptance is only {alpha:.0%}; breaking even needs at least {alpha_needed:.0%} "
            f"(at K={at.k}: {_costs_text(at)})")


def speculation_verdict(alpha: float | None, predictions: Sequence[SpeedupPrediction]) -> Verdict:
    """Judge the measured per-token acceptance ``alpha`` (:attr:`draftwise.check.probe.ProbeResult.token_acceptance`)
    and the per-K predictions (from :func:`draftwise.check.probe.predict_speedups`)."""
    if alpha is None or not predictions:
        return Verdict("unknown", None, "unknown: the probe drafted no tokens",
                       "every probe prompt ended before a draft step; raise --max-tokens or use other prompts")
    best = max(predictions, key=lambda p: p.speedup)
    if best.speedup >= HELPS_AT_LEAST:
        return Verdict("helps", True, f"helps: {_fmt_x(best.speedup)} at K={best.k}",
                       f"per-token acceptance {alpha:.0%}, so {best.tokens_per_step:.2f} tokens per target pass; "
                       f"{_costs_text(best)}", best.k, best.speedup)
    if best.speedup >= 1.0:
        return Verdict("marginal", False,
                       f"marginal: {_fmt_x(best.speedup)} at K={best.k}, within measurement noise; {_TRY_NGRAM}",
                       f"per-token acceptance {alpha:.0%}; {_costs_text(best)}", best.k, best.speedup)
    return Verdict("does_not_help", False,
                   f"does not help here: speculation would slow decoding; {_TRY_NGRAM}",
                   _slowdown_reason(alpha, predictions), best.k, best.speedup)


def static_verdict(status: str, reason: str) -> Verdict:
    """A verdict reached before measuring: ``incompatible``, ``does_not_fit`` or ``not_measured``."""
    texts = {"incompatible": "incompatible: the draft cannot speculate for this target",
             "does_not_fit": "does not fit: target and draft exceed the memory budget",
             "not_measured": "not measured: static checks passed (run without --no-measure for a verdict)"}
    return Verdict(status, None if status == "not_measured" else False, texts[status], reason)
