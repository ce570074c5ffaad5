"""The engine: one core for one or many requests, and the one-request facade for library users.

- :mod:`draftwise.engine.core`: :class:`EngineCore` (``add`` / ``step`` / ``cancel``) over a slot backend
  (:mod:`draftwise.backends.slots`);
- :mod:`draftwise.engine.facade`: :class:`SpeculativeEngine` (``generate`` / ``stream``), one request at a time
  over a core (:func:`one_slot_core`: the target as one slot);
- :mod:`draftwise.engine.sequence`: a request's state and result, and the commit rule.

The core asks for drafts through the one proposer interface, :class:`draftwise.proposers.base.Proposer`.
"""

from draftwise.engine.core import (
    BATCHED_METHODS,
    EngineCore,
    SequenceOutput,
    StepInfo,
    UnattributedStepError,
    calibrate_pass_costs,
)
from draftwise.engine.facade import EngineBusyError, Generation, SpeculativeEngine, one_slot_core
from draftwise.engine.sequence import BatchSequence, GenerationResult, commit_tokens

__all__ = [
    "EngineCore", "SequenceOutput", "StepInfo", "UnattributedStepError", "calibrate_pass_costs", "BATCHED_METHODS",
    "SpeculativeEngine", "one_slot_core", "Generation", "EngineBusyError", "BatchSequence", "GenerationResult", "commit_tokens",
]
