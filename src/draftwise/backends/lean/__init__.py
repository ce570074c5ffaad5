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
               num_slots: int = 1, head_ids=None, select_kernels: bool = False, q4k_source=None) -> LeanCausalLM:
    """A :class:`LeanCausalLM` from a loaded transformers Llama-family model (CPU), after a self-test on the real
    weights (:meth:`LeanLlama.check_row_invariance`: k-token passes equal one-token decoding bit for bit).
    ``head_ids``: compute the LM head over these vocabulary ids only (FR-Spec, :mod:`draftwise.frspec`).
    ``select_kernels``: linear kernels from the machine's measured self-test
    (:func:`draftwise.backends.lean.linear.selected_linear_factory`, cached per machine) instead of the mode's
    default (fbgemm int8, or padded fp32 MKL). ``q4k_source``: for ``quantization="q4k"``, the GGUF file's
    quantized rows (:class:`draftwise.backends.kernels.gguf_source.GGUFSource`), regrouped for the kernels.

    Raises:
        UnsupportedArchitecture: not a plain Llama-family decoder.
        NotExactError: the self-test failed on this machine (some kernel depends on the row count here).
        ValueError: unknown quantization mode.
    """
    from draftwise.backends.lean.linear import linear_factory, selected_linear_factory
    from draftwise.backends.lean.model import lean_config_from_hf

    if select_kernels:
        linear = selected_linear_factory(quantization, lean_config_from_hf(hf_model.config, max_context),
                                         q4k_source=q4k_source)
    else:
        linear = linear_factory(quantization, q4k_source=q4k_source)
    # a float model keeps a float cache; a quantized one halves its cache's bytes (the native path reads fp16)
    kv_dtype = torch.float32 if quantization == "none" else None
    model = LeanLlama(hf_model, linear, max_context=max_context, num_slots=num_slots, head_ids=head_ids,
                      kv_dtype=kv_dtype)
    if not model.check_row_invariance():
        raise NotExactError(f"{name}: a k-token pass does not reproduce one-token decoding bit for bit on this CPU "
                            f"with {torch.get_num_threads()} threads; use --runtime transformers")
    return LeanCausalLM(model, name=name)


class NotExactError(RuntimeError):
    """The lean runtime's load-time self-test found a row-dependent result on this machine."""
