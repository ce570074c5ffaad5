"""Log-probabilities in OpenAI's and vLLM's response formats (the values are the engine's,
:mod:`draftwise.logprobs`, which defines them).

- Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}], "refusal": null}``, one entry per generated token; the Responses API's
  ``output_text.logprobs`` entries have the same shape (:func:`chat_entries`).
- Completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``,
  each position's dict holding its k most likely tokens and the chosen one (OpenAI's "up to logprobs + 1"). With
  ``echo``, the prompt's tokens come first (their values are the prompt logprobs below; the first prompt token's
  ``token_logprobs`` and ``top_logprobs`` items are null, as OpenAI's and vLLM's), then the completion's.
- Prompt (vLLM's ``prompt_logprobs: k``): ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]``,
  one per prompt token, each dict holding the prompt token and its k most likely alternatives.

A token's string is its bytes (:meth:`~draftwise.server.text.TextCodec.token_bytes`) decoded as UTF-8, a partial
character as U+FFFD (``bytes`` carries the exact bytes). JSON has no -inf: a value below -9999.0 is sent as -9999.0,
as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from draftwise.logprobs import TokenLogprob

__all__ = ["TokenBytes", "chat_entries", "chat_logprobs", "CompletionLogprobs", "joined_logprobs",
           "prompt_logprobs_field", "LOWEST_LOGPROB"]

#: The lowest value sent (JSON cannot carry -inf).
LOWEST_LOGPROB = -9999.0

#: token ids -> each token's bytes (:meth:`draftwise.server.text.TextCodec.token_bytes` with the vocabulary bound).
TokenBytes = Callable[[Sequence[int]], list[bytes]]


def _value(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _entry(raw: bytes, logprob: float) -> dict[str, Any]:
    return {"token": _text(raw), "logprob": _value(logprob), "bytes": list(raw)}


def chat_entries(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content`` items (and the Responses API's ``logprobs`` items) for ``entries``."""
    items = []
    for entry in entries:
        raws = token_bytes([entry.token_id, *(token for token, _ in entry.top)])
        item = _entry(raws[0], entry.logprob)
        item["top_logprobs"] = [_entry(raw, logprob) for raw, (_, logprob) in zip(raws[1:], entry.top)]
        items.append(item)
    return items


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs`` object."""
    return {"content": chat_entries(entries, token_bytes), "refusal": None}


class CompletionLogprobs:
    """A completion's ``logprobs`` objects, chunk after chunk: ``text_offset`` counts the characters of the
    tokens before, from 0 at the first token given (the completion's, or with ``echo`` the prompt's: vLLM's
    convention).

    Args:
        token_bytes: ids -> bytes.
    """

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._offset = 0

    def next(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` object of the next ``entries`` (a chunk's tokens, or the whole completion's)."""
        return self._object([(entry.token_id, entry) for entry in entries])

    def prompt(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None], num_top: int,
               ) -> dict[str, Any]:
        """The ``logprobs`` object of the echoed prompt (``echo``), to come before the completion's: token i of
        ``token_ids`` with ``entries[i]`` (the engine's prompt logprobs; None, the first token's: its value and
        alternatives are null), each with at most ``num_top`` alternatives.

        Raises:
            ValueError: not one entry per token.
        """
        if len(entries) != len(token_ids):
            raise ValueError(f"{len(entries)} prompt logprobs for {len(token_ids)} prompt tokens")
        return self._object([(token, None if entry is None else replace(entry, top=entry.top[:num_top]))
                             for token, entry in zip(token_ids, entries)])

    def _object(self, positions: Sequence[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for token_id, entry in positions:
            top = entry.top if entry is not None else ()
            raws = self._token_bytes([token_id, *(token for token, _ in top)])
            text = _text(raws[0])
            alternatives = None
            if entry is not None:
                alternatives = {_text(raw): _value(logprob) for raw, (_, logprob) in zip(raws[1:], top)}
                alternatives.setdefault(text, _value(entry.logprob))  # the chosen token is always there
            tokens.append(text)
            values.append(None if entry is None else _value(entry.logprob))
            tops.append(alternatives)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def joined_logprobs(*objects: dict[str, Any]) -> dict[str, Any]:
    """Completions ``logprobs`` objects one after the other (the echoed prompt's, then the completion's) as one."""
    return {key: [item for obj in objects for item in obj[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def prompt_logprobs_field(entries: Sequence[TokenLogprob | None], token_bytes: TokenBytes,
                          num_top: int | None = None) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob", "rank",
    "decoded_token"}}`` for the prompt token and its alternatives (at most ``num_top``, None: all the entry has;
    an alternative's rank is its place, from 1)."""
    field: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            field.append(None)
            continue
        top = entry.top if num_top is None else entry.top[:num_top]
        raws = token_bytes([entry.token_id, *(token for token, _ in top)])
        ranked = {str(entry.token_id): {"logprob": _value(entry.logprob), "rank": entry.rank,
                                        "decoded_token": _text(raws[0])}}
        for place, (raw, (token, logprob)) in enumerate(zip(raws[1:], top), start=1):
            ranked.setdefault(str(token), {"logprob": _value(logprob), "rank": place, "decoded_token": _text(raw)})
        field.append(ranked)
    return field
