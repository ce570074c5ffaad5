"""draftwise: lossless speculative decoding for causal language models.

A cheap *proposer* (a small draft model, n-gram lookup, Medusa/EAGLE heads) guesses K tokens; the *target*
model checks all of them in one forward pass; *verification* keeps the longest prefix the target agrees with
(greedy) or applies lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023), then adds one
token of the target's own (the correction or bonus token). Output equals plain decoding of the target.

Main entry points:

- :class:`draftwise.engine.SpeculativeEngine`: the propose -> verify -> commit -> roll back loop.
- :func:`draftwise.models.loading.load_model`: load a target or draft from a directory, hub id or ``.gguf``.
- :class:`draftwise.proposers.draft_model.DraftModelProposer`: the draft-model proposer.
- :class:`draftwise.config.SamplingParams` and :class:`draftwise.config.SpeculativeConfig`.
"""

__version__ = "0.1.0"
