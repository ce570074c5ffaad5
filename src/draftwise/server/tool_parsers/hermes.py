"""The Hermes / Qwen2.5 tool-call format: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>``, several calls one after another (Qwen2.5's chat template asks for exactly this; vLLM's
``hermes`` parser reads the same). Text before, between and after calls is content. A block whose JSON is
not a call is content up to and including its ``</tool_call>``; an unterminated last block is a call when
its JSON is complete (generation stopped before ``</tool_call>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftwise.server.tool_parsers.base import (
    CallPiece, HeldPiece, Piece, TextPiece, ToolParser, calls_schema, forced_functions, longest_marker_prefix,
)
from draftwise.server.tool_parsers.call_json import read_call_object, skip_whitespace
from draftwise.structured.spec import Concat, GrammarSpec, JsonSchema, Literal, Repeat

__all__ = ["HermesToolParser"]

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    """``<tool_call>`` blocks holding ``{"name", "arguments"}`` JSON (Qwen2.5, Hermes 2 Pro / 3)."""

    name = "hermes"

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                return pieces + _plain_text(text[pos:], final)
            pieces.append(TextPiece(text[pos:start]))
            body = skip_whitespace(text, start + len(START))
            read = read_call_object(text, body, final)
            if read.status == "pending":
                return pieces + [HeldPiece(text[start:])]
            if read.status == "open":
                return pieces + [CallPiece(body, read.name, read.arguments, done=False)]
            if read.status == "done":
                after = skip_whitespace(text, read.end)
                call = CallPiece(body, read.name, read.arguments, done=True)
                if text.startswith(END, after):
                    pieces.append(call)
                    pos = after + len(END)
                    continue
                if after == len(text) and final:
                    return pieces + [call]
                if not final and END.startswith(text[after:]):
                    return pieces + [call, HeldPiece(text[read.end:])]
            close = text.find(END, start + len(START))
            if close < 0:  # not a call: content, to the end (whatever follows, the block holds it)
                return pieces + [TextPiece(text[start:])]
            pieces.append(TextPiece(text[start:close + len(END)]))
            pos = close + len(END)

    def call_grammar(self, tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any],
                     parallel_tool_calls: bool = True) -> GrammarSpec | None:
        """``<tool_call>\\n`` + the call's JSON + ``\\n</tool_call>``; with ``"required"`` and
        ``parallel_tool_calls``, one or more such blocks separated by ``\\n``."""
        functions = forced_functions(tools, tool_choice)
        if functions is None:
            return None
        call = Concat((Literal(START + "\n"), JsonSchema(calls_schema(functions)), Literal("\n" + END)))
        if tool_choice == "required" and parallel_tool_calls:
            return Repeat(call, min_count=1, max_count=None, separator="\n")
        return call


def _plain_text(text: str, final: bool) -> list[Piece]:
    """Text without a call marker; not ``final``: a partial ``<tool_call>`` at its end is held back."""
    held = 0 if final else longest_marker_prefix(text, START)
    if not held:
        return [TextPiece(text)]
    return [TextPiece(text[:-held]), HeldPiece(text[-held:])]
