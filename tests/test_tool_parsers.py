"""Tool-call parsers (draftwise.server.tool_parsers): finished replies, streamed deltas, forcing grammars.

The invariant: whatever the chunking (speculation sends several tokens per chunk), the streamed deltas
reassemble to ``extract``'s result on the whole reply, content and calls, ids included when both draw from
equally seeded generators. A partial call marker is never streamed as content.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from draftwise.server.tool_parsers import (
    TOOL_PARSERS, ParsedOutput, ToolCall, detect_tool_parser, get_tool_parser,
)
from draftwise.structured.spec import Alternatives, Concat, JsonSchema, Literal, Repeat

from conftest import pulled_model_path

HERMES = get_tool_parser("hermes")
LLAMA = get_tool_parser("llama3_json")
MISTRAL = get_tool_parser("mistral")

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "noop"}},
]


# ------------------------------------------------------------------------------------------- helpers
def hermes_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def reassemble(deltas: list[dict]) -> ParsedOutput:
    """What a client accumulates from the deltas (the openai SDK's stream accumulation, by index)."""
    content = ""
    calls: dict[int, dict] = {}
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"}
        content += delta.get("content", "")
        for call in delta.get("tool_calls", ()):
            entry = calls.get(call["index"])
            if entry is None:
                assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function"
                assert call["index"] == len(calls), "a new call's index is the next one"
                assert set(call["function"]) == {"name"} and call["function"]["name"]
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                assert call["function"]["arguments"]
                entry["arguments"] += call["function"]["arguments"]
    return ParsedOutput(content or None, tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in calls.values()))


def stream_chunks(parser, text: str, cuts: list[int], seed: int = 0) -> tuple[list[dict], list[str]]:
    """Feed the accumulated text at each cut, then finish; also the content sent after each feed."""
    stream = parser.stream(parser.call_ids(random.Random(seed)))
    deltas: list[dict] = []
    shown: list[str] = []
    for cut in sorted(set(cuts)):
        deltas += stream.feed(text[:cut])
        shown.append("".join(d.get("content", "") for d in deltas))
    deltas += stream.finish(text)
    return deltas, shown


def extract(parser, text: str, seed: int = 0) -> ParsedOutput:
    return parser.extract(text, parser.call_ids(random.Random(seed)))


def assert_stream_matches(parser, text: str, cuts: list[int]) -> None:
    deltas, shown = stream_chunks(parser, text, cuts)
    final = extract(parser, text)
    assert reassemble(deltas) == final, text
    for content in shown:  # never sent what the final content does not begin with
        assert (final.content or "").startswith(content), (text, content)


# ------------------------------------------------------------------------------------------- hermes
def test_hermes_reads_several_calls_with_text_before_and_after():
    text = ("I will look.\n" + hermes_call("read_file", '{"path": "a.py"}') + "\n"
            + hermes_call("bash", '{"command": "ls -l"}') + "\nDone.")
    parsed = extract(HERMES, text)
    assert parsed.content == "I will look.\n\nDone."
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [
        ("read_file", '{"path": "a.py"}'), ("bash", '{"command": "ls -l"}')]
    assert parsed.tool_calls[0].to_openai() == {
        "id": parsed.tool_calls[0].id, "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}


def test_hermes_calls_only_have_no_content_and_keep_the_models_argument_text():
    text = "\n" + hermes_call("bash", '{\n  "command": "echo \\"}\\" </tool_call>"\n}') + "\n"
    parsed = extract(HERMES, text)
    assert parsed.content is None
    assert parsed.tool_calls[0].arguments_json == '{\n  "command": "echo \\"}\\" </tool_call>"\n}'
    assert json.loads(parsed.tool_calls[0].arguments_json) == {"command": 'echo "}" </tool_call>'}


def test_a_reply_without_calls_is_returned_unchanged():
    for parser in (HERMES, LLAMA, MISTRAL):
        for text in ("  Hello, world.\n\n", "a < b <tool", "", "x [TOOL"):
            assert extract(parser, text) == ParsedOutput(text or None, ())


@pytest.mark.parametrize("block", [
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}\n</tool_call>',  # a brace short
    '<tool_call>\n{"nome": "bash", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "bash", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"arguments": {}, "name": 3}\n</tool_call>',
    '<tool_call>\n{"name": "bash", "arguments": {}} trailing\n</tool_call>',
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"',  # cut off by max_tokens
])
def test_hermes_invalid_blocks_are_content_and_valid_ones_still_calls(block):
    text = "Before " + block + " after\n" + hermes_call("bash", '{"command": "pwd"}')
    parsed = extract(HERMES, text)
    if block.endswith("</tool_call>"):
        assert parsed.content == "Before " + block + " after"
        assert [c.name for c in parsed.tool_calls] == ["bash"]
    else:  # an unterminated block holds the rest of the reply
        assert parsed == ParsedOutput(text, ())


def test_hermes_other_key_order_and_string_arguments_are_read_whole():
    text = (hermes_call("x", "{}").replace('{"name": "x", "arguments": {}}', '{"arguments": {"a": 1}, "name": "f"}')
            + hermes_call("g", '"{\\"b\\": 2}"'))
    parsed = extract(HERMES, text)
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [("f", '{"a": 1}'), ("g", '{"b": 2}')]


def test_an_unterminated_last_call_with_complete_json_is_a_call():
    parsed = extract(HERMES, 'Hi\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n')
    assert parsed.content == "Hi" and parsed.tool_calls[0].arguments_json == '{"command": "ls"}'


# ------------------------------------------------------------------------------------------- llama / mistral
def test_llama3_json_calls_with_and_without_the_python_tag():
    text = '{"name": "bash", "parameters": {"command": "ls"}}; {"name": "noop", "parameters": {}}'
    parsed = extract(LLAMA, text)
    assert parsed.content is None
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [("bash", '{"command": "ls"}'), ("noop", "{}")]
    tagged = extract(LLAMA, 'Let me run it.<|python_tag|>{"name": "bash", "arguments": {"command": "ls"}}\n\nok')
    assert tagged.content == "Let me run it.\n\nok" and tagged.tool_calls[0].name == "bash"


def test_llama3_json_that_is_not_a_call_is_content():
    for text in ('{"result": 42}', '{"name": "bash", "parameters": 3}',
                 'Sure: {"name": "bash", "parameters": {}}',
                 '{"name": "bash", "parameters": {"command": "ls"'):
        assert extract(LLAMA, text) == ParsedOutput(text, ())


def test_mistral_array_of_calls_and_nine_character_ids():
    text = 'Running.[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}}, {"name": "noop", "arguments": {}}]'
    parsed = extract(MISTRAL, text)
    assert parsed.content == "Running."
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [("bash", '{"command": "ls"}'), ("noop", "{}")]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in parsed.tool_calls)
    broken = extract(MISTRAL, '[TOOL_CALLS] [{"name": "bash", "arguments": {}}, oops]')
    assert [c.name for c in broken.tool_calls] == ["bash"] and broken.content == "oops]"
    assert extract(MISTRAL, "[TOOL_CALLS] []") == ParsedOutput("[TOOL_CALLS] []", ())


def test_call_ids_look_like_openais_and_repeat_with_a_seeded_generator():
    ids = HERMES.call_ids(random.Random(7))
    first = [ids() for _ in range(3)]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in first) and len(set(first)) == 3
    again = HERMES.call_ids(random.Random(7))
    assert [again() for _ in range(3)] == first
    counter = iter(range(100))
    parsed = HERMES.extract(hermes_call("a", "{}") + hermes_call("b", "{}"), lambda: f"call_{next(counter)}")
    assert [c.id for c in parsed.tool_calls] == ["call_0", "call_1"]


# ------------------------------------------------------------------------------------------- streaming
STREAM_CASES = {
    "hermes": [
        "I will look.\n" + hermes_call("read_file", '{"path": "a.py", "limit": 3}') + "\n"
        + hermes_call("bash", '{"command": "grep -n \\"{\\" x"}') + "\nDone.",
        hermes_call("noop", "{}"),
        "a < b <tool_ <tool_call>\nbad\n</tool_call> tail",
        '<tool_call>\n{"arguments": {"a": [1, {"b": null}]}, "name": "f"}\n</tool_call>',
        '\n\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n',
        "Plain reply, ends with spaces.  \n",
    ],
    "llama3_json": [
        '{"name": "bash", "parameters": {"command": "ls"}}; {"name": "noop", "parameters": {}}',
        'Sure.<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}} then text',
        '{"result": [1, 2, {"x": "}"}]}',
        "Just text with <|python_ in it",
    ],
    "mistral": [
        'Ok [TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}}, {"name": "noop", "arguments": {}}] bye',
        '[TOOL_CALLS] {"name": "bash", "arguments": {"command": "[x]"}}',
        '[TOOL_CALLS] [{"name": "bash", "arguments": {}}, oops] rest',
        "no calls [TOOL_ here",
    ],
}


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in STREAM_CASES.items() for t in ts])
def test_streaming_one_character_at_a_time_and_cut_at_every_position(name, text):
    parser = get_tool_parser(name)
    assert_stream_matches(parser, text, list(range(1, len(text) + 1)))
    for cut in range(len(text) + 1):
        assert_stream_matches(parser, text, [cut])


def test_a_partial_marker_is_held_back_until_the_text_decides():
    stream = HERMES.stream(HERMES.call_ids(random.Random(0)))
    assert stream.feed("Hi <tool_ca") == [{"content": "Hi"}]
    assert stream.feed("Hi <tool_cat") == [{"content": " <tool_cat"}]
    stream = HERMES.stream(HERMES.call_ids(random.Random(0)))
    assert stream.feed("Hi\n<tool_call>\n{\"name\": \"ba") == [{"content": "Hi"}]
    deltas = stream.feed('Hi\n<tool_call>\n{"name": "bash", "arguments": {"comm')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "bash"}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"comm'}}]}
    assert stream.tool_calls_sent == 1


def test_a_call_cut_inside_its_arguments_streams_as_announced_and_its_text_as_content():
    """The documented exception: the stream cannot take back a call it announced."""
    text = 'Hi\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls'
    deltas, _ = stream_chunks(HERMES, text, list(range(1, len(text) + 1)))
    streamed = reassemble(deltas)
    assert extract(HERMES, text) == ParsedOutput(text, ())
    assert streamed.content == text
    assert [(c.name, c.arguments_json) for c in streamed.tool_calls] == [("bash", '{"command": "ls')]


_PLAIN = st.text(alphabet="ab <>[]{}\"\n;_|/tolcTOLC", max_size=12)
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(alphabet='ab"}{]\\ <>/\n', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("abc", max_size=3), inner, max_size=3),
    max_leaves=6)
_ARGUMENTS = st.dictionaries(st.text(alphabet="abc_", min_size=1, max_size=4), _JSON_VALUES, max_size=3)
_NAMES = st.sampled_from(["bash", "read_file", "f_2", "a-b"])


def _call_text(parser_name: str, name: str, arguments: dict, indent: int | None) -> str:
    body = json.dumps(arguments, indent=indent)
    if parser_name == "hermes":
        return hermes_call(name, body)
    key = "parameters" if parser_name == "llama3_json" else "arguments"
    return f'{{"name": "{name}", "{key}": {body}}}'


@st.composite
def replies(draw, parser_name: str) -> str:
    """A reply in the parser's format: content and calls (and, for hermes, invalid blocks) interleaved."""
    calls = [_call_text(parser_name, draw(_NAMES), draw(_ARGUMENTS), draw(st.sampled_from([None, 1])))
             for _ in range(draw(st.integers(0, 3)))]
    if parser_name == "hermes":
        invalid = st.sampled_from(["<tool_call>\nnope\n</tool_call>", "<tool_call>{}</tool_call>"])
        blocks = calls + draw(st.lists(invalid, max_size=1))
        draw(st.randoms()).shuffle(blocks)
        parts = [draw(_PLAIN)]
        for block in blocks:
            parts += [block, draw(_PLAIN)]
        return "".join(parts)
    if parser_name == "llama3_json":
        return (draw(_PLAIN) + "<|python_tag|>" if draw(st.booleans()) else "") + "; ".join(calls) + draw(_PLAIN)
    return draw(_PLAIN) + ("[TOOL_CALLS] [" + ", ".join(calls) + "]" if calls else "") + draw(_PLAIN)


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streamed_in_random_chunks_reassembles_to_extract(parser_name, data):
    parser = get_tool_parser(parser_name)
    text = data.draw(replies(parser_name))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_matches(parser, text, cuts)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_hermes_replies_of_valid_calls_parse_back_to_those_calls(data):
    calls = data.draw(st.lists(st.tuples(_NAMES, _ARGUMENTS), min_size=1, max_size=3))
    text = "\n".join(hermes_call(name, json.dumps(arguments)) for name, arguments in calls)
    parsed = extract(HERMES, text)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments_json)) for c in parsed.tool_calls] == calls


# ------------------------------------------------------------------------------------------- grammars
def render(spec, rng: random.Random, instance) -> str:
    """A string matching ``spec``, the tiny reference: JSON parts take ``instance(schema)``."""
    if isinstance(spec, Literal):
        return spec.text
    if isinstance(spec, JsonSchema):
        return json.dumps(instance(spec.schema))
    if isinstance(spec, Concat):
        return "".join(render(part, rng, instance) for part in spec.parts)
    if isinstance(spec, Alternatives):
        return render(rng.choice(spec.options), rng, instance)
    if isinstance(spec, Repeat):
        count = rng.randint(spec.min_count, spec.max_count if spec.max_count is not None else spec.min_count + 2)
        return spec.separator.join(render(spec.item, rng, instance) for _ in range(count))
    raise AssertionError(f"unexpected spec {spec!r}")


def make_instance(rng: random.Random):
    """An instance generator for the schemas call_grammar builds from TOOLS."""
    def instance(schema):
        if "anyOf" in schema:
            return instance(rng.choice(schema["anyOf"]))
        if "const" in schema:
            return schema["const"]
        kind = schema.get("type")
        if kind == "array":
            count = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
            return [instance(schema["items"]) for _ in range(count)]
        if kind == "object":
            properties = schema.get("properties", {})
            keep = [k for k in properties if k in schema.get("required", ()) or rng.random() < 0.5]
            return {k: instance(properties[k]) for k in keep}
        return {"string": "x/y.py", "integer": 3}[kind]
    return instance


def parameters_of(name: str) -> dict:
    return next(t["function"].get("parameters", {"type": "object"}) for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False),
                                             ({"type": "function", "function": {"name": "bash"}}, True)])
def test_what_the_call_grammar_admits_parses_back_to_valid_calls(parser_name, choice, parallel):
    parser = get_tool_parser(parser_name)
    spec = parser.call_grammar(TOOLS, choice, parallel)
    rng = random.Random(3)
    counts = set()
    for _ in range(40):
        text = render(spec, rng, make_instance(rng))
        parsed = extract(parser, text)
        assert parsed.content is None and parsed.tool_calls, text
        counts.add(len(parsed.tool_calls))
        for call in parsed.tool_calls:
            if isinstance(choice, dict):
                assert call.name == "bash"
            jsonschema.validate(json.loads(call.arguments_json), parameters_of(call.name))
    assert (max(counts) > 1) == (choice == "required" and parallel)


def test_hermes_call_grammar_is_the_documented_block():
    spec = HERMES.call_grammar(TOOLS, {"type": "function", "function": {"name": "noop"}}, True)
    assert spec == Concat((Literal("<tool_call>\n"), JsonSchema({
        "type": "object", "properties": {"name": {"const": "noop"}, "arguments": {"type": "object", "properties": {}}},
        "required": ["name", "arguments"], "additionalProperties": False}), Literal("\n</tool_call>")))
    parallel = HERMES.call_grammar(TOOLS, "required", True)
    assert isinstance(parallel, Repeat) and parallel.separator == "\n" and parallel.min_count == 1
    assert len(parallel.item.parts[1].schema["anyOf"]) == 3


def test_call_grammar_refuses_what_it_cannot_force():
    for parser in (HERMES, LLAMA, MISTRAL):
        assert parser.call_grammar(TOOLS, "auto") is None and parser.call_grammar(TOOLS, "none") is None
        with pytest.raises(ValueError, match="not in 'tools'"):
            parser.call_grammar(TOOLS, {"type": "function", "function": {"name": "rm"}})
        with pytest.raises(ValueError, match="at least one tool"):
            parser.call_grammar([], "required")
        with pytest.raises(ValueError, match="unknown tool_choice"):
            parser.call_grammar(TOOLS, "sometimes")


# ------------------------------------------------------------------------------------------- registry
def test_registry_and_detection_from_templates():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral"):
        get_tool_parser("qwen")
    assert detect_tool_parser('{{- "<tool_call>\\n{\\"name\\": <function-name>}" }}') == "hermes"
    assert detect_tool_parser("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser('<|start_header_id|>{"name": function name, "parameters": dict}') == "llama3_json"
    assert detect_tool_parser("{{ message.content }}") is None and detect_tool_parser(None) is None


QWEN_GGUF = pulled_model_path("qwen2.5-coder-1.5b")


@pytest.mark.slow
def test_qwen_template_is_detected_as_hermes():
    if not QWEN_GGUF.is_file():
        pytest.skip(f"{QWEN_GGUF} not pulled (draftwise pull qwen2.5-coder-1.5b)")
    from draftwise.models.gguf_tokenizer import gguf_metadata

    template = str(gguf_metadata(QWEN_GGUF, ("tokenizer.chat_template",))["tokenizer.chat_template"])
    assert detect_tool_parser(template) == "hermes"
