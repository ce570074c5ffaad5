"""The engine: one core for one or many requests, and the one-request facade for library users.

- :mod:`draftwise.engine.core`: :class:`EngineCore` (``add`` / ``step`` / ``cancel``) over a slot backend
  (:mod:`draftwise.backends.slots`);
- :mod:`draftwise.engine.facade`: :class:`SpeculativeEngine` (``generate`` / ``stream``), one request at a time
  over a core (:func:`one_slot_core`: the target as one slot);
- :mod:`draftwise.engine.scheduler`: admission, the token budget and prompt chunking: one step's plan;
- :mod:`draftwise.engine.drafting`: each sequence's K and the proposer's drafts;
- :mod:`draftwise.engine.sequence`: a request's state and result, and the commit rule;
- :mod:`draftwise.engine.prefix_reuse`: kept KV prefixes for new requests;
- :mod:`draftwise.engine.faults`: a failure confined to the sequence that caused it.

The core asks for drafts through the one proposer interface, :class:`draftwise.proposers.base.Proposer`.
"""

from draftwise.engine.core import BATCHED_METHODS, EngineCore
from draftwise.engine.facade import EngineBusyError, Generation, SpeculativeEngine, one_slot_core
from draftwise.engine.faults import UnattributedStepError
from draftwise.engine.scheduler import StepInfo
from draftwise.engine.sequence import BatchSequence, GenerationResult, RequestState, SequenceOutput, commit_tokens

__all__ = [
    "EngineCore", "SequenceOutput", "StepInfo", "UnattributedStepError", "BATCHED_METHODS",
    "SpeculativeEngine", "one_slot_core", "Generation", "EngineBusyError", "BatchSequence", "GenerationResult",
    "RequestState", "commit_tokens",
]
