"""OpenAI chat messages and tools -> what a Hugging Face chat template expects.

Hugging Face templates (``tokenizer.apply_chat_template(messages, tools=...)``) take tools as OpenAI's
``{"type": "function", "function": {...}}`` dicts, an assistant turn's calls as ``tool_calls`` whose
``function.arguments`` is a dict (the templates write it with ``tojson``), and tool results as
``{"role": "tool", "content", "tool_call_id", "name"}`` messages (transformers' "Tool use" chat-templating
guide; vLLM's chat utilities convert the same way). OpenAI's legacy ``functions`` / ``function_call`` fields
and ``function`` messages become ``tools`` / ``tool_choice`` / ``tool`` messages.

Every function here takes the request's plain dicts (after pydantic validation, e.g. ``model_dump()``) and
raises :class:`MessageError` (a ``ValueError`` naming the offending field, for a 400) on what it cannot use.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["MessageError", "template_messages", "normalize_tools", "normalize_tool_choice", "message_text"]

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class MessageError(ValueError):
    """A request field a chat template cannot be given.

    Attributes:
        param: the field, as ``messages[2].tool_calls[0].function.arguments``.
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them.

    Each becomes ``{"role", "content": str}`` (text parts joined by newlines; ``developer`` is ``system``),
    plus, for an assistant turn, ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
    "arguments": dict}}]``, from ``tool_calls`` or the legacy ``function_call``), and for a tool result
    (``tool``, or the legacy ``function``) ``tool_call_id`` and ``name`` (taken from the call it answers
    when not given). An assistant turn with calls and no content gets ``content: ""``.

    Args:
        messages: OpenAI chat messages as dicts.

    Raises:
        MessageError: an unknown role; content missing (except on an assistant turn) or with a non-text part;
            a call without a function name; arguments that are not JSON (naming
            ``messages[i].tool_calls[j].function.arguments``); a ``tool`` message without ``tool_call_id``.
    """
    converted: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ROLES:
            raise MessageError(f"messages[{i}] has an unknown role {role!r}", f"messages[{i}].role")
        if role == "assistant":
            out = _assistant_message(message, i)
            call_names.update((call["id"], call["function"]["name"]) for call in out.get("tool_calls", ())
                              if call.get("id"))
        elif role in ("tool", "function"):
            out = _tool_message(message, i, call_names)
        else:
            out = {"role": "system" if role == "developer" else role, "content": message_text(message, i)}
        converted.append(out)
    return converted


def message_text(message: dict[str, Any], index: int) -> str:
    """A message's ``content`` as one string: a string as is, text parts joined by newlines.

    Raises:
        MessageError: no content on a message other than an assistant turn; a part that is not text.
    """
    content = message.get("content")
    if content is None:
        if message.get("role") != "assistant":
            raise MessageError(f"messages[{index}] ('{message.get('role')}') needs a 'content'",
                               f"messages[{index}]")
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise MessageError(f"only text content parts are supported (messages[{index}].content[{j}] is "
                               f"{kind!r})", f"messages[{index}].content")
        if not isinstance(part.get("text"), str):
            raise MessageError(f"messages[{index}].content[{j}] is a text part without 'text'",
                               f"messages[{index}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def _assistant_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message_text(message, index)}
    calls = message.get("tool_calls")
    if calls is None and message.get("function_call") is not None:
        calls = [{"type": "function", "function": message["function_call"]}]
        field = f"messages[{index}].function_call"
        out["tool_calls"] = [_template_call(calls[0], field, field)]
    elif calls:
        out["tool_calls"] = [_template_call(call, f"messages[{index}].tool_calls[{j}]",
                                            f"messages[{index}].tool_calls[{j}].function")
                             for j, call in enumerate(calls)]
    return out


def _template_call(call: Any, field: str, function_field: str) -> dict[str, Any]:
    """One OpenAI call -> ``{"id", "type": "function", "function": {"name", "arguments": parsed}}`` (no ``id``
    when the call had none, as legacy ``function_call`` turns). Arguments that are not JSON (a call cut by
    ``max_tokens``, which a streaming client received in part and sends back) stay the string they were: the
    template writes them as the model emitted them, and the agent's loop goes on."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise MessageError(f"{field} needs a function with a 'name'", f"{function_field}.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            logger.info("%s.arguments is not JSON; written into the prompt as the string it is", function_field)
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id"):
        out = {"id": call["id"], **out}
    return out


def _tool_message(message: dict[str, Any], index: int, call_names: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "tool", "content": message_text(message, index)}
    if message.get("role") == "function":  # legacy: answered by name, no call id
        if not message.get("name"):
            raise MessageError(f"messages[{index}] ('function') needs a 'name'", f"messages[{index}].name")
        out["name"] = message["name"]
        return out
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise MessageError(f"messages[{index}] ('tool') needs a 'tool_call_id'", f"messages[{index}].tool_call_id")
    out["tool_call_id"] = call_id
    name = message.get("name") or call_names.get(call_id)
    if name:
        out["name"] = name
    return out


def normalize_tools(tools: list[Any] | None, functions: list[Any] | None = None) -> list[dict[str, Any]] | None:
    """A request's ``tools`` (or legacy ``functions``) as ``[{"type": "function", "function": {"name",
    "description"?, "parameters", "strict"?}}]``, the form chat templates and
    :meth:`~draftwise.server.tool_parsers.base.ToolParser.call_grammar` take; None when there are none.
    ``parameters`` defaults to an object without properties.

    Raises:
        MessageError: both fields given; a tool that is not a function; a name OpenAI would refuse
            (``[a-zA-Z0-9_-]{1,64}``) or given twice; ``parameters`` that is not an object schema (a dict).
    """
    if tools and functions:
        raise MessageError("send 'tools' or the legacy 'functions', not both", "functions")
    field = "tools" if tools else "functions"
    entries = tools or [{"type": "function", "function": function} for function in functions or ()]
    if not entries:
        return None
    normalized: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(entries):
        where = f"{field}[{i}]" + (".function" if field == "tools" else "")
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise MessageError(f"{field}[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"{field}[{i}]")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise MessageError(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}", f"{where}.name")
        if name in seen:
            raise MessageError(f"{where}.name {name!r} is given twice", f"{where}.name")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        elif not isinstance(parameters, dict):
            raise MessageError(f"{where}.parameters must be a JSON Schema object", f"{where}.parameters")
        out = {"name": name, "parameters": parameters}
        if isinstance(function.get("description"), str):
            out = {"name": name, "description": function["description"], "parameters": parameters}
        if function.get("strict") is not None:
            out["strict"] = bool(function["strict"])
        normalized.append({"type": "function", "function": out})
    return normalized


def normalize_tool_choice(tool_choice: Any, function_call: Any, tools: list[dict[str, Any]] | None
                          ) -> str | dict[str, Any]:
    """A request's ``tool_choice`` (or legacy ``function_call``) as ``"none"``, ``"auto"``, ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``. Unset: ``"auto"`` with tools, ``"none"`` without
    (OpenAI's defaults).

    Args:
        tool_choice: the request's ``tool_choice`` (None when absent).
        function_call: the legacy ``function_call`` (None when absent): ``"none"``, ``"auto"`` or
            ``{"name": ...}``.
        tools: the normalized tools (:func:`normalize_tools`).

    Raises:
        MessageError: both fields given; an unknown value; ``"required"`` or a named function without tools,
            or naming a function that is not among them.
    """
    if tool_choice is not None and function_call is not None:
        raise MessageError("send 'tool_choice' or the legacy 'function_call', not both", "function_call")
    field = "tool_choice" if function_call is None else "function_call"
    choice = tool_choice if function_call is None else function_call
    if isinstance(choice, dict) and field == "function_call":
        choice = {"type": "function", "function": choice}
    if choice is None:
        return "auto" if tools else "none"
    names = {tool["function"]["name"] for tool in tools or ()}
    if choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise MessageError(f"{field} 'required' needs 'tools'", field)
        return choice
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise MessageError(f"{field} must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", field)
    if function["name"] not in names:
        raise MessageError(f"{field} names the function {function['name']!r}, which is not in 'tools'", field)
    return {"type": "function", "function": {"name": function["name"]}}
