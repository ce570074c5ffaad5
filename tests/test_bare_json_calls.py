"""Bare or fenced JSON tool calls (draftwise.server.tool_parsers.bare_json): what Qwen2.5-Coder writes in
``tool_choice: "auto"`` is read as calls of the request's tools, while ordinary replies, JSON that names no tool,
and the model's own ``<tool_call>`` blocks read exactly as the Hermes parser alone reads them; streamed in any
chunks, the deltas reassemble to the finished reply's result and never send text that later becomes a call."""

from __future__ import annotations

import json

import pytest

from draftwise.server.tool_parsers import ParsedOutput, get_tool_parser
from draftwise.server.tool_parsers.bare_json import BareJsonFallback
from test_tool_parsers import assert_stream_matches, extract, hermes_call

HERMES = get_tool_parser("hermes")
PARSER = BareJsonFallback(HERMES, ["bash", "read_file"])

QWEN_CODER_REPLY = '```json\n{\n  "name": "bash",\n  "arguments": {\n    "command": "ls -la"\n  }\n}\n```'


def calls(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments_json)) for call in parsed.tool_calls]


def test_a_fenced_call_of_a_tool_is_a_call_with_no_content():
    parsed = extract(PARSER, QWEN_CODER_REPLY)
    assert parsed.content is None
    assert calls(parsed) == [("bash", {"command": "ls -la"})]
    assert parsed.tool_calls[0].arguments_json == '{\n    "command": "ls -la"\n  }'  # the model's own text


@pytest.mark.parametrize("text", [
    '{"name": "read_file", "arguments": {"path": "a.py"}}',
    '\n\n```\n{"name": "read_file", "arguments": {"path": "a.py"}}\n```\n',
    '```JSON\n{"arguments": {"path": "a.py"}, "name": "read_file"}```',
    '```json\n{"name": "read_file", "arguments": {"path": "a.py"}}',  # the closing fence cut by the stop token
])
def test_bare_and_fenced_spellings_are_read(text):
    parsed = extract(PARSER, text)
    assert parsed == ParsedOutput(None, parsed.tool_calls)
    assert calls(parsed) == [("read_file", {"path": "a.py"})]


def test_several_calls_in_a_row_then_text_after_them_is_content():
    text = ('```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```\n\n'
            '{"name": "read_file", "arguments": {"path": "b"}}\nI will look at both.')
    parsed = extract(PARSER, text)
    assert calls(parsed) == [("bash", {"command": "ls"}), ("read_file", {"path": "b"})]
    assert parsed.content == "I will look at both."


@pytest.mark.parametrize("text", [
    'Run this:\n```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```',  # not at the start
    '```json\n{"name": "rm_rf", "arguments": {}}\n```',  # not one of the request's tools
    '```python\nprint({"name": "bash", "arguments": {}})\n```',  # another language
    '{"name": "bash", "arguments": "not an object"}',
    '{"name": "bash"}',
    '{"result": 3}',
    "```",
    "Hello.",
    "",
])
def test_anything_else_reads_as_the_hermes_parser_reads_it(text):
    assert extract(PARSER, text) == extract(HERMES, text)


def test_the_models_own_tool_call_blocks_are_unchanged():
    text = "Let me check.\n" + hermes_call("bash", '{"command": "pwd"}')
    assert extract(PARSER, text) == extract(HERMES, text)
    assert calls(extract(PARSER, text)) == [("bash", {"command": "pwd"})]


STREAM_CASES = [
    QWEN_CODER_REPLY,
    '```json\n{"name": "bash", "arguments": {"command": "ls"}}\n```\nand some words',
    '{"name": "bash", "arguments": {"command": "ls"}} {"name": "read_file", "arguments": {"path": "x"}}',
    '```json\n{"name": "rm_rf", "arguments": {}}\n```',
    '```py\nx = 1\n```',
    '{"result": {"name": "bash"}}',
    "Sure: " + hermes_call("read_file", '{"path": "a"}'),
]


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streaming_cut_anywhere_reassembles_to_the_finished_reply(text):
    assert_stream_matches(PARSER, text, list(range(1, len(text) + 1)))
    for cut in range(len(text) + 1):
        assert_stream_matches(PARSER, text, [cut])


def test_a_fence_is_held_back_until_the_call_inside_decides():
    stream = PARSER.stream(PARSER.call_ids())
    assert stream.feed("```js") == []
    assert stream.feed('```json\n{"name": "ba') == []
    deltas = stream.feed('```json\n{"name": "bash", "arguments": {"comm')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "bash"}
    assert stream.tool_calls_sent == 1


def test_the_grammar_of_a_forced_call_is_the_models_own_format():
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    assert PARSER.call_grammar(tools, "required") == HERMES.call_grammar(tools, "required")
