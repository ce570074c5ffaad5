"""The engine: one core for one or many requests, and the one-request facade for library users.

- :mod:`draftwise.engine.core`: :class:`EngineCore` (``add`` / ``step`` / ``cancel``) over a slot backend
  (:mod:`draftwise.backends.slots`);
- :mod:`draftwise.engine.facade`: :class:`SpeculativeEngine` (``generate`` / ``stream``), a batch of one;
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
from draftwise.engine.facade import EngineBusyError, Generation, SpeculativeEngine
from draftwise.engine.sequence import BatchSequence, GenerationResult, commit_tokens

__all__ = [
    "EngineCore", "SequenceOutput", "StepInfo", "UnattributedStepError", "calibrate_pass_costs", "BATCHED_METHODS",
    "SpeculativeEngine", "Generation", "EngineBusyError", "BatchSequence", "GenerationResult", "commit_tokens",
]
