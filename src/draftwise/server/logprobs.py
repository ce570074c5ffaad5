"""Log-probabilities in OpenAI's and vLLM's response formats (the values are the engine's,
:mod:`draftwise.logprobs`, which defines them).

- Chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}, ...]}], "refusal": null}``, one entry per generated token; the Responses API's
  ``output_text.logprobs`` entries have the same shape (:func:`chat_entries`).
- Completions (``logprobs: k``): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``,
  each position's dict holding its k most likely tokens and the chosen one (OpenAI's "up to logprobs + 1").
- Prompt (vLLM's ``prompt_logprobs: k``): ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]``,
  one per prompt token, each dict holding the prompt token and its k most likely alternatives.

A token's string is its bytes (:meth:`~draftwise.server.text.TextCodec.token_bytes`) decoded as UTF-8, a partial
character as U+FFFD (``bytes`` carries the exact bytes). JSON has no -inf: a value below -9999.0 is sent as -9999.0,
as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from draftwise.logprobs import TokenLogprob

__all__ = ["TokenBytes", "chat_entries", "chat_logprobs", "CompletionLogprobs", "prompt_logprobs_field",
           "LOWEST_LOGPROB"]

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
    tokens before, from 0 at the completion's first token (vLLM's convention without ``echo``).

    Args:
        token_bytes: ids -> bytes.
    """

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._offset = 0

    def next(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        """The ``logprobs`` object of the next ``entries`` (a chunk's tokens, or the whole completion's)."""
        tokens, values, tops, offsets = [], [], [], []
        for entry in entries:
            raws = self._token_bytes([entry.token_id, *(token for token, _ in entry.top)])
            text = _text(raws[0])
            alternatives = {_text(raw): _value(logprob) for raw, (_, logprob) in zip(raws[1:], entry.top)}
            alternatives.setdefault(text, _value(entry.logprob))  # the chosen token is always there
            tokens.append(text)
            values.append(_value(entry.logprob))
            tops.append(alternatives)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_field(entries: Sequence[TokenLogprob | None], token_bytes: TokenBytes,
                          ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob", "rank",
    "decoded_token"}}`` for the prompt token and its alternatives (an alternative's rank is its place, from 1)."""
    field: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            field.append(None)
            continue
        raws = token_bytes([entry.token_id, *(token for token, _ in entry.top)])
        ranked = {str(entry.token_id): {"logprob": _value(entry.logprob), "rank": entry.rank,
                                        "decoded_token": _text(raws[0])}}
        for place, (raw, (token, logprob)) in enumerate(zip(raws[1:], entry.top), start=1):
            ranked.setdefault(str(token), {"logprob": _value(logprob), "rank": place, "decoded_token": _text(raw)})
        field.append(ranked)
    return field
