"""Logits processing (temperature, min-p, top-k, top-p) and how a request turns target / draft logits into tokens.

The same processing turns the target's logits into ``target_probs`` and the draft's logits into
``draft_probs``, as lossless speculative sampling requires (both distributions after the same processing).

Two rules draw tokens at temperature > 0 (:attr:`draftwise.config.SamplingParams.sampling`):

- **rejection**: plain decoding draws from ``target_probs`` with the request's generator; a speculative step
  verifies by rejection sampling (:mod:`draftwise.verification.rejection`). Plain and speculative decoding
  consume random numbers differently, so a seed fixes the text of one configuration only.
- **coupled** (Gumbel-max; Daliri et al. 2024, "Coupling without communication and drafter-invariant
  speculative decoding"): the token at sequence position t is ``argmax(scores + G_t)`` where ``scores`` are
  the processed target logits (masked tokens -inf) and ``G_t`` is standard Gumbel noise ``[vocab]`` drawn
  from a generator seeded by a hash of ``(seed, t)``. Gumbel-max is an exact sampler of ``softmax(scores)``.
  A drafter that samples uses the same ``G_t``; verification accepts a draft token exactly when it equals the
  target's Gumbel-argmax (:mod:`draftwise.verification.coupled`). The committed token at every position is
  the target's Gumbel-argmax there, so the text depends on the seed only, not on the proposer, K or tree.

Position convention: ``t`` is the token's absolute index in the request's sequence (prompt + output), so
the first output token has ``t = len(prompt)``. It never depends on how many tokens a pass carried.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence

import torch

from draftwise.config import SamplingParams

__all__ = ["processed_scores", "logits_to_probs", "gumbel_noise", "gumbel_argmax", "make_generator",
           "sample_from_probs", "Sampler"]


def processed_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with the tokens outside min-p / top-k / top-p set to -inf.

    In vLLM's order: temperature; min-p (a token whose probability is below ``min_p`` times the most likely
    token's is dropped: ``score < max_score + log(min_p)``); then top-k and top-p over what is left. The request's
    logits processors (penalties, ``logit_bias``, a grammar) have already acted on ``logits``.

    Args:
        logits: ``[n, vocab]`` raw logits (any float dtype, any device).
        params: sampling parameters; must have ``temperature > 0``.

    Returns:
        ``[n, vocab]`` float32 scores on the same device; ``softmax`` of a row is its sampling distribution.

    Raises:
        ValueError: if called with greedy params (temperature 0), where no distribution is defined.
    """
    if params.greedy:
        raise ValueError("sampling needs temperature > 0; greedy decoding uses argmax")
    scores = logits.float() / params.temperature  # [n, vocab]
    vocab = scores.shape[-1]
    if params.min_p > 0.0:
        floor = scores.amax(dim=-1, keepdim=True) + math.log(params.min_p)  # [n, 1]
        scores = scores.masked_fill(scores < floor, float("-inf"))
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
    return scores


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, min-p, top-k and top-p to logits and return probabilities.

    Args:
        logits: ``[n, vocab]`` raw logits (any float dtype, any device).
        params: sampling parameters; must have ``temperature > 0``.

    Returns:
        ``[n, vocab]`` float32 probabilities on the same device; each row sums to 1.

    Raises:
        ValueError: if called with greedy params (temperature 0), where no distribution is defined.
    """
    return torch.softmax(processed_scores(logits, params), dim=-1)


def _position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for ``(seed, position)`` (BLAKE2b, stable across platforms and processes)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise ``G_t`` for sequence position ``t = position`` of a request seeded with ``seed``.

    A CPU generator is seeded with a hash of ``(seed, position)``; ``u ~ U[0, 1)`` is drawn in float64 (53-bit
    resolution, so the upper tail that decides argmaxes reaches G ~ 36.7), then ``G = -log(-log(u))`` is
    evaluated in float32 as ``-log(-log1p(u - 1))``: ``u - 1`` is exact in float64 and keeps its relative
    precision in float32, so large G stay resolved. Only the far lower tail is coarse (``u < 2**-25``, probability
    3e-8, gives G = -inf), which changes a choice with probability below 3e-8. Bit-identical for the same torch
    build and thread count.

    Returns:
        ``[vocab]`` float32 on the CPU; a pure function of its arguments.
    """
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_position_seed(seed, position))
    u = torch.rand(vocab, dtype=torch.float64, generator=generator)  # [vocab]
    exponential = torch.log1p((u - 1.0).float()).neg_()  # -log(u) ~ Exp(1), [vocab]
    return exponential.log_().neg_()


def gumbel_argmax(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max choice ``argmax(scores + noise)`` per row.

    Args:
        scores: ``[n, vocab]`` processed scores (:func:`processed_scores`; -inf = never chosen).
        noise: ``[n, vocab]`` Gumbel noise (:func:`gumbel_noise`), any device (moved to ``scores``').

    Returns:
        ``[n]`` int64 token ids; the choice is distributed as ``softmax(scores)`` when the noise is fresh.
    """
    return torch.argmax(scores.float() + noise.to(scores.device), dim=-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU ``torch.Generator`` for one request: seeded with ``seed``, or a fresh random seed if None."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from ``probs`` (``[vocab]``, non-negative, any sum > 0) with ``generator``."""
    return int(torch.multinomial(probs.detach().float().cpu(), 1, generator=generator).item())


class Sampler:
    """One request's randomness and its rule for turning logits into tokens (see the module docstring).

    The engine makes one per request and hands it to the proposer, so a drafter that samples uses the same
    generator (rejection) or the same Gumbel noise per position (coupled) as the target.

    Args:
        params: the request's sampling parameters.

    Attributes:
        params: as given.
        seed: the request's seed (``params.seed``, or a fresh random one).
        generator: CPU generator for rejection sampling's draws, seeded with ``seed``.
        coupled: True when tokens are Gumbel-argmaxes (``params.coupled``).
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = make_generator(self.seed)
        self.coupled = params.coupled
        self._noise: dict[int, torch.Tensor] = {}  # position -> [vocab], the positions of the current step

    def noise(self, positions: Sequence[int], vocab: int) -> torch.Tensor:
        """Gumbel noise rows ``[len(positions), vocab]`` (float32, CPU) for these sequence positions, cached
        per position until :meth:`release` so a draft and the target's verification share it.

        Raises:
            ValueError: a position's noise was cached with a different width.
        """
        rows = []
        for position in positions:
            row = self._noise.get(position)
            if row is None:
                row = self._noise[position] = gumbel_noise(self.seed, position, vocab)
            elif row.shape[0] != vocab:
                raise ValueError(f"noise for position {position} has width {row.shape[0]}, asked for {vocab}")
            rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, vocab)

    def release(self, before: int) -> None:
        """Forget the cached noise of positions ``< before`` (tokens already committed)."""
        for position in [p for p in self._noise if p < before]:
            del self._noise[position]

    def choose(self, logits: torch.Tensor, position: int) -> tuple[int, torch.Tensor | None]:
        """The token at sequence ``position`` from ``logits`` (``[vocab]``, target or draft).

        Returns:
            ``(token, probs)``: greedy -> the argmax and None; coupled -> the Gumbel-argmax and None (the
            token is a function of the logits and the noise); rejection -> a draw from the processed
            distribution and that distribution (``[vocab]`` float32, a draft's ``draft_probs`` row).
        """
        if self.params.greedy:
            return int(torch.argmax(logits).item()), None
        if self.coupled:
            scores = processed_scores(logits.unsqueeze(0), self.params)  # [1, vocab]
            return int(gumbel_argmax(scores, self.noise([position], scores.shape[-1]))[0]), None
        probs = logits_to_probs(logits.unsqueeze(0), self.params)[0]  # [vocab]
        return sample_from_probs(probs, self.generator), probs

    def sample(self, logits: torch.Tensor, position: int) -> int:
        """The token at sequence ``position`` from ``logits`` ``[vocab]`` (see :meth:`choose`)."""
        return self.choose(logits, position)[0]

    def logprob(self, logits: torch.Tensor, token: int, probs: torch.Tensor | None = None) -> float:
        """The log-probability of ``token`` under the processed distribution of ``logits`` (``[vocab]``, a
        draft's; temperature / min-p / top-k / top-p, plain log-softmax when greedy): the draft's confidence in a token
        :meth:`choose` returned. ``probs``: that distribution when :meth:`choose` gave it (rejection sampling),
        read instead of recomputed. -inf for a token the distribution excludes."""
        if probs is not None:
            value = float(probs[token])
            return math.log(value) if value > 0.0 else float("-inf")
        scores = logits.float() if self.params.greedy else processed_scores(logits.unsqueeze(0), self.params)[0]
        return float(scores[token] - torch.logsumexp(scores, dim=-1))

    def candidates(self, logits: torch.Tensor, position: int, n: int) -> tuple[list[int], list[float]]:
        """The ``n`` best distinct tokens at sequence ``position`` for a deterministic draft tree's children
        (``logits [vocab]``, a draft's), best first, and their log-probabilities under the processed
        distribution (temperature / min-p / top-k / top-p; plain log-softmax when greedy).

        Greedy and rejection sampling rank by log-probability (deterministic distinct siblings keep SpecInfer's
        multi-candidate rejection lossless); coupled sampling ranks by the Gumbel-perturbed score with the
        target's noise at ``position``, so the first candidate is :meth:`choose`'s token. Tokens the processed
        distribution excludes are left out (fewer than ``n`` may come back).
        """
        if self.params.greedy:
            scores = logits.float()
        else:
            scores = processed_scores(logits.unsqueeze(0), self.params)[0]
        logprobs = torch.log_softmax(scores, dim=-1)
        rank = scores + self.noise([position], scores.shape[-1])[0] if self.coupled else logprobs
        top = torch.topk(rank, min(n, rank.shape[-1])).indices.tolist()
        tokens = [t for t in top if logprobs[t] > float("-inf")]
        return tokens, [float(logprobs[t]) for t in tokens]

