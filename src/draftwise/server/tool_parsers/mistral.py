"""The Mistral tool-call format of its v3 tokenizers (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo / Small):
``[TOOL_CALLS]`` followed by a JSON array of ``{"name": ..., "arguments": {...}}`` objects (a single object
is read too), as vLLM's ``mistral`` parser reads it. The text before the marker and after the array is
content. Calls read before a malformed element are kept; from there on the text is content. Call ids are 9
letters and digits, the only ids Mistral's chat templates accept in the history.

``[TOOL_CALLS]`` is a control token: the reply must be decoded with special tokens kept for this parser to
see it. The newer ``[TOOL_CALLS]name[ARGS]{...}`` form (v11+ tokenizers) is not read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftwise.server.tool_parsers.base import (
    CallPiece, HeldPiece, Piece, TextPiece, ToolParser, call_schema, forced_functions, longest_marker_prefix,
)
from draftwise.server.tool_parsers.call_json import read_call_object, skip_whitespace
from draftwise.structured.spec import Concat, GrammarSpec, JsonSchema, Literal

__all__ = ["MistralToolParser"]

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` + a JSON array of calls (Mistral v3 tokenizers)."""

    name = "mistral"
    call_id_prefix = ""
    call_id_length = 9

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while True:
            marker = text.find(MARKER, pos)
            if marker < 0:
                rest = text[pos:]
                held = 0 if final else longest_marker_prefix(rest, MARKER)
                return pieces + [TextPiece(rest[:len(rest) - held]), HeldPiece(rest[len(rest) - held:])]
            pieces.append(TextPiece(text[pos:marker]))
            opening = skip_whitespace(text, marker + len(MARKER))
            if opening == len(text):
                return pieces + ([TextPiece(text[marker:])] if final else [HeldPiece(text[marker:])])
            if text[opening] == "{":
                calls, pos, tail = _read_elements(text, opening, final, single=True)
            elif text[opening] == "[":
                calls, pos, tail = _read_elements(text, opening + 1, final, single=False)
            else:
                calls, pos, tail = [], opening, "invalid"
            pieces.extend(calls)
            if tail == "next":
                continue
            start = pos if calls else marker
            if tail == "held":
                return pieces + [HeldPiece(text[start:])]
            if tail == "open":
                return pieces
            return pieces + [TextPiece(text[start:])]

    def call_grammar(self, tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any],
                     parallel_tool_calls: bool = True) -> GrammarSpec | None:
        """``[TOOL_CALLS] `` + a JSON array of calls (exactly one unless ``"required"`` with
        ``parallel_tool_calls``). The marker is a control token: a grammar engine must be able to emit it."""
        functions = forced_functions(tools, tool_choice)
        if functions is None:
            return None
        schemas = [call_schema(function) for function in functions]
        items = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if not (tool_choice == "required" and parallel_tool_calls):
            array["maxItems"] = 1
        return Concat((Literal(MARKER + " "), JsonSchema(array)))


def _read_elements(text: str, pos: int, final: bool, single: bool) -> tuple[list[Piece], int, str]:
    """The calls of one ``[TOOL_CALLS]`` group from ``pos`` (the first element, or the single object).

    Returns:
        ``(calls, pos, tail)``: ``tail`` is ``next`` (the group ended; ``pos`` is just after it), ``open``
        (the last call is still growing), ``held`` (undecided from ``pos``) or ``invalid`` (content from
        ``pos``, where the last good call ended).
    """
    calls: list[Piece] = []
    while True:
        element = skip_whitespace(text, pos)
        if not calls and not single and text.startswith("]", element):
            return calls, pos, "invalid"  # an empty array is no call
        read = read_call_object(text, element, final)
        if read.status == "pending":
            return calls, pos, "held"
        if read.status == "invalid":
            return calls, pos, "invalid"
        calls.append(CallPiece(element, read.name, read.arguments, done=read.status == "done"))
        if read.status == "open":
            return calls, pos, "open"
        if single:
            return calls, read.end, "next"
        after = skip_whitespace(text, read.end)
        if after == len(text):
            return calls, read.end, "invalid" if final else "held"
        if text[after] == "]":
            return calls, after + 1, "next"
        if text[after] != ",":
            return calls, read.end, "invalid"
        pos = after + 1
