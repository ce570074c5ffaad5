"""The engine: one core for one or many requests, and the one-request facade for library users.

- :mod:`draftwise.engine.core`: :class:`EngineCore` (``add`` / ``step`` / ``cancel``) over a slot backend
  (:mod:`draftwise.backends.slots`);
- :mod:`draftwise.engine.facade`: :class:`SpeculativeEngine` (``generate`` / ``stream``), a batch of one;
- :mod:`draftwise.engine.sequence`: a request's state and result, and the commit rule;
- :mod:`draftwise.engine.proposers`, :mod:`draftwise.engine.draft_slots`: how the core asks proposers for drafts.
"""

from draftwise.engine.core import (
    BATCHED_METHODS,
    EngineCore,
    SequenceOutput,
    StepInfo,
    UnattributedStepError,
    calibrate_pass_costs,
)
from draftwise.engine.draft_slots import BatchedDraftModel
from draftwise.engine.facade import EngineBusyError, Generation, SpeculativeEngine
from draftwise.engine.proposers import BatchProposer, PerSequenceProposers
from draftwise.engine.sequence import BatchSequence, GenerationResult, commit_tokens

__all__ = [
    "EngineCore", "SequenceOutput", "StepInfo", "UnattributedStepError", "calibrate_pass_costs", "BATCHED_METHODS",
    "BatchedDraftModel", "SpeculativeEngine", "Generation", "EngineBusyError", "BatchProposer",
    "PerSequenceProposers", "BatchSequence", "GenerationResult", "commit_tokens",
]
