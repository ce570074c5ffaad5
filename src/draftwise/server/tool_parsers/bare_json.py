"""Calls written as bare JSON: a reply that opens with ``{"name": <a tool of the request>, "arguments": {...}}``,
alone or in a Markdown code fence (```` ```json ````), read as a call even though it lacks the model's own
call markers.

Small instruction-tuned coders do this when tools are offered and the call is not forced: Qwen2.5-Coder-1.5B,
asked in ``tool_choice: "auto"`` with Qwen's Hermes-style template, answers a request for a tool with a fenced
``{"name", "arguments"}`` object instead of a ``<tool_call>`` block, so an agent that waits for
``message.tool_calls`` sees only text and stops. Ollama and llama.cpp's server read such replies as calls for
the same reason; vLLM's ``hermes`` parser does not.

The rule is narrow on purpose, so ordinary text never turns into a call: the reply's first non-whitespace
characters open the object (or a fence of language ``json`` or none, holding it), the object parses as a call
(:func:`~draftwise.server.tool_parsers.call_json.read_call_object`), and its ``name`` is one of the request's
tools. Several such objects in a row (each fenced or not) are several calls; the text after the last one is
content. A reply that starts any other way, or whose first object is not such a call, is read by the model's
own format (:class:`BareJsonFallback` wraps it), unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from draftwise.server.tool_parsers.base import CallPiece, HeldPiece, Piece, TextPiece, ToolParser
from draftwise.server.tool_parsers.call_json import read_call_object, skip_whitespace
from draftwise.structured.spec import GrammarSpec

__all__ = ["BareJsonFallback"]

FENCE = "```"
_FENCE_OPEN = re.compile(r"```[ \t]*(json)?[ \t]*\r?\n", re.IGNORECASE)
_FENCE_HEAD = re.compile(r"```[ \t]*[A-Za-z_]*[ \t]*\r?$")  # a fence whose opening line is not finished yet


class BareJsonFallback(ToolParser):
    """One request's reader of calls: bare or fenced JSON calls of ``tool_names`` at the start of the reply
    (see the module docstring), else the model's own format ``parser``.

    Args:
        parser: the model's tool-call format (its calls, grammar and call ids are used unchanged).
        tool_names: the function names of the request's tools; an object naming anything else is not a call.
    """

    def __init__(self, parser: ToolParser, tool_names: Collection[str]) -> None:
        self.parser = parser
        self.tool_names = frozenset(tool_names)
        self.name = parser.name
        self.reads_bare_json = True  # wrapped once
        self.call_id_prefix = parser.call_id_prefix
        self.call_id_length = parser.call_id_length

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces = self._bare_calls(text, final)
        return self.parser.scan(text, final) if pieces is None else pieces

    def call_grammar(self, tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any],
                     parallel_tool_calls: bool = True) -> GrammarSpec | None:
        """The model's own format's grammar (a forced call is written in that format, never bare)."""
        return self.parser.call_grammar(tools, tool_choice, parallel_tool_calls)

    def _bare_calls(self, text: str, final: bool) -> list[Piece] | None:
        """The pieces of a reply that opens with bare calls; None when it does not (the model's own format
        reads it). Not ``final``, text that may still become such a call is held back whole."""
        pieces: list[Piece] = []
        pos = skip_whitespace(text, 0)
        while True:
            start = pos
            fenced, pos = _open_fence(text, pos, final)
            if pos is None:  # an unfinished fence line (never when final)
                return pieces + [HeldPiece(text[start:])]
            if fenced is None:  # neither a fence nor an object here
                return _rest(pieces, text, start)
            pos = skip_whitespace(text, pos)
            read = read_call_object(text, pos, final)
            if read.status == "pending":
                return pieces + [HeldPiece(text[start:])]
            if read.status == "open" and read.name in self.tool_names:
                return pieces + [CallPiece(pos, read.name, read.arguments, done=False)]
            if read.status != "done" or read.name not in self.tool_names:
                return _rest(pieces, text, start)
            after = skip_whitespace(text, read.end)
            if fenced:
                if text.startswith(FENCE, after):
                    after += len(FENCE)
                elif not final and FENCE.startswith(text[after:]):
                    return pieces + [CallPiece(pos, read.name, read.arguments, done=True),
                                     HeldPiece(text[read.end:])]
            pieces.append(CallPiece(pos, read.name, read.arguments, done=True))
            pos = skip_whitespace(text, after)
            if pos == len(text):
                return pieces if final else pieces + [HeldPiece(text[after:])]


def _open_fence(text: str, pos: int, final: bool) -> tuple[bool | None, int | None]:
    """What opens at ``pos``: ``(True, after the fence line)`` for a ``json`` (or unnamed) fence, ``(False,
    pos)`` for an object's ``{``, ``(None, pos)`` for anything else, ``(True, None)`` when a fence's first line
    is not finished yet (not ``final``)."""
    if text.startswith("{", pos):
        return False, pos
    match = _FENCE_OPEN.match(text, pos)
    if match is not None:
        return True, match.end()
    rest = text[pos:]
    if not final and rest and (FENCE.startswith(rest) or _FENCE_HEAD.match(rest)):
        return True, None
    return None, pos


def _rest(pieces: list[Piece], text: str, start: int) -> list[Piece] | None:
    """After the calls read so far, the text from ``start`` is content; with no call read, the reply is not a
    bare-call reply (None)."""
    if not pieces:
        return None
    return pieces + [TextPiece(text[start:])]
