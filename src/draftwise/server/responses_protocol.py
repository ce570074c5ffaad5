"""``POST /v1/responses``: the request subset draftwise serves, as pydantic models, and its input items.

The subset is what the Codex CLI and the OpenAI Agents SDK (``OpenAIResponsesModel``) send: ``instructions``;
``input`` as a string or a list of items (``message``, ``function_call``, ``function_call_output``, and the
SDK's shorthand ``{"role": ..., "content": ...}`` without ``type``); function ``tools`` in the Responses' flat
shape, ``tool_choice``, ``parallel_tool_calls``; ``text.format``; ``max_output_tokens``, ``temperature``,
``top_p``; ``stream``, ``store``, ``previous_response_id``, ``user``, ``metadata``; ``include:
["message.output_text.logprobs"]`` with ``top_logprobs`` (the output text's token logprobs). ``reasoning``,
``truncation`` and the other ``include`` values are accepted and have no effect (the served models have no
reasoning mode, nothing is truncated, and nothing else can be included); Codex sends all three on every call.

:class:`ResponsesRequest` checks the top-level shape (a wrong type is a validation error, so a 400 naming the
field, like the chat endpoint's). The items, tools, ``tool_choice`` and ``text.format`` are read by
:func:`input_items`, :func:`function_tools`, :func:`tool_choice` and :func:`text_format`, which raise
:class:`ResponsesInputError` naming the field in OpenAI's form (``input[2].content[0].type``): an item type the
server cannot serve (images, files, hosted tools, reasoning items with content) is refused there, never dropped.
The shapes follow the ``openai`` SDK's ``openai.types.responses`` (``ResponseCreateParams``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from draftwise.server.protocol import Text

__all__ = [
    "ResponsesInputError", "ResponsesRequest", "ContentPart", "MessageItem", "FunctionCallItem",
    "FunctionCallOutputItem", "InputItem", "FunctionTool", "input_items", "parse_item", "function_tools",
    "tool_choice", "text_format",
]


class ResponsesInputError(ValueError):
    """A ``/v1/responses`` request the server cannot serve (answered with a 400).

    Args:
        message: what is wrong and what to send instead.
        param: the field at fault in OpenAI's notation (``input[2].content[0].type``, ``previous_response_id``).
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class ResponsesRequest(_Strict):
    """The body of ``POST /v1/responses``. ``store`` unset means true (OpenAI's default).

    Fields OpenAI defines and this server cannot honour (``conversation``, ``prompt``, ``background``) are
    refused by :func:`draftwise.server.responses_api.to_chat`; unknown fields are accepted and ignored.
    """

    model: Text | None = None
    instructions: Text | None = None
    input: Text | list[dict[str, Any]] | None = None  # none: only the previous response's conversation
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: Text | None = None
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Text] | None = None
    top_logprobs: int | None = None  # with include "message.output_text.logprobs": alternatives per token (0..20)


# ---------------------------------------------------------------------- input items
class ContentPart(_Strict):
    """A text part of a message: ``input_text`` (user, system, developer) or ``output_text`` (assistant)."""

    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(_Strict):
    """A ``message`` item (also the shorthand without ``type``). ``content``: a string or text parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]


class FunctionCallItem(_Strict):
    """A ``function_call`` item: a call the model made (``arguments``: a JSON string)."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(_Strict):
    """A ``function_call_output`` item: the result of the call ``call_id`` (a string or ``input_text`` parts)."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentPart]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
"""One conversation item the server serves."""

_ITEM_MODELS: dict[str, type[_Strict]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio"}


def input_items(request: ResponsesRequest) -> tuple[InputItem, ...]:
    """The request's ``input`` as items (a string is one user message, none is no item); reasoning items
    without content are dropped (they carry nothing a served model can read).

    Raises:
        ResponsesInputError: an item or content part the server cannot serve, or one of the wrong shape.
    """
    if isinstance(request.input, str):
        return (MessageItem(role="user", content=request.input),)
    items = []
    for index, raw in enumerate(request.input or ()):
        item = parse_item(raw, f"input[{index}]")
        if item is not None:
            items.append(item)
    return tuple(items)


def parse_item(raw: dict[str, Any], param: str) -> InputItem | None:
    """One input (or output) item as its model; None for a reasoning item without content.

    Args:
        raw: the item's JSON object.
        param: where the item is, for errors (``input[3]``).

    Raises:
        ResponsesInputError: an unsupported type or content part, or a malformed item.
    """
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "reasoning":
        if raw.get("content"):
            raise ResponsesInputError("reasoning items with content are not supported: the served models have no "
                                      "reasoning mode; leave the item out", f"{param}.content")
        return None
    model = _ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ResponsesInputError(f"input items of type {kind!r} are not supported (supported: message, "
                                  "function_call, function_call_output)", f"{param}.type")
    _refuse_media(raw, param)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise _input_error(exc, param) from None


def _refuse_media(raw: dict[str, Any], param: str) -> None:
    """Name the first image, file or audio part of a message's ``content`` or a call's ``output``."""
    for field in ("content", "output"):
        parts = raw.get(field)
        if not isinstance(parts, list):
            continue
        for index, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise ResponsesInputError(f"content parts of type {kind!r} are not supported: the served model "
                                          "reads text only", f"{param}.{field}[{index}].type")


def _input_error(exc: ValidationError, param: str) -> ResponsesInputError:
    """A pydantic error on an item as a :class:`ResponsesInputError` naming the field (``input[0].content``)."""
    first = max(exc.errors(), key=lambda error: len(error.get("loc", ())))  # the deepest: a union's own branch
    path = param
    for part in first.get("loc", ()):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part[:1].islower() and ("[" in part or part in ("str", "list", "function-after")):
            continue  # a union branch's name, not a field
        else:
            path += f".{part}"
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return ResponsesInputError(f"invalid value for '{path}': {message}", path)


# ---------------------------------------------------------------------- tools, tool_choice, text.format
class FunctionTool(_Strict):
    """A function tool in the Responses' flat shape. ``strict`` unset is passed on unset."""

    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def function_tools(request: ResponsesRequest) -> tuple[FunctionTool, ...]:
    """The request's ``tools``.

    Raises:
        ResponsesInputError: a tool that is not a function (``web_search``, ``file_search``, ``local_shell``,
            ``custom``, ``mcp``...: hosted or freeform tools the server does not run), or a malformed one.
    """
    tools = []
    for index, raw in enumerate(request.tools or ()):
        kind = raw.get("type")
        if kind != "function":
            raise ResponsesInputError(f"tools of type {kind!r} are not supported: only function tools "
                                      "('type': 'function') are served", f"tools[{index}].type")
        try:
            tools.append(FunctionTool.model_validate(raw))
        except ValidationError as exc:
            raise _input_error(exc, f"tools[{index}]") from None
    return tuple(tools)


def tool_choice(request: ResponsesRequest, tools: Sequence[FunctionTool]) -> str | dict[str, Any] | None:
    """The chat-completions ``tool_choice`` for the request's: ``auto`` / ``none`` / ``required`` as is, a named
    function ``{"type": "function", "name": n}`` as chat's ``{"type": "function", "function": {"name": n}}``.

    Raises:
        ResponsesInputError: another value (``allowed_tools``, hosted tool types), or a name not in ``tools``.
    """
    choice = request.tool_choice
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or name not in {tool.name for tool in tools}:
            raise ResponsesInputError(f"tool_choice names the function {name!r}, which is not among 'tools'",
                                      "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise ResponsesInputError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                              "tool_choice")


def text_format(request: ResponsesRequest) -> dict[str, Any] | None:
    """The chat-completions ``response_format`` for ``text.format`` (None for plain text): ``json_object`` as
    is, ``json_schema`` with its ``name``, ``schema``, ``strict`` and ``description`` nested under
    ``json_schema`` as chat has them.

    Raises:
        ResponsesInputError: another format type, or a ``json_schema`` without a ``name`` or an object ``schema``.
    """
    fmt = (request.text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ResponsesInputError("text.format.type must be 'text', 'json_object' or 'json_schema'",
                                  "text.format.type")
    if not isinstance(fmt.get("name"), str):
        raise ResponsesInputError("a json_schema format needs a 'name'", "text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise ResponsesInputError("a json_schema format needs a 'schema' object", "text.format.schema")
    schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if fmt.get(key) is not None}
    return {"type": "json_schema", "json_schema": schema}
