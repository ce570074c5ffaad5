"""``/v1/responses`` streaming: a chat-completion stream translated into the Responses events.

The events and their order are OpenAI's (``openai.types.responses.ResponseStreamEvent``), framed as OpenAI frames
them (``event: <type>`` and ``data: <json>``); the Codex CLI reads ``response.output_item.done``,
``response.output_text.delta`` and ``response.completed``, the Agents SDK the terminal event's ``response``.
The final Response is assembled by :func:`draftwise.server.responses_api.response_object` from the same item
builders as the non-streamed one, so both are equal for the same result.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from draftwise.server.responses_api import (
    ToolCall,
    call_item,
    item_id,
    message_item,
    response_object,
    responses_usage,
    text_part,
)
from draftwise.server.responses_protocol import ResponsesRequest

__all__ = ["ResponsesStream", "sse_event"]


class ResponsesStream:
    """Translates a chat-completion stream into the Responses events, in order, numbered by
    ``sequence_number``.

    Call :meth:`start` first, then :meth:`feed` with each ``chat.completion.chunk`` dict (or :meth:`text` and
    :meth:`tool_call` with the deltas), then :meth:`finish` (or :meth:`fail`); each returns the events to
    send (dicts; :func:`sse_event` frames one). After :meth:`finish`, :attr:`response` is the final Response,
    equal to :func:`~draftwise.server.responses_api.build_response` of the same result but for the wall-clock
    ``completed_at`` (and for item order when text follows a call, which the chat result does not record).

    Events: ``response.created``, ``response.in_progress``; per message item ``response.output_item.added``,
    ``response.content_part.added``, ``response.output_text.delta`` per text delta, then
    ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``; per call
    ``response.output_item.added``, ``response.function_call_arguments.delta`` per fragment,
    ``response.function_call_arguments.done``, ``response.output_item.done``; last ``response.completed``
    (``response.incomplete`` on ``finish_reason: "length"``, ``response.failed`` from :meth:`fail`).

    With ``include: ["message.output_text.logprobs"]``, each ``response.output_text.delta`` carries the logprobs
    of the tokens fed since the previous one, and ``response.output_text.done`` and the text part all of them.

    Tool-call deltas follow chat streaming: the first delta of a call (a new ``index``) carries its ``id`` and
    ``name``, later ones argument fragments; a call ends when the next call or text begins. Text after a call
    opens a new message item.

    Args:
        request: the request streamed.
        response_id: its id (:func:`~draftwise.server.responses_api.new_response_id`).
        created_at: when the request arrived (Unix seconds).
        model: the served model's name.
    """

    def __init__(self, request: ResponsesRequest, *, response_id: str, created_at: float, model: str) -> None:
        self.request, self.response_id, self.created_at, self.model = request, response_id, created_at, model
        self.response: dict[str, Any] | None = None
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # items, the open one last
        self._open: str | None = None  # "message", "call" or None
        self._call_index: int | None = None  # the open call's chat index
        self._closed_calls: set[int] = set()
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._logprobs: list[dict[str, Any]] = []  # token logprobs not yet sent (text held back), when included

    # -- input
    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        snapshot = self._snapshot("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one ``chat.completion.chunk`` (content, tool-call deltas, ``finish_reason``,
        ``usage``; the chunk that only carries the role gives none)."""
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            self._logprobs += (choice.get("logprobs") or {}).get("content") or ()
            if delta.get("content"):
                events += self.text(delta["content"])
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                events += self.tool_call(call["index"], call.get("id"), function.get("name"),
                                         function.get("arguments"))
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return events

    def text(self, delta: str) -> list[dict[str, Any]]:
        """The events for a content delta."""
        if not delta:
            return []
        events = self._close_call("completed") if self._open == "call" else []
        if self._open is None:
            events += self._open_message()
        item = self._output[-1]
        item["content"][0]["text"] += delta
        logprobs = self._take_logprobs(item)
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=len(self._output) - 1, content_index=0, delta=delta,
                                  logprobs=logprobs))
        return events

    def _take_logprobs(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        """The token logprobs fed since the last text delta, added to the message's text part (a delta's
        tokens: those consumed with its text, and any whose text was held back before it)."""
        taken, self._logprobs = self._logprobs, []
        item["content"][0]["logprobs"] += taken
        return taken

    def tool_call(self, index: int, call_id: str | None, name: str | None,
                  arguments: str | None) -> list[dict[str, Any]]:
        """The events for a tool-call delta (chat's ``index``, ``id``, ``function.name``,
        ``function.arguments`` fragment).

        Raises:
            ValueError: a delta for a call already ended, or a new call's first delta without a name.
        """
        events: list[dict[str, Any]] = []
        if index != self._call_index or self._open != "call":
            if index in self._closed_calls:
                raise ValueError(f"tool call {index} continued after a later call or text began")
            if not name:
                raise ValueError(f"the first delta of tool call {index} carries no function name")
            events += self._close_open("completed")
            events += self._open_call(index, call_id or f"call_{uuid.uuid4().hex[:24]}", name)
        if arguments:
            item = self._output[-1]
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=len(self._output) - 1, delta=arguments))
        return events

    def finish(self, finish_reason: str | None = None, usage: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The closing events and ``response.completed`` (``response.incomplete`` when the chat stream ended
        with ``length``). ``finish_reason`` and ``usage`` default to those :meth:`feed` saw (chat usage)."""
        reason = finish_reason or self._finish_reason or "stop"
        incomplete = reason == "length"
        events = [] if self._output else self._open_message()
        events += self._close_open("incomplete" if incomplete else "completed")
        status = "incomplete" if incomplete else "completed"
        self.response = response_object(self.request, self.response_id, self.created_at, self.model,
                                        self._output, status, responses_usage(usage or self._usage))
        events.append(self._event(f"response.{status}", response=self.response))
        return events

    def fail(self, message: str) -> list[dict[str, Any]]:
        """``response.failed`` for a generation that broke off (error code ``server_error``)."""
        self.response = response_object(self.request, self.response_id, self.created_at, self.model,
                                        self._output, "failed", None, {"code": "server_error", "message": message})
        return [self._event("response.failed", response=self.response)]

    # -- items
    def _open_message(self) -> list[dict[str, Any]]:
        output_index = len(self._output)
        item = message_item(item_id("msg", self.response_id, output_index), None, "in_progress")
        self._output.append(item)
        self._open = "message"
        events = [self._event("response.output_item.added", output_index=output_index, item=_copy(item))]
        item["content"].append(text_part(""))
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=output_index,
                                  content_index=0, part=_copy(item["content"][0])))
        return events

    def _open_call(self, index: int, call_id: str, name: str) -> list[dict[str, Any]]:
        output_index = len(self._output)
        item = call_item(item_id("fc", self.response_id, output_index), ToolCall(call_id, name, ""),
                          "in_progress")
        self._output.append(item)
        self._open, self._call_index = "call", index
        return [self._event("response.output_item.added", output_index=output_index, item=_copy(item))]

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        if self._open == "message":
            return self._close_message(status)
        if self._open == "call":
            return self._close_call(status)
        return []

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        output_index, item = len(self._output) - 1, self._output[-1]
        item["status"] = status
        part = item["content"][0]
        self._take_logprobs(item)
        self._open = None
        return [self._event("response.output_text.done", item_id=item["id"], output_index=output_index,
                            content_index=0, text=part["text"], logprobs=list(part["logprobs"])),
                self._event("response.content_part.done", item_id=item["id"], output_index=output_index,
                            content_index=0, part=_copy(part)),
                self._event("response.output_item.done", output_index=output_index, item=_copy(item))]

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        output_index, item = len(self._output) - 1, self._output[-1]
        item["status"] = status
        self._closed_calls.add(self._call_index)
        self._open, self._call_index = None, None
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=output_index, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=output_index, item=_copy(item))]

    # -- events
    def _snapshot(self, status: str) -> dict[str, Any]:
        return response_object(self.request, self.response_id, self.created_at, self.model, [], status, None)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item that later deltas do not change (events are often serialised later)."""
    return json.loads(json.dumps(item))


def sse_event(event: dict[str, Any]) -> str:
    """One Responses event as a server-sent event, framed as OpenAI frames them: ``event: <type>`` then
    ``data: <json>`` and a blank line (no ``[DONE]`` ends a Responses stream)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
