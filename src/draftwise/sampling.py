"""Logits processing (temperature, top-k, top-p) and seeded sampling.

The same function turns the target's logits into ``target_probs`` and the draft's logits into
``draft_probs``, as lossless speculative sampling requires (both distributions after the same processing).
"""

from __future__ import annotations

import secrets

import torch

from draftwise.config import SamplingParams

__all__ = ["logits_to_probs", "make_generator", "sample_from_probs"]


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits and return probabilities.

    Args:
        logits: ``[n, vocab]`` raw logits (any float dtype, any device).
        params: sampling parameters; must have ``temperature > 0``.

    Returns:
        ``[n, vocab]`` float32 probabilities on the same device; each row sums to 1.

    Raises:
        ValueError: if called with greedy params (temperature 0), where no distribution is defined.
    """
    if params.greedy:
        raise ValueError("logits_to_probs needs temperature > 0; greedy decoding uses argmax")
    scores = logits.float() / params.temperature  # [n, vocab]
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=True)  # [n, vocab]
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Mass strictly before each token; keep tokens whose preceding mass is < top_p (the top one always).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before >= params.top_p
        remove_sorted[..., 0] = False  # the top token stays, even when top_p underflows float32 to 0
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return torch.softmax(scores, dim=-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU ``torch.Generator`` for one request: seeded with ``seed``, or a fresh random seed if None."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from ``probs`` (``[vocab]``, non-negative, any sum > 0) with ``generator``."""
    return int(torch.multinomial(probs.detach().float().cpu(), 1, generator=generator).item())
