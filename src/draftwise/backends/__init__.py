"""Model backends: the causal-LM interface the engine drives, and its implementations."""

from draftwise.backends.base import CausalLM, ForwardOutput

__all__ = ["CausalLM", "ForwardOutput"]
