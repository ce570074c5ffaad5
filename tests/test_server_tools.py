"""Tool calling through the real server with the official ``openai`` client: tools and their results written into
the prompt by the chat template, the reply read into ``message.tool_calls`` (streamed as tool-call deltas), a
two-step tool loop completed, and malformed tools refused with a 400 naming the field. The model is the scripted
:func:`tool_agents.tool_model` (stories260K's tokenizer, a Qwen2.5-style template)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from draftwise.builder import EngineBundle
from draftwise.engine import one_slot_core
from draftwise.server import ServerSettings, create_app
from test_server import live_server
from tool_agents import HERMES_TEMPLATE, tool_model

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                        "parameters": {"type": "object", "required": ["a", "b"],
                                                       "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}}}}}
QUESTION = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]


@pytest.fixture(scope="module")
def tool_url(stories):
    model = tool_model(stories)
    bundle = EngineBundle(target=model, core=one_slot_core(model.backend, eos_token_ids=model.eos_token_ids))
    settings = ServerSettings(served_model_names=("tool-model",), chat_template=HERMES_TEMPLATE)
    with live_server(create_app(bundle, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def client(tool_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_tool_call_comes_back_as_message_tool_calls(client):
    reply = client.chat.completions.create(model="tool-model", messages=QUESTION, tools=[ADD])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.strip() == "I will add them."  # stories260K's tokenizer decodes a leading space
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}


def test_the_tool_result_goes_back_into_the_prompt_and_the_loop_ends(client):
    first = client.chat.completions.create(model="tool-model", messages=QUESTION, tools=[ADD]).choices[0].message
    call = first.tool_calls[0]
    history = QUESTION + [first.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    final = client.chat.completions.create(model="tool-model", messages=history, tools=[ADD]).choices[0]
    assert final.finish_reason == "stop" and final.message.content.strip() == "The sum is 5."
    assert not final.message.tool_calls


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_reply(client):
    whole = client.chat.completions.create(model="tool-model", messages=QUESTION, tools=[ADD]).choices[0]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tool-model", messages=QUESTION, tools=[ADD], stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == whole.message.content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_written_as_a_fenced_json_block_is_a_tool_call(client, stream):
    """Qwen2.5-Coder in tool_choice "auto" writes its call as a ```json block without <tool_call> tags."""
    messages = [{"role": "user", "content": "What is 2 + 3? Use the tool. As a code block."}]
    if stream:
        chunks = list(client.chat.completions.create(model="tool-model", messages=messages, tools=[ADD],
                                                     stream=True))
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        deltas = [call for c in chunks if c.choices for call in (c.choices[0].delta.tool_calls or ())]
        name = "".join(d.function.name or "" for d in deltas)
        arguments = "".join(d.function.arguments or "" for d in deltas)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        choice = client.chat.completions.create(model="tool-model", messages=messages, tools=[ADD]).choices[0]
        assert not choice.message.content
        (call,) = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, [choice.finish_reason]
    assert name == "add" and json.loads(arguments) == {"a": 2, "b": 3} and finish == ["tool_calls"]


def test_call_ids_are_the_same_for_the_same_request_and_differ_between_turns(client):
    """Agents write call ids into their next prompt (smolagents): the same request gets the same ids from any
    server, streamed or not, and a new turn gets new ones."""
    first = client.chat.completions.create(model="tool-model", messages=QUESTION, tools=[ADD]).choices[0].message
    again = client.chat.completions.create(model="tool-model", messages=QUESTION, tools=[ADD]).choices[0].message
    streamed = [call.id for chunk in client.chat.completions.create(model="tool-model", messages=QUESTION,
                                                                    tools=[ADD], stream=True)
                if chunk.choices for call in (chunk.choices[0].delta.tool_calls or ()) if call.id]
    assert first.tool_calls[0].id == again.tool_calls[0].id == streamed[0]
    other = [{"role": "user", "content": "What is 2 + 3? Use the tool, please."}]
    moved = client.chat.completions.create(model="tool-model", messages=other, tools=[ADD]).choices[0].message
    assert moved.tool_calls and moved.tool_calls[0].id != first.tool_calls[0].id


def test_tool_choice_none_and_no_tools_return_plain_content(client):
    plain = client.chat.completions.create(model="tool-model", messages=QUESTION).choices[0]
    assert plain.finish_reason == "stop" and not plain.message.tool_calls
    none = client.chat.completions.create(model="tool-model", messages=QUESTION, tools=[ADD],
                                          tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and not none.message.tool_calls
    assert "<tool_call>" in none.message.content  # the text is not read for calls


def test_legacy_functions_are_served_as_tools(client):
    reply = client.chat.completions.create(model="tool-model", messages=QUESTION, functions=[ADD["function"]])
    assert reply.choices[0].message.tool_calls[0].function.name == "add"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "subtract"}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"arguments": "{}"}}]}]}, "messages.1.tool_calls.0.function.name"),
    ({"messages": QUESTION + [{"role": "tool", "content": "5"}]}, "messages.1.tool_call_id"),
])
def test_malformed_tool_requests_are_400s_naming_the_field(tool_url, body, param):
    reply = httpx.post(f"{tool_url}/v1/chat/completions", json={"messages": QUESTION, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert httpx.get(f"{tool_url}/health").json()["status"] == "ok"


def test_a_call_cut_by_max_tokens_can_be_sent_back(client):
    """A streamed call cut by ``max_tokens`` reaches the client with part of its arguments; an agent that sends
    that turn back gets an answer, not a 400 (the cut string is written into the prompt as it was)."""
    cut = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b'}}]}
    history = QUESTION + [cut, {"role": "tool", "tool_call_id": "call_1", "content": "error: bad arguments"}]
    reply = client.chat.completions.create(model="tool-model", messages=history, tools=[ADD]).choices[0]
    assert reply.finish_reason in ("stop", "tool_calls")
