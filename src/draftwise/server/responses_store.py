"""Kept ``/v1/responses`` conversations, for ``previous_response_id``.

A response created with ``store`` unset or true keeps its conversation (the history it continued, its input
items and its output items; not its ``instructions``, which a next request sends afresh, as OpenAI documents).
A next request naming it as ``previous_response_id`` continues from that conversation. The store is bounded by
a count of responses, least recently used first out, and scoped: a response is found only under the scope it
was kept in (the server's digest of the API key), so no key reads another's conversations. It lives in memory
and is lost on restart. The app owns one :class:`ResponseStore`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from draftwise.server.responses_protocol import InputItem, ResponsesInputError

__all__ = ["ResponseStore"]


class ResponseStore:
    """Conversations of kept responses, least recently used evicted past ``capacity`` (thread-safe).

    Items are immutable once validated and shared, not copied, between a conversation and the ones that
    continue it, so a chain of n responses holds n tuples of pointers to the same items.

    Args:
        capacity: the most responses kept (at least 1).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._kept: OrderedDict[tuple[str, str], tuple[InputItem, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def keep(self, scope: str, response_id: str, items: Sequence[InputItem]) -> None:
        """Keep a response's conversation (:func:`draftwise.server.responses_api.conversation`) under
        ``scope``, evicting the least recently used past the capacity."""
        with self._lock:
            self._kept[(scope, response_id)] = tuple(items)
            self._kept.move_to_end((scope, response_id))
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)

    def history(self, scope: str, response_id: str) -> tuple[InputItem, ...]:
        """The conversation kept for ``response_id`` under ``scope`` (marked recently used).

        Raises:
            ResponsesInputError: none kept (never stored, stored with ``store: false``, evicted, kept under
                another API key, or lost on a restart); ``param`` is ``previous_response_id``.
        """
        with self._lock:
            items = self._kept.get((scope, response_id))
            if items is not None:
                self._kept.move_to_end((scope, response_id))
        if items is None:
            raise ResponsesInputError(
                f"previous response {response_id!r} not found: this server keeps the last {self.capacity} "
                "responses created with 'store' true, per API key, in memory only; send the whole conversation "
                "as 'input' instead", "previous_response_id")
        return items
