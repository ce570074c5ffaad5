"""The verifier's result type.

Words (as in vLLM's rejection sampler):
- *accepted* tokens: the draft nodes on the root-to-node path the target keeps (a chain's accepted prefix);
- *recovered* (correction) token: chosen by the target where the path stops before a leaf (a draft node there
  was rejected);
- *bonus* token: chosen by the target after a leaf, when the whole path down to it was accepted.
Each verification adds the accepted tokens plus exactly one recovered or bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VerificationResult"]


@dataclass(frozen=True)
class VerificationResult:
    """Outcome of verifying one draft (a chain or a tree of nodes).

    Attributes:
        accepted_nodes: node indices of the accepted path, depth 1 first (a chain: ``0..num_accepted-1``).
        next_token_id: the recovered or bonus token.
        token_ids: tokens to commit, in order: the accepted nodes' tokens then ``next_token_id``.
        bonus: True when the path ended at a leaf, so ``next_token_id`` is the bonus token (a chain: every
            draft token accepted; an empty draft: a plain decoding step).
    """

    accepted_nodes: tuple[int, ...]
    next_token_id: int
    token_ids: tuple[int, ...]
    bonus: bool

    @property
    def num_accepted(self) -> int:
        """Number of draft tokens accepted (the accepted path's depth)."""
        return len(self.accepted_nodes)
