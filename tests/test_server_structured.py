"""Structured output through the server, with and without speculation: ``response_format`` ``json_schema`` /
``json_object``, vLLM's ``guided_*``, and a forced ``tool_choice`` always give output that parses (and validates),
the same with speculation as without, on stories260K (a grammar makes even a tiny model emit valid JSON)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from test_server import plain, plain_bundle, plain_url, spec, spec_bundle, spec_url  # noqa: F401  (fixtures)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "rating"],
          "properties": {"title": {"type": "string", "maxLength": 20}, "rating": {"enum": [1, 2, 3, 4, 5]}}}
MESSAGES = [{"role": "user", "content": "Once upon a time there was a little dog."}]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}


def chat(client: openai.OpenAI, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 80, **kwargs}
    return client.chat.completions.create(model="stories", messages=MESSAGES, **kwargs).choices[0]


def test_json_schema_output_validates_and_is_the_same_with_speculation(spec, plain):  # noqa: F811
    with_spec, without = chat(spec, response_format=JSON_SCHEMA), chat(plain, response_format=JSON_SCHEMA)
    assert with_spec.message.content == without.message.content
    assert with_spec.finish_reason == "stop", with_spec.message.content
    value = json.loads(with_spec.message.content)
    assert set(value) == {"title", "rating"} and isinstance(value["rating"], int)


def test_json_object_and_guided_fields_are_followed(spec, plain):  # noqa: F811
    obj = chat(spec, response_format={"type": "json_object"}, max_tokens=200)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    else:
        assert obj.message.content.startswith("{")
    choice = chat(spec, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.message.content in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    regex = chat(spec, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert regex.message.content == chat(plain, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"}).message.content
    assert len(regex.message.content) == 6 and regex.message.content[3] == "-"
    streamed = "".join(c.choices[0].delta.content or "" for c in spec.chat.completions.create(
        model="stories", messages=MESSAGES, temperature=0, max_tokens=80, response_format=JSON_SCHEMA, stream=True))
    assert streamed == chat(spec, response_format=JSON_SCHEMA).message.content


def test_usage_reports_the_grammar(spec):  # noqa: F811
    reply = spec.chat.completions.create(model="stories", messages=MESSAGES, temperature=0, max_tokens=80,
                                         response_format=JSON_SCHEMA)
    speculative = reply.usage.model_extra["speculative"]
    assert speculative["grammar_time_s"] > 0 and speculative["jump_forward_tokens"] >= 0


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                       "properties": 3}}}},
     "response_format"),
    ({"guided_regex": "([a-z"}, "guided_regex"),
    ({"guided_grammar": "root ::= nonsense ::="}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
])
def test_bad_grammars_are_400s_naming_the_field(spec_url, body, param):  # noqa: F811
    reply = httpx.post(f"{spec_url}/v1/chat/completions", json={"model": "stories", "messages": MESSAGES, **body},
                       timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert httpx.get(f"{spec_url}/health").json()["status"] == "ok"


# ---------------------------------------------------------------------- forced tool calls on a real model
MOOD = {"type": "function", "function": {"name": "set_mood", "description": "Record the story's mood",
                                         "parameters": {"type": "object", "required": ["mood", "why"],
                                                        "additionalProperties": False,
                                                        "properties": {"mood": {"enum": ["happy", "sad"]},
                                                                       "why": {"type": "string", "maxLength": 16}}}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string", "maxLength": 10}}}}}


def _tool_server(draftwise_home, stories_path, speculate: bool):
    from draftwise.builder import EngineBundle
    from draftwise.config import SpeculativeConfig
    from draftwise.engine import one_slot_core
    from draftwise.models.loading import derive_layer_draft, load_model
    from draftwise.proposers.draft_model import DraftModelProposer
    from draftwise.server import ServerSettings, create_app
    from test_server import live_server
    from tool_agents import HERMES_TEMPLATE

    target = load_model(str(stories_path), device="cpu")
    if speculate:
        draft = derive_layer_draft(target, 3)
        core = one_slot_core(target.backend, DraftModelProposer(draft.backend, target.backend.vocab_size), 4,
                             target.eos_token_ids)
        bundle = EngineBundle(target=target, core=core, speculative_config=SpeculativeConfig(model=draft.name),
                              draft=draft)
    else:
        bundle = EngineBundle(target=target, core=one_slot_core(target.backend, eos_token_ids=target.eos_token_ids))
    settings = ServerSettings(served_model_names=("stories",), chat_template=HERMES_TEMPLATE)
    return live_server(create_app(bundle, settings))


@pytest.fixture(scope="module")
def tool_clients(draftwise_home, stories_path):
    with _tool_server(draftwise_home, stories_path, True) as spec_tools, \
            _tool_server(draftwise_home, stories_path, False) as plain_tools:
        yield tuple(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
                    for url in (spec_tools, plain_tools))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "set_mood"}}])
def test_forced_tool_calls_parse_validate_and_are_the_same_with_speculation(tool_clients, tool_choice):
    spec_client, plain_client = tool_clients
    kwargs = {"model": "stories", "messages": MESSAGES, "tools": [MOOD, NOTE], "tool_choice": tool_choice,
              "temperature": 0, "max_tokens": 120, "parallel_tool_calls": False}
    with_spec = spec_client.chat.completions.create(**kwargs).choices[0]
    without = plain_client.chat.completions.create(**kwargs).choices[0]
    assert with_spec.finish_reason == "tool_calls" == without.finish_reason
    (call,) = with_spec.message.tool_calls
    (plain_call,) = without.message.tool_calls
    assert (call.function.name, call.function.arguments) == (plain_call.function.name, plain_call.function.arguments)
    arguments = json.loads(call.function.arguments)
    if call.function.name == "set_mood":
        assert arguments["mood"] in ("happy", "sad") and len(arguments["why"]) <= 16
    else:
        assert isinstance(tool_choice, str) and len(arguments["text"]) <= 10


def test_langchain_with_structured_output_gets_a_validated_object(spec_url):  # noqa: F811
    """langchain-openai's ``with_structured_output`` (a strict ``json_schema``) against the speculating server."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Review(BaseModel):
        title: str = Field(max_length=20)
        rating: int = Field(ge=1, le=5)

    llm = langchain_openai.ChatOpenAI(model="stories", base_url=f"{spec_url}/v1", api_key="unused", temperature=0,
                                      max_tokens=80, max_retries=0)
    schema = {"title": "Review", "type": "object", "additionalProperties": False, "required": ["title", "rating"],
              "properties": {"title": {"type": "string", "maxLength": 20}, "rating": {"enum": [1, 2, 3, 4, 5]}}}
    review = llm.with_structured_output(schema, method="json_schema", strict=True).invoke(MESSAGES[0]["content"])
    parsed = Review.model_validate(review)
    assert 1 <= parsed.rating <= 5 and len(parsed.title) <= 20
