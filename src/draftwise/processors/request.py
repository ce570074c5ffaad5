"""One request's processor chain from its :class:`~draftwise.config.SamplingParams`: the processors given with
it (a grammar) first, then ``min_tokens``, ``logit_bias`` and the penalties, in vLLM's order (structured-output
mask, ``min_tokens`` and ``logit_bias`` processors, then ``apply_penalties``; temperature and min-p / top-k /
top-p follow in :func:`draftwise.sampling.processed_scores`). :meth:`draftwise.engine.core.EngineCore.add` calls
it for every request, so every caller of the engine gets the same processing."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from draftwise.config import SamplingParams
from draftwise.processors.base import LogitsProcessor, ProcessorChain
from draftwise.processors.logit_bias import LogitBiasProcessor
from draftwise.processors.min_tokens import MinTokensProcessor
from draftwise.processors.penalties import PenaltyProcessor

__all__ = ["request_processors"]


def request_processors(params: SamplingParams, prompt_ids: Sequence[int], stop_token_ids: Iterable[int],
                       vocab_size: int, processors: LogitsProcessor | None = None) -> LogitsProcessor | None:
    """The request's processors: ``processors`` followed by what ``params`` asks for.

    Args:
        params: the request's sampling parameters (penalties, ``logit_bias``, ``min_tokens``).
        prompt_ids: its prompt (the repetition penalty's tokens besides the output).
        stop_token_ids: the tokens that end it (``min_tokens`` forbids them early).
        vocab_size: the width of the target's logits (``logit_bias`` ids must be below it).
        processors: processors given with the request (a grammar's chain), fresh; None: none.

    Returns:
        ``processors`` itself when ``params`` asks for none (None stays None), else a
        :class:`~draftwise.processors.base.ProcessorChain` of its processors and the new ones.

    Raises:
        ValueError: a ``logit_bias`` token id outside ``[0, vocab_size)``.
    """
    stops = frozenset(int(token) for token in stop_token_ids)
    added: list[LogitsProcessor] = []
    if params.min_tokens and stops:
        added.append(MinTokensProcessor(params.min_tokens, stops))
    if params.logit_bias:
        added.append(LogitBiasProcessor(params.logit_bias, vocab_size))
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        added.append(PenaltyProcessor(params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                                      prompt_ids))
    if not added:
        return processors
    given = processors.processors if isinstance(processors, ProcessorChain) else (
        () if processors is None else (processors,))
    return ProcessorChain([*given, *added])
