"""A draft model that decodes on one runtime and catches up on long inputs on another.

A draft model must read the whole prompt before it proposes (its catch-up prefill), once per request and again
for every long stretch it has not seen (a new turn's tool output). On the CPUs measured here the runtime that
decodes a small draft fastest is not the one that prefills it fastest: Qwen2.5-Coder-0.5B decodes a token in
12 ms on llama.cpp (a Q4_0 copy) against 34 ms on the lean int8 runtime, but prefills 256 tokens at about 280
tok/s on llama.cpp against about 500 on the lean runtime (AMD EPYC, 2 cores, AVX-512 + VNNI;
``docs/draft_trees.md``). :class:`CatchUpDraft` runs both: a forward whose input is long (the rows before the
ones whose logits are wanted number at least ``min_tokens``) runs those rows on the ``prefiller``, whose keys
and values are then written into the ``decoder``'s cache (``llama_state_seq_set_data``); the wanted rows and
every short pass run on the decoder. The draft's logits therefore always come from the decoder.

The two runtimes' numerics differ (int8 against Q4_0 weights), so the decoder continues from keys and values it
did not compute itself. That is allowed for a draft and only for a draft: the output depends on the target
alone (a greedy or coupled verification accepts a draft token only if it is the target's own choice, and
rejection sampling is lossless for any draft distribution, provided the q reported is the one sampled from,
which it is: the decoder's). It is never used for a target.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from draftwise.backends.base import CausalLM, ForwardOutput, KVState

__all__ = ["CatchUpDraft", "DEFAULT_MIN_TOKENS", "interleave_rope_pairs", "split_rope_pairs"]

logger = logging.getLogger(__name__)

#: Catch-ups of at least this many tokens run on the prefiller (below it, moving the cache costs more than the
#: faster prefill saves; measured in docs/draft_trees.md).
DEFAULT_MIN_TOKENS = 32


def interleave_rope_pairs(keys: torch.Tensor) -> torch.Tensor:
    """Keys ``[..., head_dim]`` from the rotate-half layout (Hugging Face: dimension i pairs with i + d/2) to
    the interleaved one (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``: 2i pairs with 2i + 1)."""
    half = keys.shape[-1] // 2
    return torch.stack((keys[..., :half], keys[..., half:]), dim=-1).flatten(-2)


def split_rope_pairs(keys: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_rope_pairs`: ``[..., head_dim]`` interleaved to rotate-half."""
    return torch.cat((keys[..., 0::2], keys[..., 1::2]), dim=-1)


class CatchUpDraft(CausalLM):
    """A draft model decoded by ``decoder`` whose long catch-ups run on ``prefiller`` (see the module docstring).

    Args:
        decoder: a :class:`~draftwise.backends.llama_cpp_backend.LlamaCppCausalLM` (it needs ``read_cache``,
            ``write_cache``, ``rope_interleaved`` and ``kv_heads``).
        prefiller: the same model on a runtime that exports and imports its cache as per layer ``(keys,
            values)`` ``[kv_heads, length, head_dim]`` with rotate-half keys (the lean runtime).
        min_tokens: a forward runs its leading rows on the prefiller when at least this many precede the rows
            whose logits (or hidden states) are wanted (tokens, >= 1).

    Raises:
        ValueError: the two disagree on the vocabulary, the prefiller cannot export its cache or holds less
            context than the decoder, or ``min_tokens`` < 1.

    Attributes:
        catch_ups: forwards whose leading rows ran on the prefiller; ``tokens_caught_up``: those rows (tokens).
    """

    supports_tree = False
    supports_hidden_states = False
    supports_cache_export = False

    def __init__(self, decoder: CausalLM, prefiller: CausalLM, *, min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        if decoder.vocab_size != prefiller.vocab_size:
            raise ValueError(f"{decoder.name} has {decoder.vocab_size} logits, {prefiller.name} "
                             f"{prefiller.vocab_size}: not the same draft model")
        if not prefiller.supports_cache_export:
            raise ValueError(f"{prefiller.name} cannot export its cache")
        if prefiller.max_context < decoder.max_context:
            raise ValueError(f"{prefiller.name} holds {prefiller.max_context} tokens, {decoder.name} "
                             f"{decoder.max_context}")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.decoder = decoder
        self.prefiller = prefiller
        self.min_tokens = int(min_tokens)
        self.name = decoder.name
        self.vocab_size = decoder.vocab_size
        self.max_context = decoder.max_context
        self.device = torch.device("cpu")
        self.catch_ups = 0
        self.tokens_caught_up = 0
        self._interleaved = bool(decoder.rope_interleaved)
        self._tokens: list[int] = []  # what the decoder's cache holds
        self._prefilled: list[int] = []  # what the prefiller's cache holds

    @property
    def num_cached(self) -> int:
        return len(self._tokens)

    def forward(self, token_ids: Sequence[int], *, num_logits: int | None = None, return_hidden: bool = False,
                hidden_rows: int | None = None) -> ForwardOutput:
        """:meth:`CausalLM.forward`; logits ``[keep, vocab]`` always from the decoder.

        Raises:
            ContextOverflowError, ValueError: see :meth:`CausalLM.forward`.
        """
        ids = [int(t) for t in token_ids]
        self._check_forward_args(ids)
        self.cache_owner = None
        n = len(ids)
        keep = n if num_logits is None else max(1, min(num_logits, n))
        if return_hidden and hidden_rows is not None:
            keep = max(keep, min(int(hidden_rows), n))
        lead = n - keep
        if lead >= self.min_tokens:
            self._catch_up(ids[:lead])
            ids = ids[lead:]
        extra = {"return_hidden": True} if return_hidden else {}
        try:
            out = self.decoder.forward(ids, num_logits=num_logits, **extra)
        except BaseException:
            self._tokens = self._tokens[: self.decoder.num_cached]
            raise
        self._tokens.extend(ids)
        return out

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)
        self.cache_owner = None
        self.decoder.rollback(length)
        del self._tokens[length:]

    # ------------------------------------------------------------------ the catch-up
    def _catch_up(self, ids: list[int]) -> None:
        """Run ``ids`` on the prefiller on top of the decoder's context and leave the result in the decoder."""
        base = len(self._tokens)
        if self._prefilled[:base] == self._tokens:  # the prefiller holds the decoder's context (or more)
            self.prefiller.rollback(base)
        else:
            self._prefiller_from_decoder(base)
        self._prefilled = self._tokens[:base]
        self.prefiller.forward(ids, num_logits=1)
        self._prefilled.extend(ids)
        self.decoder.write_cache(self._decoder_layers(self.prefiller.export_cache()))
        self._tokens.extend(ids)
        self.catch_ups += 1
        self.tokens_caught_up += len(ids)

    def _prefiller_from_decoder(self, length: int) -> None:
        """Give the prefiller the decoder's first ``length`` cached positions."""
        heads = int(self.decoder.kv_heads)
        payload = []
        for keys, values in self.decoder.read_cache():
            k = torch.from_numpy(keys[:length]).view(length, heads, -1).transpose(0, 1)  # [heads, length, dim]
            v = torch.from_numpy(values[:length]).view(length, heads, -1).transpose(0, 1)
            payload.append((split_rope_pairs(k) if self._interleaved else k.contiguous(), v.contiguous()))
        nbytes = sum(k.nbytes + v.nbytes for k, v in payload)
        self.prefiller.import_cache(KVState(tuple(payload), length, nbytes), length)

    def _decoder_layers(self, state: KVState) -> list[tuple[np.ndarray, np.ndarray]]:
        """The prefiller's exported ``(keys, values)`` ``[heads, length, dim]`` per layer as the decoder's rows
        ``[length, heads * dim]``."""
        layers = []
        for keys, values in state.payload:
            k = interleave_rope_pairs(keys) if self._interleaved else keys
            layers.append((k.transpose(0, 1).reshape(state.length, -1).float().numpy(),
                           values.transpose(0, 1).reshape(state.length, -1).float().numpy()))
        return layers

    def close(self) -> None:
        """Free the decoder's llama.cpp context (the prefiller goes with its last user)."""
        close = getattr(self.decoder, "close", None)
        if close is not None:
            close()

