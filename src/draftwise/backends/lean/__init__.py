"""The lean PyTorch runtime for Llama-family models: own decoder, slot KV cache, batch-invariant by construction.

See :mod:`draftwise.backends.lean.model` (the decoder), :mod:`~draftwise.backends.lean.rows` (the forward
interface), :mod:`~draftwise.backends.lean.attention`, :mod:`~draftwise.backends.lean.kv_cache` and
:mod:`~draftwise.backends.lean.backend` (the :class:`~draftwise.backends.base.CausalLM` adapter).
"""

from draftwise.backends.lean.backend import LeanCausalLM
from draftwise.backends.lean.model import LeanConfig, LeanLlama, UnsupportedArchitecture

__all__ = ["LeanCausalLM", "LeanConfig", "LeanLlama", "UnsupportedArchitecture", "build_lean"]


def build_lean(hf_model, *, quantization: str | None = "int8", name: str = "model", max_context: int | None = None,
               num_slots: int = 1) -> LeanCausalLM:
    """A :class:`LeanCausalLM` from a loaded transformers Llama-family model (CPU).

    Raises:
        UnsupportedArchitecture: not a plain Llama-family decoder.
        ValueError: unknown quantization mode.
    """
    from draftwise.backends.lean.linear import linear_factory

    model = LeanLlama(hf_model, linear_factory(quantization), max_context=max_context, num_slots=num_slots)
    return LeanCausalLM(model, name=name)
