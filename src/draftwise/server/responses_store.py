"""Kept ``/v1/responses`` conversations, for ``previous_response_id``.

A response created with ``store`` unset or true keeps its conversation (the history it continued, its input
items and its output items; not its ``instructions``, which a next request sends afresh, as OpenAI documents).
A next request naming it as ``previous_response_id`` continues from that conversation. The store is bounded by
a count of responses, least recently used first out, and scoped: a response is found only under the scope it
was kept in (the server's digest of the API key), so no key reads another's conversations. It lives in memory
and is lost on restart. The app owns one :class:`ResponseStore`.

A count alone does not bound memory: a client that sends its whole history on every call with ``store`` left
at its default (the Agents SDK does) keeps a full copy of that history per response. So the store also holds at
most ``max_chars`` characters of item text (message text, call names, arguments and outputs, counted once per
conversation that holds them), evicting the least recently used past either bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from draftwise.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    ResponsesInputError,
)

__all__ = ["ResponseStore"]


class ResponseStore:
    """Conversations of kept responses, the least recently used evicted past ``capacity`` responses or
    ``max_chars`` characters of item text (thread-safe).

    Items are immutable once validated and shared, not copied, between a conversation and the ones that
    continue it, so a chain of n responses holds n tuples of pointers to the same items (their text is counted
    in each, so ``max_chars`` over-counts a chain: the bound errs on the safe side).

    Args:
        capacity: the most responses kept (at least 1).
        max_chars: the most characters of item text kept (at least 1); a conversation longer than this alone
            is not kept (its next request gets the 400 of an unknown ``previous_response_id``).

    Raises:
        ValueError: ``capacity`` or ``max_chars`` < 1.
    """

    def __init__(self, capacity: int = 1024, max_chars: int = 64_000_000) -> None:
        if capacity < 1 or max_chars < 1:
            raise ValueError(f"capacity and max_chars must be at least 1, got {capacity} and {max_chars}")
        self.capacity, self.max_chars = capacity, max_chars
        self._kept: OrderedDict[tuple[str, str], tuple[tuple[InputItem, ...], int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def keep(self, scope: str, response_id: str, items: Sequence[InputItem]) -> None:
        """Keep a response's conversation (:func:`draftwise.server.responses_api.conversation`) under
        ``scope``, evicting the least recently used past the bounds."""
        key, chars = (scope, response_id), sum(map(_item_chars, items))
        with self._lock:
            self._forget(key)
            self._kept[key] = (tuple(items), chars)
            self._chars += chars
            while self._kept and (len(self._kept) > self.capacity or self._chars > self.max_chars):
                self._forget(next(iter(self._kept)))

    def _forget(self, key: tuple[str, str]) -> None:
        kept = self._kept.pop(key, None)
        if kept is not None:
            self._chars -= kept[1]

    def history(self, scope: str, response_id: str) -> tuple[InputItem, ...]:
        """The conversation kept for ``response_id`` under ``scope`` (marked recently used).

        Raises:
            ResponsesInputError: none kept (never stored, stored with ``store: false``, evicted, kept under
                another API key, or lost on a restart); ``param`` is ``previous_response_id``.
        """
        with self._lock:
            kept = self._kept.get((scope, response_id))
            if kept is not None:
                self._kept.move_to_end((scope, response_id))
        if kept is None:
            raise ResponsesInputError(
                f"previous response {response_id!r} not found: this server keeps the last {self.capacity} "
                "responses created with 'store' true (fewer when they are long), per API key, in memory only; "
                "send the whole conversation as 'input' instead", "previous_response_id")
        return kept[0]


def _item_chars(item: InputItem) -> int:
    """The characters of text an item holds."""
    if isinstance(item, FunctionCallItem):
        return len(item.name) + len(item.arguments)
    content = item.output if isinstance(item, FunctionCallOutputItem) else item.content
    return len(content) if isinstance(content, str) else sum(len(part.text) for part in content)
