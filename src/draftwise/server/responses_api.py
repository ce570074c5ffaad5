"""``/v1/responses`` served through chat completions: the request as a chat body, the chat result as a Response.

The Responses API is a second face of the same generation: :func:`to_chat` turns a request (plus the stored
conversation of its ``previous_response_id``) into the equivalent ``/v1/chat/completions`` body, the server
runs that, and :func:`build_response` (a finished chat completion) or
:class:`~draftwise.server.responses_stream.ResponsesStream` (its ``chat.completion.chunk`` stream) turns the
result into a Response object or the Responses events. This is how vLLM serves ``/v1/responses`` for chat
models (``vllm/entrypoints/openai/serving_responses.py``); the shapes are the ``openai`` SDK's
``openai.types.responses``.

Mapping: ``instructions`` is the first system message (instructions are not carried over from a previous
response, as OpenAI documents); a ``message`` item is a chat message (text parts as chat text parts); a run of
``function_call`` items is one assistant message with ``tool_calls`` (joined to the assistant text just before
it); a ``function_call_output`` is a ``tool`` message with ``tool_call_id``; tools are nested as chat's
``{"type": "function", "function": {...}}``; ``text.format`` is ``response_format``; ``max_output_tokens`` is
``max_tokens``. Output: the text (when there is any, or when there are no calls) is one ``message`` item with
one ``output_text`` part, then one ``function_call`` item per call; ``finish_reason: "length"`` makes the
Response ``incomplete`` with ``incomplete_details.reason: "max_output_tokens"``, its last item ``incomplete``.
Item ids derive from the response id (``msg_<id>_<index>``, ``fc_<id>_<index>``), so the streamed and the
non-streamed assembly of the same result are equal.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from draftwise.server.responses_protocol import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ResponsesInputError,
    ResponsesRequest,
    function_tools,
    input_items,
    parse_item,
    text_format,
    tool_choice,
)

__all__ = ["CHAT_EXTRAS", "ToolCall", "ChatOutcome", "new_response_id", "to_chat", "chat_messages",
           "build_response", "conversation", "item_id", "text_part", "message_item", "call_item",
           "responses_usage", "response_object"]

CHAT_EXTRAS = ("seed", "stop", "top_k", "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "sampling", "num_speculative_tokens")
"""Fields outside the Responses API passed on to the chat body when sent (the chat endpoint's sampling
extras, sent with the OpenAI client's ``extra_body``)."""

_UNSERVED = {"conversation": "conversations are not stored here; send the items, or 'previous_response_id'",
             "prompt": "stored prompts are not available here; send 'instructions' and 'input'",
             "background": "background responses are not supported; stream instead"}


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made: ``arguments`` is a JSON string (as the chat body has it)."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatOutcome:
    """A finished chat completion, as much of it as a Response needs.

    Attributes:
        model: the served model's name.
        text: the assistant content ("" when none).
        tool_calls: the calls, in order.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        usage: the chat ``usage`` object (``prompt_tokens``, ``completion_tokens``,
            ``prompt_tokens_details.cached_tokens``; draftwise's ``speculative`` is carried over).
        logprobs: the chat ``logprobs.content`` items (the reply's tokens), when the request included them.
    """

    model: str
    text: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    usage: dict[str, Any]
    logprobs: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_chat_body(cls, body: dict[str, Any]) -> ChatOutcome:
        """Read a ``chat.completion`` object (its first choice)."""
        choice = body["choices"][0]
        message = choice["message"]
        calls = tuple(ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"])
                      for call in message.get("tool_calls") or ())
        logprobs = tuple((choice.get("logprobs") or {}).get("content") or ())
        return cls(model=body["model"], text=message.get("content") or "", tool_calls=calls,
                   finish_reason=choice["finish_reason"], usage=body.get("usage") or {}, logprobs=logprobs)


def new_response_id() -> str:
    """A fresh ``resp_...`` id."""
    return f"resp_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------- request -> chat body
def to_chat(request: ResponsesRequest, history: Sequence[InputItem] = ()) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body equivalent to ``request``.

    Args:
        request: the validated request.
        history: the stored conversation of ``request.previous_response_id`` (its input and output items,
            :meth:`ResponseStore.history <draftwise.server.responses_store.ResponseStore.history>`); empty
            without one. It comes after ``instructions`` and before the request's ``input``.

    Returns:
        A JSON-able dict: ``messages``, and ``model``, ``tools``, ``tool_choice``, ``parallel_tool_calls``,
        ``response_format``, ``max_tokens``, ``temperature``, ``top_p``, ``user`` and :data:`CHAT_EXTRAS` when
        given; a streamed request also asks for ``stream_options.include_usage`` (the Responses events end
        with the usage).

    Raises:
        ResponsesInputError: a field, item, tool or format the server cannot serve, or no item at all (the
            message and ``param`` name it).
    """
    _refuse_unserved(request)
    tools = function_tools(request)
    items = (*history, *input_items(request))
    if not items:
        raise ResponsesInputError("'input' holds no message or call: send at least one", "input")
    body: dict[str, Any] = {"messages": chat_messages(request.instructions, items)}
    if request.model is not None:
        body["model"] = request.model
    if tools:
        body["tools"] = [_chat_tool(tool) for tool in tools]
    choice = tool_choice(request, tools)
    if choice is not None:
        body["tool_choice"] = choice
    if request.parallel_tool_calls is not None and tools:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    response_format = text_format(request)
    if response_format is not None:
        body["response_format"] = response_format
    if request.max_output_tokens is not None:
        if request.max_output_tokens < 1:
            raise ResponsesInputError("max_output_tokens must be at least 1", "max_output_tokens")
        body["max_tokens"] = request.max_output_tokens
    for field in ("temperature", "top_p", "user"):
        if getattr(request, field) is not None:
            body[field] = getattr(request, field)
    for field in CHAT_EXTRAS:
        if (request.model_extra or {}).get(field) is not None:
            body[field] = request.model_extra[field]
    body.update(_logprob_fields(request))
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


#: The ``include`` value that asks for the output text's token logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"


def _logprob_fields(request: ResponsesRequest) -> dict[str, Any]:
    """The chat fields for ``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` (which needs it).

    Raises:
        ResponsesInputError: ``top_logprobs`` > 0 without the include.
    """
    if INCLUDE_LOGPROBS not in (request.include or ()):
        if request.top_logprobs not in (None, 0):
            raise ResponsesInputError(f"'top_logprobs' needs 'include' to hold {INCLUDE_LOGPROBS!r}", "top_logprobs")
        return {}
    fields: dict[str, Any] = {"logprobs": True}
    if request.top_logprobs is not None:
        fields["top_logprobs"] = request.top_logprobs  # its range is checked as chat's top_logprobs
    return fields


def _refuse_unserved(request: ResponsesRequest) -> None:
    for field, reason in _UNSERVED.items():
        value = (request.model_extra or {}).get(field)
        if value not in (None, False):
            raise ResponsesInputError(f"'{field}' is not supported: {reason}", field)


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = {key: value for key, value in tool.model_dump(include={"name", "description", "parameters",
                                                                        "strict"}).items() if value is not None}
    return {"type": "function", "function": function}


def chat_messages(instructions: str | None, items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Chat messages for ``instructions`` (a first system message) and conversation items.

    Raises:
        ResponsesInputError: a ``function_call_output`` whose ``call_id`` no earlier ``function_call`` has
            (its call must be in ``input`` or in the previous response).
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    call_ids: set[str] = set()
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call_ids.add(item.call_id)
            _add_tool_call(messages, {"id": item.call_id, "type": "function",
                                      "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise ResponsesInputError(f"no function_call with call_id {item.call_id!r} precedes its "
                                          "function_call_output: send the call in 'input', or the id of the "
                                          "response that made it as 'previous_response_id'", "input")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
    return messages


def _chat_content(content: str | list[ContentPart]) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def _add_tool_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Join a call to the assistant message just before it (its text or earlier calls), else open one."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


# ---------------------------------------------------------------------- chat result -> Response
def build_response(request: ResponsesRequest, outcome: ChatOutcome, *, response_id: str,
                   created_at: float) -> dict[str, Any]:
    """The Response object (a JSON-able dict) for a finished chat completion.

    Args:
        request: the request it answers (echoed fields: ``instructions``, ``tools``, ``tool_choice``...).
        outcome: the chat result.
        response_id: its id (:func:`new_response_id`); item ids derive from it.
        created_at: when the request arrived (Unix seconds).
    """
    incomplete = outcome.finish_reason == "length"
    output: list[dict[str, Any]] = []
    if outcome.text or not outcome.tool_calls:
        output.append(message_item(item_id("msg", response_id, 0), outcome.text, "completed"))
        output[0]["content"][0]["logprobs"] = list(outcome.logprobs)  # every token of the reply
    for call in outcome.tool_calls:
        output.append(call_item(item_id("fc", response_id, len(output)), call, "completed"))
    if incomplete:
        output[-1]["status"] = "incomplete"
    return response_object(request, response_id, created_at, outcome.model, output,
                           "incomplete" if incomplete else "completed", responses_usage(outcome.usage))


def conversation(request: ResponsesRequest, history: Sequence[InputItem],
                 response: dict[str, Any]) -> tuple[InputItem, ...]:
    """The conversation to keep for ``response``: ``history``, the request's input items, the output items
    (``instructions`` are not kept: a next request sends its own)."""
    outputs = (parse_item(item, f"output[{index}]") for index, item in enumerate(response["output"]))
    return (*history, *input_items(request), *(item for item in outputs if item is not None))


def item_id(prefix: str, response_id: str, output_index: int) -> str:
    """An output item's id: ``<prefix>_<response id without resp_>_<output index>``."""
    return f"{prefix}_{response_id.removeprefix('resp_')}_{output_index}"


def text_part(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(identifier: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``message`` output item (``text`` None: no content part yet)."""
    return {"type": "message", "id": identifier, "status": status, "role": "assistant",
            "content": [] if text is None else [text_part(text)]}


def call_item(identifier: str, call: ToolCall, status: str) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"type": "function_call", "id": identifier, "call_id": call.call_id, "name": call.name,
            "arguments": call.arguments, "status": status}


def responses_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage as Responses usage (no reasoning tokens; cache writes are not counted here: 0)."""
    if not chat_usage:
        return None
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt + completion}
    if chat_usage.get("speculative") is not None:
        usage["speculative"] = chat_usage["speculative"]
    return usage


def response_object(request: ResponsesRequest, response_id: str, created_at: float, model: str,
                    output: list[dict[str, Any]], status: str, usage: dict[str, Any] | None,
                    error: dict[str, str] | None = None) -> dict[str, Any]:
    """A Response object echoing the request's settings (OpenAI's defaults where it sent none).

    Args:
        status: ``in_progress``, ``completed``, ``incomplete`` (``incomplete_details.reason`` is then
            ``max_output_tokens``) or ``failed`` (with ``error``: ``{"code", "message"}``).
        usage: Responses usage (:func:`responses_usage`), None while in progress.
    """
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": time.time() if status == "completed" else None, "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {}, "model": model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id, "reasoning": request.reasoning,
        "store": request.store is not False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": request.text if request.text and request.text.get("format") else {"format": {"type": "text"}},
        "tool_choice": request.tool_choice if request.tool_choice is not None else "auto",
        "tools": [tool.model_dump(include={"type", "name", "description", "parameters", "strict"})
                  for tool in function_tools(request)],
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_logprobs": request.top_logprobs or 0,
        "truncation": request.truncation or "disabled",
        "usage": usage, "user": request.user,
    }
