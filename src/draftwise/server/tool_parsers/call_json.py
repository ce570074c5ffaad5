"""Reading one tool call's JSON object (``{"name": ..., "arguments": {...}}``) out of text that may still be
growing, the piece every tool-call format shares.

:func:`read_call_object` answers, for the text generated so far, whether the object at a position is not a
call (``invalid``), cannot be judged yet (``pending``), has a complete name and a growing arguments value
(``open``), or is a complete, valid call (``done``). The answers are stable as text is appended: ``invalid``
and ``done`` never change, and an ``open`` call's arguments only grow, so a streaming parser can send what an
answer shows. The one exception is a call that turns invalid after its name was complete (its arguments are
not valid JSON, or the text ends inside them); see :mod:`draftwise.server.tool_parsers.base`.

A call's ``arguments`` are the model's own text of the arguments object (not re-serialized), so what streams
out fragment by fragment is exactly the final string. When the object does not start with the ``name`` key
and an object-valued ``arguments`` (or ``parameters``) key, it is judged only once complete, and its
arguments are re-serialized with :func:`json.dumps`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

import regex

__all__ = ["ObjectRead", "read_call_object", "skip_json_value", "skip_whitespace", "ARGUMENT_KEYS"]

ARGUMENT_KEYS = ("arguments", "parameters")
"""The keys a call object may carry its arguments under (Hermes/Mistral: ``arguments``; Llama 3.x:
``parameters``)."""

# `{"name": "<json string>", "arguments": ` with JSON whitespace anywhere JSON allows it. Matched with
# partial=True, so a prefix of it (the text so far) is told apart from text that can never become it.
_HEAD = regex.compile(
    r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*"((?:[^"\\\x00-\x1f]|\\.)*)"[ \t\n\r]*,[ \t\n\r]*'
    r'"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*'
)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: one step per run of plain characters
_STRUCTURE = re.compile(r'["{}\[\]]')
_WHITESPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class ObjectRead:
    """What the text holds at one position.

    Attributes:
        status: ``invalid`` (not a call, whatever follows), ``pending`` (may become a call; nothing to show
            yet), ``open`` (name complete, arguments growing), ``done`` (a complete, valid call).
        name: the function name (``open`` and ``done``).
        arguments: ``open``: the arguments text so far (a prefix of the final one); ``done``: the arguments
            as a JSON string.
        end: ``done``: the index just after the object's closing brace.
    """

    status: Literal["invalid", "pending", "open", "done"]
    name: str | None = None
    arguments: str = ""
    end: int = 0


_INVALID = ObjectRead("invalid")
_PENDING = ObjectRead("pending")


def skip_whitespace(text: str, pos: int) -> int:
    """The index of the first non-JSON-whitespace character at or after ``pos`` (``len(text)`` if none)."""
    return _WHITESPACE.match(text, pos).end()


def skip_json_value(text: str, pos: int) -> int | None:
    """Where the JSON string, object or array starting at ``text[pos]`` ends, read by structure only
    (strings, escapes, bracket nesting; the values inside are not checked).

    Returns:
        The index just after the value; None when the text ends inside it; -1 when it is not a string,
        object or array, or its brackets do not match.
    """
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        match = _STRING.match(text, pos)
        return match.end() if match else None
    if first not in "{[":
        return -1
    closers: list[str] = []
    while True:
        found = _STRUCTURE.search(text, pos)
        if found is None:
            return None
        pos, char = found.start(), found.group()
        if char == '"':
            match = _STRING.match(text, pos)
            if match is None:
                return None
            pos = match.end()
            continue
        if char in "{[":
            closers.append("}" if char == "{" else "]")
        elif not closers or closers.pop() != char:
            return -1
        elif not closers:
            return pos + 1
        pos += 1


def read_call_object(text: str, pos: int, final: bool) -> ObjectRead:
    """Read the call object that should start at ``text[pos]``.

    Args:
        text: the generated text so far.
        pos: where the object should start (its ``{``).
        final: True when ``text`` is complete (then the answer is ``invalid`` or ``done``).
    """
    if pos >= len(text):
        return _INVALID if final else _PENDING
    head = _HEAD.match(text, pos, partial=True)
    if head is not None and head.partial:
        return _INVALID if final else _PENDING
    if head is None:
        return _read_whole(text, pos, final)
    name = _json_string(head.group(1))
    value = skip_whitespace(text, head.end())
    if name is None:
        return _INVALID
    if value == len(text):
        return _INVALID if final else ObjectRead("open", name)
    if text[value] != "{":
        return _read_whole(text, pos, final)
    value_end = skip_json_value(text, value)
    if value_end is None:
        return _INVALID if final else ObjectRead("open", name, text[value:])
    if value_end < 0:
        return _INVALID
    arguments = text[value:value_end]
    end = skip_json_value(text, pos)
    if end is None:
        return _INVALID if final else ObjectRead("open", name, arguments)
    if end < 0:
        return _INVALID
    parsed = _call_fields(text[pos:end])
    if parsed is None or parsed[0] != name or not isinstance(parsed[1], dict):
        return _INVALID
    return ObjectRead("done", name, arguments, end)


def _read_whole(text: str, pos: int, final: bool) -> ObjectRead:
    """A call object in another key order, or with string arguments: judged once it is complete."""
    end = skip_json_value(text, pos) if text[pos] == "{" else -1
    if end is None:
        return _INVALID if final else _PENDING
    if end < 0:
        return _INVALID
    parsed = _call_fields(text[pos:end])
    if parsed is None:
        return _INVALID
    name, arguments = parsed
    if isinstance(arguments, dict):
        return ObjectRead("done", name, json.dumps(arguments, ensure_ascii=False), end)
    return ObjectRead("done", name, arguments, end)


def _call_fields(source: str) -> tuple[str, dict | str] | None:
    """``(name, arguments)`` of a call object's JSON text: a dict with a non-empty string ``name`` and an
    object under ``arguments`` or ``parameters`` (or a string holding a JSON object); None otherwise."""
    try:
        value = json.loads(source)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    keys = [key for key in ARGUMENT_KEYS if key in value]
    if len(keys) != 1:
        return None
    arguments = value[keys[0]]
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except ValueError:
            return None
        return (value["name"], arguments) if isinstance(decoded, dict) else None
    return (value["name"], arguments) if isinstance(arguments, dict) else None


def _json_string(body: str) -> str | None:
    """The text of a JSON string literal's body (between its quotes); None if its escapes are invalid or it
    is empty."""
    try:
        text = json.loads(f'"{body}"')
    except ValueError:
        return None
    return text or None
