"""Proposers: cheap guessers of the target's next K tokens, one method per module, one interface
(:class:`~draftwise.proposers.base.Proposer`: ``propose`` for a batch of sequences, ``accept`` their outcome)."""

from draftwise.proposers.base import DraftProposal, PerSequenceProposers, Proposer, SequenceProposer

__all__ = ["DraftProposal", "PerSequenceProposers", "Proposer", "SequenceProposer"]
