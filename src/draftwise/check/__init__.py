"""``draftwise check``: will this draft help this target, and what will it cost?

Modules: :mod:`~draftwise.check.gguf_header` (fast GGUF header reader), :mod:`~draftwise.check.describe`
(model size and shape without weights), :mod:`~draftwise.check.tokenizer` (compatibility),
:mod:`~draftwise.check.memory` (weights and KV cache vs a budget), :mod:`~draftwise.check.probe`
(acceptance probe, forward costs, predicted speed-up), :mod:`~draftwise.check.verdict`,
:mod:`~draftwise.check.report` (result and JSON), :mod:`~draftwise.check.render` (rich tables) and
:mod:`~draftwise.check.runner` (:func:`~draftwise.check.runner.check_pair`, which runs them in order).

Kept free of imports so that :mod:`draftwise.builder` can use the tokenizer check cheaply.
"""
