"""OpenAI chat messages and tools -> chat-template input (draftwise.server.chat_messages), and the round trip
through Qwen2.5's own template: the prompt shows the tools, the assistant's calls and the tool results in the
format the hermes parser reads back."""

from __future__ import annotations

import json
import random

import pytest

from draftwise.server.chat_messages import (
    MessageError, normalize_tool_choice, normalize_tools, template_messages,
)
from draftwise.server.tool_parsers import get_tool_parser

from conftest import pulled_model_path

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}

CONVERSATION = [
    {"role": "developer", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "List the files"}, {"type": "text", "text": "here."}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": '{"command": "pwd"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
    {"role": "tool", "tool_call_id": "call_2", "name": "bash", "content": [{"type": "text", "text": "/src"}]},
]


def test_history_keeps_calls_with_parsed_arguments_and_tool_results_with_their_ids():
    messages = template_messages(CONVERSATION)
    assert messages[0] == {"role": "system", "content": "You are terse."}
    assert messages[1] == {"role": "user", "content": "List the files\nhere."}
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}},
        {"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}}]}
    assert messages[3] == {"role": "tool", "content": "a.py\nb.py", "tool_call_id": "call_1", "name": "bash"}
    assert messages[4] == {"role": "tool", "content": "/src", "tool_call_id": "call_2", "name": "bash"}


def test_arguments_that_are_not_json_stay_the_string_they_were():
    """A call cut by max_tokens reaches a streaming client with part of its arguments, and agents send it back:
    the template gets that string (the conversation goes on), valid arguments get parsed."""
    cut = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
        {"id": "d", "type": "function", "function": {"name": "bash", "arguments": '{"command": "l'}}]}]
    calls = template_messages(cut)[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"command": "ls"}
    assert calls[1]["function"]["arguments"] == '{"command": "l'


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "user"}, "messages[0]"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "messages[0].content"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]},
     "messages[0].tool_calls[0].function.name"),
    ({"role": "function", "content": "x"}, "messages[0].name"),
    ({"role": "robot", "content": "x"}, "messages[0].role"),
])
def test_unusable_messages_are_errors_naming_their_field(message, param):
    with pytest.raises(MessageError) as info:
        template_messages([message])
    assert info.value.param == param


def test_legacy_function_call_and_function_messages_become_tool_calls():
    messages = template_messages([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Running.",
         "function_call": {"name": "bash", "arguments": '{"command": "ls"}'}},
        {"role": "function", "name": "bash", "content": "a.py"},
    ])
    assert messages[1] == {"role": "assistant", "content": "Running.", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]}
    assert messages[2] == {"role": "tool", "content": "a.py", "name": "bash"}


def test_tools_and_legacy_functions_normalize_to_one_form():
    assert normalize_tools(None) is None and normalize_tools([], None) is None
    assert normalize_tools([BASH]) == [BASH]
    legacy = normalize_tools(None, [{"name": "noop"}])
    empty = {"type": "object", "properties": {}}
    assert legacy == [{"type": "function", "function": {"name": "noop", "parameters": empty}}]
    with pytest.raises(MessageError, match="not both"):
        normalize_tools([BASH], [{"name": "noop"}])
    with pytest.raises(MessageError) as info:
        normalize_tools([BASH, {"type": "function", "function": {"name": "rm -rf"}}])
    assert info.value.param == "tools[1].function.name"
    with pytest.raises(MessageError, match="given twice"):
        normalize_tools([BASH, BASH])
    with pytest.raises(MessageError, match="JSON Schema object"):
        normalize_tools(None, [{"name": "f", "parameters": "string"}])
    with pytest.raises(MessageError, match=r"tools\[0\] must be"):
        normalize_tools([{"type": "code_interpreter"}])


def test_tool_choice_defaults_legacy_form_and_errors():
    tools = normalize_tools([BASH])
    assert normalize_tool_choice(None, None, tools) == "auto"
    assert normalize_tool_choice(None, None, None) == "none"
    assert normalize_tool_choice("required", None, tools) == "required"
    named = {"type": "function", "function": {"name": "bash"}}
    assert normalize_tool_choice(named, None, tools) == named
    assert normalize_tool_choice(None, {"name": "bash"}, tools) == named
    assert normalize_tool_choice(None, "none", tools) == "none"
    with pytest.raises(MessageError, match="not in 'tools'"):
        normalize_tool_choice({"type": "function", "function": {"name": "rm"}}, None, tools)
    with pytest.raises(MessageError, match="needs 'tools'"):
        normalize_tool_choice("required", None, None)
    with pytest.raises(MessageError, match="must be 'none'"):
        normalize_tool_choice("always", None, tools)
    with pytest.raises(MessageError, match="not both"):
        normalize_tool_choice("auto", "auto", tools)


def test_an_inline_template_sees_arguments_as_a_mapping():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                "{{ c.function.name }}:{{ c.function.arguments.command }}|{{ c.function.arguments | tojson }}"
                "{% endfor %}{% endfor %}")
    rendered, _ = render_jinja_template(conversations=[template_messages(CONVERSATION)], chat_template=template)
    assert rendered[0] == 'bash:ls|{"command": "ls"}bash:pwd|{"command": "pwd"}'


QWEN_GGUF = pulled_model_path("qwen2.5-coder-1.5b")


@pytest.mark.slow
def test_qwen_template_shows_tools_calls_and_results_in_the_hermes_format():
    if not QWEN_GGUF.is_file():
        pytest.skip(f"{QWEN_GGUF} not pulled (draftwise pull qwen2.5-coder-1.5b)")
    from transformers.utils.chat_template_utils import render_jinja_template

    from draftwise.models.gguf_tokenizer import gguf_metadata

    template = str(gguf_metadata(QWEN_GGUF, ("tokenizer.chat_template",))["tokenizer.chat_template"])
    tools = normalize_tools([BASH])
    rendered, _ = render_jinja_template(conversations=[template_messages(CONVERSATION)], tools=tools,
                                        chat_template=template, add_generation_prompt=True)
    prompt = rendered[0]
    assert "<tools>\n" + json.dumps(BASH) + "\n</tools>" in prompt  # tojson writes what json.dumps writes
    assert "<|im_start|>system\nYou are terse.\n\n# Tools" in prompt
    assert "<|im_start|>user\nList the files\nhere.<|im_end|>" in prompt
    calls = ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>')
    assert "<|im_start|>assistant\n" + calls + "<|im_end|>" in prompt
    assert ("<|im_start|>user\n<tool_response>\na.py\nb.py\n</tool_response>\n<tool_response>\n/src\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt
    # What the template writes for a call is what the hermes parser reads back.
    parser = get_tool_parser("hermes")
    parsed = parser.extract(calls, parser.call_ids(random.Random(0)))
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments_json)) for c in parsed.tool_calls] == [
        ("bash", {"command": "ls"}), ("bash", {"command": "pwd"})]
