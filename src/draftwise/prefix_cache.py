"""Prefix (KV) cache reuse across requests.

An agent loop sends the same conversation back every turn, longer each time. Re-running the target (and a
draft model) over the whole conversation each turn costs a full prefill; this module keeps the KV state of
recent sequences so a new request re-uses the longest common token prefix it shares with one of them and
prefills only the rest (as vLLM's automatic prefix caching and SGLang's RadixAttention do, at the granularity
of whole sequences rather than blocks or radix-tree nodes).

An entry holds a finished sequence's tokens, the target backend's exported KV state
(:meth:`draftwise.backends.base.CausalLM.export_cache`) and the proposer's exported state (a draft model's
KV cache; None for stateless proposers). Entries are bounded by a memory budget (bytes of KV tensors) with
least-recently-used eviction; an entry whose tokens are a prefix of a newer entry's in the same scope is
dropped (the newer one covers it). Entries are only ever matched within one **scope** (an API key, a
``user`` value): cached state is never shared across scopes.

Counters follow vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` (in prompt tokens).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from draftwise.proposers.base import common_prefix_length

__all__ = ["PrefixCache", "PrefixEntry", "PrefixMatch"]

logger = logging.getLogger(__name__)

@dataclass
class PrefixEntry:
    """One kept sequence.

    Attributes:
        scope: who may reuse it (API key / user scope string; "" when none is in use).
        tokens: the sequence's token ids whose KV entries the states hold (``len(tokens)`` positions).
        target_state: the target backend's exported KV state (opaque).
        proposer_state: the proposer's exported state (opaque; None for stateless proposers; its ``nbytes``
            attribute, when present, counts against the budget as it is now: a kept suffix index that a later
            request adopted counts 0).
        target_nbytes: memory held by the target's state (bytes).
    """

    scope: str
    tokens: tuple[int, ...]
    target_state: Any
    proposer_state: Any
    target_nbytes: int

    @property
    def nbytes(self) -> int:
        """Memory held by both states now (bytes)."""
        return self.target_nbytes + int(getattr(self.proposer_state, "nbytes", 0))


@dataclass(frozen=True)
class PrefixMatch:
    """The best kept sequence for a prompt: ``entry`` (None when nothing matched) and the number of prompt
    tokens (``length``) whose KV entries can be reused."""

    entry: PrefixEntry | None
    length: int


class PrefixCache:
    """A bounded, scoped LRU store of sequence KV states.

    Args:
        capacity_bytes: memory budget for kept KV states (bytes); 0 disables the store (lookups never hit).
        max_entries: at most this many entries, whatever their size.

    Not thread-safe: the engine that owns it serialises access (it serves one request at a time).
    """

    def __init__(self, capacity_bytes: int, max_entries: int = 64) -> None:
        if capacity_bytes < 0 or max_entries < 1:
            raise ValueError(f"need capacity_bytes >= 0 and max_entries >= 1, got {capacity_bytes}, {max_entries}")
        self.capacity_bytes = capacity_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.queries = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
        self.hits = 0  # prompt tokens served from a kept state (vLLM: prefix_cache_hits)
        self.evictions = 0  # entries dropped for the budget

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    @property
    def nbytes(self) -> int:
        """Memory held by the kept states (bytes)."""
        return sum(entry.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, scope: str, prompt: Sequence[int]) -> PrefixMatch:
        """The entry of ``scope`` sharing the longest token prefix with ``prompt`` (``[n]``), marked as most
        recently used. Does not count queries or hits (see :meth:`record`)."""
        best, best_length = None, 0
        prompt = list(prompt)
        for key, entry in self._entries.items():
            if entry.scope != scope:
                continue
            length = common_prefix_length(entry.tokens, prompt)
            if length > best_length:
                best, best_length = key, length
        if best is None:
            return PrefixMatch(None, 0)
        self._entries.move_to_end(best)
        return PrefixMatch(self._entries[best], best_length)

    def record(self, num_queried: int, num_hit: int) -> None:
        """Count one request's prompt tokens looked up and reused (tokens)."""
        self.queries += num_queried
        self.hits += num_hit

    def insert(self, entry: PrefixEntry) -> None:
        """Keep ``entry`` as the most recently used; drop entries of its scope whose tokens are a prefix of
        its tokens, then evict least recently used entries beyond the budget. An entry larger than the whole
        budget is not kept."""
        if not self.enabled or not entry.tokens:
            return
        for key in [k for k, e in self._entries.items() if e.scope == entry.scope and
                    len(e.tokens) <= len(entry.tokens) and entry.tokens[:len(e.tokens)] == e.tokens]:
            del self._entries[key]
        if entry.nbytes > self.capacity_bytes:
            logger.info("prefix cache: a %d-token sequence (%d bytes) exceeds the budget of %d bytes; not kept",
                        len(entry.tokens), entry.nbytes, self.capacity_bytes)
            return
        self._entries[self._next_id] = entry
        self._next_id += 1
        while len(self._entries) > self.max_entries or self.nbytes > self.capacity_bytes:
            self._entries.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        self._entries.clear()
