"""The lean PyTorch runtime for Llama-family models: own decoder, slot KV cache, batch-invariant by construction.

See :mod:`draftwise.backends.lean.model` (the decoder), :mod:`~draftwise.backends.lean.rows` (the forward
interface), :mod:`~draftwise.backends.lean.attention`, :mod:`~draftwise.backends.lean.kv_cache` and
:mod:`~draftwise.backends.lean.backend` (the :class:`~draftwise.backends.base.CausalLM` adapter).
"""

import torch

from draftwise.backends.lean.backend import LeanCausalLM
from draftwise.backends.lean.model import LeanConfig, LeanLlama, UnsupportedArchitecture

__all__ = ["LeanCausalLM", "LeanConfig", "LeanLlama", "NotExactError", "UnsupportedArchitecture", "build_lean"]


def build_lean(hf_model, *, quantization: str | None = "int8", name: str = "model", max_context: int | None = None,
               num_slots: int = 1) -> LeanCausalLM:
    """A :class:`LeanCausalLM` from a loaded transformers Llama-family model (CPU), after a self-test on the real
    weights (:meth:`LeanLlama.check_row_invariance`: k-token passes equal one-token decoding bit for bit).

    Raises:
        UnsupportedArchitecture: not a plain Llama-family decoder.
        NotExactError: the self-test failed on this machine (some kernel depends on the row count here).
        ValueError: unknown quantization mode.
    """
    from draftwise.backends.lean.linear import linear_factory

    model = LeanLlama(hf_model, linear_factory(quantization), max_context=max_context, num_slots=num_slots)
    if not model.check_row_invariance():
        raise NotExactError(f"{name}: a k-token pass does not reproduce one-token decoding bit for bit on this CPU "
                            f"with {torch.get_num_threads()} threads; use --runtime transformers")
    return LeanCausalLM(model, name=name)


class NotExactError(RuntimeError):
    """The lean runtime's load-time self-test found a row-dependent result on this machine."""
