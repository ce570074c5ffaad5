"""The Llama 3.1 / 3.2 / 3.3 JSON tool-call format: the reply is one or more ``{"name": ...,
"parameters": {...}}`` objects separated by ``;`` (Meta's templates ask for ``parameters``; ``arguments`` is
read too), optionally after ``<|python_tag|>``, as vLLM's ``llama3_json`` parser reads it. Without the tag the
calls must open the reply (after whitespace); with it, the text before the tag is content. Text after the
calls is content. A first object that is not a call makes the whole reply (from the tag, with it) content.

``<|python_tag|>`` is a special token: decoded with ``skip_special_tokens`` it is gone and the reply simply
starts with the JSON, which this parser reads the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftwise.server.tool_parsers.base import (
    CallPiece, HeldPiece, Piece, TextPiece, ToolParser, calls_schema, forced_functions, longest_marker_prefix,
)
from draftwise.server.tool_parsers.call_json import read_call_object, skip_whitespace
from draftwise.structured.spec import GrammarSpec, JsonSchema, Repeat

__all__ = ["Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(ToolParser):
    """JSON calls with ``parameters`` (Llama 3.x), separated by ``;``."""

    name = "llama3_json"
    reads_bare_json = True

    def scan(self, text: str, final: bool) -> list[Piece]:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            region = tag
            pos = skip_whitespace(text, tag + len(PYTHON_TAG))
        else:
            region = 0
            pos = skip_whitespace(text, 0)
            if pos < len(text) and text[pos] != "{":
                return _content(text, 0, final)
        pieces: list[Piece] = [TextPiece(text[:region])]
        calls = 0
        while True:
            read = read_call_object(text, pos, final)
            if read.status == "pending":
                return pieces + [HeldPiece(text[pos if calls else region:])]
            if read.status == "open":
                return pieces + [CallPiece(pos, read.name, read.arguments, done=False)]
            if read.status == "invalid":
                return pieces + _content(text, pos if calls else region, final)
            pieces.append(CallPiece(pos, read.name, read.arguments, done=True))
            calls += 1
            after = skip_whitespace(text, read.end)
            if not text.startswith(SEPARATOR, after):
                return pieces + _content(text, read.end, final)
            pos = skip_whitespace(text, after + len(SEPARATOR))
            if pos == len(text):  # a trailing separator: more calls may follow; finished, it is dropped
                return pieces if final else pieces + [HeldPiece(text[read.end:])]

    def call_grammar(self, tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any],
                     parallel_tool_calls: bool = True) -> GrammarSpec | None:
        """The call's JSON (``{"name", "parameters"}``); with ``"required"`` and ``parallel_tool_calls``, one or
        more separated by ``"; "``."""
        functions = forced_functions(tools, tool_choice)
        if functions is None:
            return None
        call = JsonSchema(calls_schema(functions, arguments_key="parameters"))
        if tool_choice == "required" and parallel_tool_calls:
            return Repeat(call, min_count=1, max_count=None, separator=SEPARATOR + " ")
        return call


def _content(text: str, start: int, final: bool) -> list[Piece]:
    """``text[start:]`` as content; not ``final``, a partial ``<|python_tag|>`` at its end is held back."""
    held = 0 if final else longest_marker_prefix(text[start:], PYTHON_TAG)
    return [TextPiece(text[start:len(text) - held]), HeldPiece(text[len(text) - held:])]
