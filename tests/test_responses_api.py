"""The ``/v1/responses`` translation layer: requests to chat bodies, chat results to Responses and their events.

The ``openai`` SDK's own models judge the output: every Response validates as ``openai.types.responses.Response``
and every event as ``ResponseStreamEvent``; the SDK's stream accumulator (what ``client.responses.stream`` runs)
rebuilds the final response from the events; and the SDK's client, over an in-process transport, reads the JSON
and the server-sent events as it would from OpenAI.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
from openai import OpenAI, omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from draftwise.server.responses_api import ChatOutcome, ToolCall, build_response, conversation, to_chat
from draftwise.server.responses_protocol import ResponsesInputError, ResponsesRequest
from draftwise.server.responses_store import ResponseStore
from draftwise.server.responses_stream import ResponsesStream, sse_event

EVENT = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                       "additionalProperties": False}, "strict": True}
USAGE = {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52,
         "prompt_tokens_details": {"cached_tokens": 16}, "speculative": {"method": "suffix"}}


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "qwen", "input": "hi", **fields})


def refused(param: str, **fields) -> ResponsesInputError:
    with pytest.raises(ResponsesInputError) as info:
        to_chat(request(**fields))
    assert info.value.param == param, info.value.message
    return info.value


# ---------------------------------------------------------------------- request -> chat body
def test_string_input_is_one_user_message_after_the_instructions():
    body = to_chat(request(instructions="Be terse.", input="Hello"))
    assert body == {"model": "qwen", "messages": [{"role": "system", "content": "Be terse."},
                                                  {"role": "user", "content": "Hello"}]}


def test_message_items_shorthand_and_typed_with_text_parts():
    items = [{"role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                              {"type": "input_text", "text": "b"}]},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "done", "annotations": [], "logprobs": []}]}]
    assert to_chat(request(input=items))["messages"] == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]}]


def test_function_calls_join_the_assistant_turn_and_outputs_become_tool_messages():
    items = [{"role": "user", "content": "look"},
             {"role": "assistant", "content": "Reading both."},
             {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "read_file",
              "arguments": '{"path": "a.py"}', "status": "completed"},
             {"type": "function_call", "call_id": "call_b", "name": "read_file", "arguments": '{"path": "b.py"}'},
             {"type": "function_call_output", "call_id": "call_a", "output": "A"},
             {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "B"}]},
             {"type": "function_call", "call_id": "call_c", "name": "read_file", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_c", "output": "C"}]
    messages = to_chat(request(input=items, tools=[TOOL]))["messages"]
    call = lambda cid, args: {"id": cid, "type": "function", "function": {"name": "read_file", "arguments": args}}
    assert messages == [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": "Reading both.",
         "tool_calls": [call("call_a", '{"path": "a.py"}'), call("call_b", '{"path": "b.py"}')]},
        {"role": "tool", "tool_call_id": "call_a", "content": "A"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "B"}]},
        {"role": "assistant", "content": None, "tool_calls": [call("call_c", "{}")]},
        {"role": "tool", "tool_call_id": "call_c", "content": "C"}]


def test_reasoning_items_without_content_are_dropped():
    items = [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
             {"role": "user", "content": "x"}]
    assert to_chat(request(input=items))["messages"] == [{"role": "user", "content": "x"}]


def test_tools_choice_format_and_sampling_fields():
    body = to_chat(request(tools=[TOOL], tool_choice={"type": "function", "name": "read_file"},
                           parallel_tool_calls=False, max_output_tokens=64, temperature=0, top_p=0.5,
                           user="u1", seed=7, store=False, reasoning=None, include=[], truncation="disabled",
                           metadata={"k": "v"}, prompt_cache_key="thread-1",
                           text={"format": {"type": "json_schema", "name": "out", "strict": True,
                                            "schema": {"type": "object"}}, "verbosity": "low"}))
    function = {key: TOOL[key] for key in ("name", "description", "parameters", "strict")}
    assert body["tools"] == [{"type": "function", "function": function}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["user"], body["seed"]) == (64, 0, 0.5,
                                                                                                "u1", 7)
    assert "prompt_cache_key" not in body and "stream" not in body


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tool_choice_strings_pass_through(choice):
    assert to_chat(request(tools=[TOOL], tool_choice=choice))["tool_choice"] == choice


@pytest.mark.parametrize("fmt, expected", [({"type": "text"}, None), ({"type": "json_object"},
                                                                      {"type": "json_object"})])
def test_text_and_json_object_formats(fmt, expected):
    assert to_chat(request(text={"format": fmt})).get("response_format") == expected


def test_stream_asks_the_chat_stream_for_usage():
    body = to_chat(request(stream=True))
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_history_comes_between_the_instructions_and_the_input():
    first = request(instructions="old rules", input=[{"role": "user", "content": "read a.py"}], tools=[TOOL])
    outcome = ChatOutcome("qwen", "", (ToolCall("call_1", "read_file", '{"path": "a.py"}'),), "tool_calls", USAGE)
    history = conversation(first, (), build_response(first, outcome, response_id="resp_1", created_at=0.0))
    follow_up = request(instructions="new rules", previous_response_id="resp_1", tools=[TOOL],
                        input=[{"type": "function_call_output", "call_id": "call_1", "output": "print(1)"}])
    assert to_chat(follow_up, history)["messages"] == [
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "read a.py"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}]


CODEX_SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
               "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                                                           "items": {"type": "string"}}},
                              "required": ["command"], "additionalProperties": False}}


def test_a_codex_cli_turn():
    """The body the Codex CLI sends (``codex-rs/codex-api``'s ``ResponsesApiRequest``) on its second turn."""
    body = {"model": "qwen", "instructions": "You are Codex.", "tools": [CODEX_SHELL], "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": None, "store": False, "stream": True, "include": [],
            "prompt_cache_key": "0199-thread", "text": {"verbosity": "medium"},
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
                {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_1"},
                {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"}]}
    chat = to_chat(ResponsesRequest.model_validate(body))
    assert [m["role"] for m in chat["messages"]] == ["system", "developer", "user", "assistant", "tool"]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["tools"][0]["function"]["strict"]) == (
        "auto", False, False)
    assert "response_format" not in chat and chat["stream_options"] == {"include_usage": True}


def test_an_agents_sdk_turn():
    """The body ``OpenAIResponsesModel`` sends with a function tool and an ``output_type``, its earlier output
    items echoed back as it dumps them."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    first = build_response(request(tools=[TOOL]), OUTCOMES["text and calls"], response_id="resp_a", created_at=0.0)
    echoed = [Response.model_validate(first).output[i].model_dump(exclude_unset=True) for i in range(3)]
    body = {"model": "qwen", "instructions": "Help.", "include": [], "tools": [TOOL],
            "text": {"format": {"type": "json_schema", "name": "final_output", "schema": schema, "strict": True}},
            "input": [{"content": "read both", "role": "user"}, *echoed,
                      {"call_id": "call_a", "output": "x = 1", "type": "function_call_output"},
                      {"call_id": "call_b", "output": "y = 2", "type": "function_call_output"}]}
    chat = to_chat(ResponsesRequest.model_validate(body))
    assistant = chat["messages"][2]
    assert assistant["content"] == [{"type": "text", "text": "Reading."}]
    assert [call["id"] for call in assistant["tool_calls"]] == ["call_a", "call_b"]
    assert chat["response_format"]["json_schema"]["name"] == "final_output"


# ---------------------------------------------------------------------- refusals
def test_media_parts_are_refused_naming_the_part():
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}
    error = refused("input[0].content[1].type",
                    input=[{"role": "user", "content": [{"type": "input_text", "text": "see"}, image]}])
    assert "input_image" in error.message
    refused("input[1].output[0].type", tools=[TOOL], input=[
        {"type": "function_call", "call_id": "c", "name": "read_file", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}])


@pytest.mark.parametrize("item", [{"type": "item_reference", "id": "msg_1"},
                                  {"type": "web_search_call", "id": "ws", "status": "completed"},
                                  {"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": ""},
                                  {"content": "no role, no type"}])
def test_unsupported_item_types_are_refused_naming_the_type(item):
    refused("input[1].type", input=[{"role": "user", "content": "x"}, item])


def test_reasoning_items_with_content_are_refused():
    refused("input[0].content", input=[{"type": "reasoning", "id": "rs", "summary": [],
                                        "content": [{"type": "reasoning_text", "text": "thinking"}]}])


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input[0].name"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}, "input[0].arguments"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input[0].content[0].text"),
])
def test_malformed_items_name_the_field(item, param):
    refused(param, input=[item])


def test_an_output_without_its_call_is_refused():
    error = refused("input", input=[{"type": "function_call_output", "call_id": "call_9", "output": "x"}])
    assert "previous_response_id" in error.message


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "local_shell"}]}, "tools[1].type"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs", "summary": []}]}, "input"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
])
def test_unserved_fields_are_refused_naming_them(fields, param):
    refused(param, **fields)


def test_the_request_shape_is_checked_strictly():
    for body in ({"input": 3}, {"input": [3]}, {"input": "x", "stream": "yes"}, {"input": "x", "truncation": "middle"},
                 {"input": "x", "metadata": {"k": 1}}, {"input": "x", "max_output_tokens": 1.5}):
        with pytest.raises(ValidationError):
            ResponsesRequest.model_validate(body)


# ---------------------------------------------------------------------- chat result -> Response
def test_a_text_answer_is_one_message_and_the_sdk_reads_it():
    req = request(instructions="Be terse.", tools=[TOOL], temperature=0.2, metadata={"run": "1"})
    body = build_response(req, ChatOutcome("qwen", "Hello there", (), "stop", USAGE), response_id="resp_x",
                          created_at=1.0)
    parsed = Response.model_validate(body)
    assert parsed.output_text == "Hello there" and parsed.status == "completed" and parsed.id == "resp_x"
    assert parsed.output[0].id == "msg_x_0" and parsed.output[0].content[0].annotations == []
    assert (parsed.instructions, parsed.temperature, parsed.tools[0].name, parsed.tool_choice,
            parsed.metadata) == ("Be terse.", 0.2, "read_file", "auto", {"run": "1"})
    usage = parsed.usage
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens,
            usage.output_tokens_details.reasoning_tokens, usage.total_tokens) == (40, 16, 12, 0, 52)
    assert body["usage"]["speculative"] == {"method": "suffix"}


def test_tool_calls_follow_the_text_as_function_call_items():
    calls = (ToolCall("call_a", "read_file", '{"path": "a"}'), ToolCall("call_b", "read_file", '{"path": "b"}'))
    parsed = Response.model_validate(build_response(request(tools=[TOOL]),
                                                    ChatOutcome("qwen", "", calls, "tool_calls", USAGE),
                                                    response_id="resp_y", created_at=1.0))
    assert [(item.type, item.id, item.call_id, item.arguments, item.status) for item in parsed.output] == [
        ("function_call", "fc_y_0", "call_a", '{"path": "a"}', "completed"),
        ("function_call", "fc_y_1", "call_b", '{"path": "b"}', "completed")]


def test_length_makes_an_incomplete_response():
    parsed = Response.model_validate(build_response(request(max_output_tokens=12),
                                                    ChatOutcome("qwen", "cut sho", (), "length", USAGE),
                                                    response_id="resp_z", created_at=1.0))
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output[0].status == "incomplete" and parsed.max_output_tokens == 12


def test_outcome_from_a_chat_completion_body():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "qwen", "usage": USAGE,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}]}}]}
    assert ChatOutcome.from_chat_body(body) == ChatOutcome("qwen", "", (ToolCall("call_1", "read_file", "{}"),),
                                                           "tool_calls", USAGE)


# ---------------------------------------------------------------------- streaming
def chat_chunks(outcome: ChatOutcome, rng: random.Random) -> list[dict]:
    """The chat stream of ``outcome`` cut at random places (several tokens a chunk, as under speculation)."""
    def chunk(delta=None, finish=None, usage=None):
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": outcome.model,
                "choices": [] if usage else [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
                "usage": usage}

    def pieces(text):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 4)))) if text else []
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]

    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": piece}) for piece in pieces(outcome.text)]
    for index, call in enumerate(outcome.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": index, "id": call.call_id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]}))
        chunks += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                   for piece in pieces(call.arguments)]
    return [*chunks, chunk(finish=outcome.finish_reason), chunk(usage=outcome.usage)]


def stream_events(req: ResponsesRequest, outcome: ChatOutcome, seed: int = 0) -> tuple[list[dict], dict]:
    stream = ResponsesStream(req, response_id="resp_s", created_at=2.0, model=outcome.model)
    events = stream.start()
    for chunk in chat_chunks(outcome, random.Random(seed)):
        events += stream.feed(chunk)
    events += stream.finish()
    return events, stream.response


OUTCOMES = {
    "text": ChatOutcome("qwen", "The answer is 42.", (), "stop", USAGE),
    "text and calls": ChatOutcome("qwen", "Reading.", (ToolCall("call_a", "read_file", '{"path": "src/x.py"}'),
                                                       ToolCall("call_b", "read_file", '{"path": "y"}')),
                                  "tool_calls", USAGE),
    "calls only": ChatOutcome("qwen", "", (ToolCall("call_a", "read_file", '{"path": "a"}'),), "tool_calls", USAGE),
    "empty": ChatOutcome("qwen", "", (), "stop", USAGE),
    "cut": ChatOutcome("qwen", "a long ans", (), "length", USAGE),
    "cut in a call": ChatOutcome("qwen", "", (ToolCall("call_a", "read_file", '{"pa'),), "length", USAGE),
}


@pytest.mark.parametrize("name", OUTCOMES)
def test_the_streamed_response_equals_the_assembled_one(name):
    outcome, req = OUTCOMES[name], request(tools=[TOOL], stream=True)
    for seed in range(5):
        events, final = stream_events(req, outcome, seed)
        assembled = build_response(req, outcome, response_id="resp_s", created_at=2.0)
        final, assembled = dict(final), dict(assembled)
        finished_at = final.pop("completed_at"), assembled.pop("completed_at")  # wall-clock: compared apart
        assert [at is not None for at in finished_at] == [final["status"] == "completed"] * 2
        assert final == assembled
        assert events[-1]["response"]["output"] == assembled["output"]


@pytest.mark.parametrize("name", OUTCOMES)
def test_every_event_is_one_the_sdk_knows_numbered_in_order(name):
    events, _ = stream_events(request(tools=[TOOL], stream=True), OUTCOMES[name])
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for event in events:
        EVENT.validate_python(event)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["usage"] is None


def kinds(events: list[dict]) -> list[str]:
    """Event types, runs of deltas collapsed to one."""
    out = []
    for event in events:
        kind = event["type"].removeprefix("response.")
        if not (kind.endswith(".delta") and out and out[-1] == kind):
            out.append(kind)
    return out


def test_event_order_for_text_then_calls():
    events, _ = stream_events(request(tools=[TOOL], stream=True), OUTCOMES["text and calls"])
    call = ["output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
            "output_item.done"]
    assert kinds(events) == ["created", "in_progress", "output_item.added", "content_part.added",
                             "output_text.delta", "output_text.done", "content_part.done", "output_item.done",
                             *call, *call, "completed"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert text == "Reading." and [e["arguments"] for e in done] == ['{"path": "src/x.py"}', '{"path": "y"}']
    assert [e["output_index"] for e in done] == [1, 2]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(item["status"], item.get("arguments")) for item in added] == [("in_progress", None),
                                                                          ("in_progress", ""), ("in_progress", "")]


def test_a_cut_stream_ends_incomplete():
    events, final = stream_events(request(stream=True), OUTCOMES["cut"])
    assert events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert final["output"][0]["status"] == "incomplete"


def test_text_after_a_call_opens_a_new_message():
    stream = ResponsesStream(request(tools=[TOOL]), response_id="resp_t", created_at=0.0, model="qwen")
    events = stream.start() + stream.tool_call(0, "call_a", "read_file", "{}") + stream.text("after")
    events += stream.finish("stop", USAGE)
    assert [item["type"] for item in stream.response["output"]] == ["function_call", "message"]
    Response.model_validate(stream.response)
    with pytest.raises(ValueError, match="continued"):
        stream.tool_call(0, None, None, "x")


def test_a_failed_stream_ends_with_response_failed():
    stream = ResponsesStream(request(), response_id="resp_f", created_at=0.0, model="qwen")
    events = stream.start() + stream.text("par") + stream.fail("engine stopped")
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["code"] == "server_error"
    EVENT.validate_python(events[-1])


def test_the_sdk_stream_accumulator_rebuilds_the_response():
    events, final = stream_events(request(tools=[TOOL], stream=True), OUTCOMES["text and calls"], seed=3)
    state = ResponseStreamState(input_tools=[TOOL], text_format=omit)
    for event in events:
        state.handle_event(EVENT.validate_python(event))
    snapshot = state._ResponseStreamState__current_snapshot
    assert snapshot.output_text == "Reading."
    assert [item.arguments for item in snapshot.output[1:]] == ['{"path": "src/x.py"}', '{"path": "y"}']


def test_sse_framing():
    event = {"type": "response.output_text.delta", "sequence_number": 3, "delta": "é\n"}
    assert sse_event(event) == ('event: response.output_text.delta\n'
                                'data: {"type": "response.output_text.delta", "sequence_number": 3, '
                                '"delta": "é\\n"}\n\n')


# ---------------------------------------------------------------------- the SDK's client over HTTP
def fake_server(outcome: ChatOutcome, seen: list[dict]) -> httpx.MockTransport:
    """``POST /v1/responses`` answered by this module's translation of a scripted chat result."""
    def handle(http_request: httpx.Request) -> httpx.Response:
        req = ResponsesRequest.model_validate(json.loads(http_request.content))
        seen.append(to_chat(req))
        if not req.stream:
            return httpx.Response(200, json=build_response(req, outcome, response_id="resp_h",
                                                           created_at=time.time()))
        events, _ = stream_events(req, outcome)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content="".join(sse_event(event) for event in events).encode())
    return httpx.MockTransport(handle)


def sdk_client(outcome: ChatOutcome, seen: list[dict]) -> OpenAI:
    return OpenAI(api_key="k", base_url="http://draftwise.test/v1",
                  http_client=httpx.Client(transport=fake_server(outcome, seen)))


def test_the_sdk_client_reads_a_response_and_a_stream():
    seen: list[dict] = []
    client = sdk_client(OUTCOMES["text and calls"], seen)
    response = client.responses.create(model="qwen", instructions="Be terse.", input="read x", tools=[TOOL])
    assert response.output_text == "Reading." and response.output[1].name == "read_file"
    assert seen[-1]["messages"][0] == {"role": "system", "content": "Be terse."}
    with client.responses.stream(model="qwen", input="read x", tools=[TOOL]) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Reading." and final.output[2].arguments == '{"path": "y"}'
    assert final.usage.input_tokens_details.cached_tokens == 16 and seen[-1]["stream"] is True


# ---------------------------------------------------------------------- the store
def test_store_keeps_per_scope_and_evicts_the_least_recently_used():
    store = ResponseStore(capacity=2)
    item = ResponsesRequest.model_validate({"input": "a"})
    store.keep("key1", "resp_1", conversation(item, (), build_response(
        item, OUTCOMES["text"], response_id="resp_1", created_at=0.0)))
    store.keep("key1", "resp_2", ())
    assert [getattr(i, "role", None) for i in store.history("key1", "resp_1")] == ["user", "assistant"]
    with pytest.raises(ResponsesInputError) as info:
        store.history("key2", "resp_1")  # another API key
    assert info.value.param == "previous_response_id"
    store.keep("key1", "resp_3", ())  # resp_2 is the least recently used now
    assert len(store) == 2 and store.history("key1", "resp_1")
    with pytest.raises(ResponsesInputError):
        store.history("key1", "resp_2")
    with pytest.raises(ValueError):
        ResponseStore(capacity=0)


def test_store_holds_at_most_max_chars_of_text():
    store = ResponseStore(capacity=10, max_chars=100)
    message = lambda n: ResponsesRequest.model_validate({"input": "x" * n})
    store.keep("k", "resp_1", conversation(message(40), (), {"output": []}))
    store.keep("k", "resp_2", conversation(message(40), (), {"output": []}))
    store.history("k", "resp_1")  # resp_2 is the least recently used now
    store.keep("k", "resp_3", conversation(message(30), (), {"output": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}))  # 33 characters
    assert len(store) == 2 and store.history("k", "resp_1") and store.history("k", "resp_3")
    with pytest.raises(ResponsesInputError):
        store.history("k", "resp_2")
    store.keep("k", "resp_4", conversation(message(101), (), {"output": []}))  # alone past the bound
    assert len(store) == 0
