"""The verifier's result type.

Words (as in vLLM's rejection sampler):
- *accepted* tokens: the prefix of the draft that the target keeps;
- *recovered* (correction) token: sampled by the target at the first rejected position;
- *bonus* token: sampled by the target after the last draft token when the whole draft is accepted.
Each verification adds the accepted tokens plus exactly one recovered or bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VerificationResult"]


@dataclass(frozen=True)
class VerificationResult:
    """Outcome of verifying one draft of k tokens.

    Attributes:
        num_drafted: k, the number of draft tokens verified.
        num_accepted: number of draft tokens accepted (0..k).
        next_token_id: the recovered token (num_accepted < k) or bonus token (num_accepted == k).
        token_ids: tokens to commit, in order: ``draft[:num_accepted] + [next_token_id]``.
    """

    num_drafted: int
    num_accepted: int
    next_token_id: int
    token_ids: tuple[int, ...]

    @property
    def bonus(self) -> bool:
        """True when every draft token was accepted and ``next_token_id`` is the bonus token."""
        return self.num_accepted == self.num_drafted
