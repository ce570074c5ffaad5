"""Per-request, position-aware logits processors (grammar masks now; penalties, ``logit_bias`` and
``min_tokens`` later), applied to every draft row and every verification row of a speculative step.

:mod:`draftwise.processors.base` holds the contract (:class:`~draftwise.processors.base.LogitsProcessor`) and
the per-request :class:`~draftwise.processors.base.ProcessorChain`; :mod:`draftwise.processors.grammar` the
grammar processor over xgrammar."""
