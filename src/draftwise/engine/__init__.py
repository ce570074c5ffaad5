"""The engine: one core for one or many requests, and the one-request facade for library users.

- :mod:`draftwise.engine.core`: :class:`EngineCore` (``add`` / ``step`` / ``cancel``) over a slot backend
  (:mod:`draftwise.backends.slots`);
- :mod:`draftwise.engine.facade`: :class:`SpeculativeEngine` (``generate`` / ``stream``), a batch of one;
- :mod:`draftwise.engine.scheduler`: admission, the token budget and prompt chunking: one step's plan;
- :mod:`draftwise.engine.sequence`: a request's state and result, and the commit rule;
- :mod:`draftwise.engine.prefix_reuse`: kept KV prefixes for new requests;
- :mod:`draftwise.engine.faults`: a failure confined to the sequence that caused it;
- :mod:`draftwise.engine.proposers`, :mod:`draftwise.engine.draft_slots`: how the core asks proposers for drafts.
"""

from draftwise.engine.core import BATCHED_METHODS, EngineCore
from draftwise.engine.draft_slots import BatchedDraftModel
from draftwise.engine.facade import EngineBusyError, Generation, SpeculativeEngine
from draftwise.engine.faults import UnattributedStepError
from draftwise.engine.proposers import BatchProposer, PerSequenceProposers
from draftwise.engine.scheduler import StepInfo
from draftwise.engine.sequence import BatchSequence, GenerationResult, RequestState, SequenceOutput, commit_tokens

__all__ = [
    "EngineCore", "SequenceOutput", "StepInfo", "UnattributedStepError", "BATCHED_METHODS",
    "BatchedDraftModel", "SpeculativeEngine", "Generation", "EngineBusyError", "BatchProposer",
    "PerSequenceProposers", "BatchSequence", "GenerationResult", "RequestState", "commit_tokens",
]
