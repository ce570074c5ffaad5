"""Per-request, position-aware logits processors (grammar masks, penalties, ``logit_bias``, ``min_tokens``),
applied to every draft-model row and every verification row of a speculative step.

:mod:`draftwise.processors.base` holds the contract (:class:`~draftwise.processors.base.LogitsProcessor`) and
the per-request :class:`~draftwise.processors.base.ProcessorChain`; :mod:`draftwise.processors.grammar` the
grammar processor over xgrammar; :mod:`~draftwise.processors.penalties`, :mod:`~draftwise.processors.logit_bias`
and :mod:`~draftwise.processors.min_tokens` the sampling fields' processors, which
:func:`draftwise.processors.request.request_processors` builds from a request's
:class:`~draftwise.config.SamplingParams`."""
