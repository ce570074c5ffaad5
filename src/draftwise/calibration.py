"""Measuring what a forward pass costs on this machine.

The speed-up of speculative decoding depends on two measured quantities (Leviathan et al. 2023, Sec. 3.4):
- the verify-cost curve ``v_k``: target forward time over k new tokens divided by one token's (k = 1..);
- the cost ratio ``c``: the proposer's time per drafted token divided by one target token's time.
With acceptance rate alpha, the expected speed-up of K draft tokens per step is
``(1 - alpha^(K+1)) / ((1 - alpha) * (K * c + v_(K+1)))``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

from draftwise.backends.base import CausalLM

__all__ = ["ForwardCosts", "measure_forward_costs", "predicted_speedup"]


@dataclass(frozen=True)
class ForwardCosts:
    """Median forward times (seconds) by number of new tokens, at a fixed context length (tokens)."""

    seconds: dict[int, float]
    context_len: int

    def relative(self, k: int) -> float:
        """``v_k``: time of a k-token pass / time of a 1-token pass."""
        return self.seconds[k] / self.seconds[1]

    def to_dict(self) -> dict:
        return {"context_len": self.context_len, "seconds": {str(k): v for k, v in self.seconds.items()},
                "relative": {str(k): self.relative(k) for k in self.seconds}}


def measure_forward_costs(
    backend: CausalLM, ks: Iterable[int], *, context_len: int = 200, repeats: int = 5, warmup: int = 1
) -> ForwardCosts:
    """Time forward passes of k new tokens on top of a ``context_len``-token cache, median of ``repeats``.

    Token ids are arbitrary but valid; the cache is rolled back between passes and reset at the end.

    Raises:
        ContextOverflowError: if ``context_len + max(ks)`` exceeds the model's context.
    """
    ks = sorted(set(ks) | {1})
    vocab = backend.vocab_size
    context = [(7 + 31 * i) % vocab for i in range(context_len)]
    backend.reset()
    backend.forward(context, num_logits=1)
    seconds: dict[int, float] = {}
    for k in ks:
        new = [(11 + 17 * i) % vocab for i in range(k)]
        times = []
        for rep in range(warmup + repeats):
            t0 = time.perf_counter()
            backend.forward(new)
            elapsed = time.perf_counter() - t0
            backend.rollback(context_len)
            if rep >= warmup:
                times.append(elapsed)
        seconds[k] = statistics.median(times)
    backend.reset()
    return ForwardCosts(seconds=seconds, context_len=context_len)


def predicted_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float) -> float:
    """Expected speed-up over plain decoding (Leviathan et al. 2023, Theorem 3.8 with a measured verify cost).

    Args:
        alpha: per-token acceptance rate in [0, 1].
        k: draft tokens per step (K).
        cost_ratio: c, proposer time per draft token / target time per token.
        verify_cost: target time of the (K + 1)-token verification pass / one-token pass.
    """
    expected_tokens = float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected_tokens / (k * cost_ratio + verify_cost)
