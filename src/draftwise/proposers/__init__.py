"""Proposers: cheap guessers of the target's next K tokens, one method per module, one interface."""

from draftwise.proposers.base import DraftProposal, Proposer

__all__ = ["DraftProposal", "Proposer"]
