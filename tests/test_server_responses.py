"""``/v1/responses`` end to end: the official ``openai`` client's ``responses.create`` and ``responses.stream``
against ``draftwise serve`` on stories260K with a draft model: the answer is the chat completion of the same
conversation (greedy, so token for token), streamed and not, ``previous_response_id`` continues a kept
conversation, and bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_server import spec, spec_bundle, spec_url  # noqa: F401  (fixtures: one stories server with a draft)

QUESTION = "Once upon a time"


def test_responses_equal_the_chat_completion_of_the_same_conversation(spec):  # noqa: F811
    chat = spec.chat.completions.create(model="stories", messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": QUESTION}],
                                        max_tokens=24, temperature=0)
    response = spec.responses.create(model="stories", instructions="Be brief.", input=QUESTION,
                                     max_output_tokens=24, temperature=0)
    assert response.status in ("completed", "incomplete")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_streamed_response_equals_the_non_streamed_one(spec):  # noqa: F811
    whole = spec.responses.create(model="stories", input=QUESTION, max_output_tokens=20, temperature=0)
    with spec.responses.stream(model="stories", input=QUESTION, max_output_tokens=20, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    final = events[-1].response  # the SDK's get_final_response() wants "completed"; a cut one is "incomplete"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_previous_response_id_continues_the_kept_conversation(spec):  # noqa: F811
    first = spec.responses.create(model="stories", input=QUESTION, max_output_tokens=8, temperature=0)
    second = spec.responses.create(model="stories", input="And then?", previous_response_id=first.id,
                                   max_output_tokens=8, temperature=0)
    chat = spec.chat.completions.create(model="stories", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    unkept = spec.responses.create(model="stories", input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as refused:
        spec.responses.create(model="stories", input="more", previous_response_id=unkept.id)
    assert refused.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": 3}, "input"),
])
def test_bad_responses_requests_are_400s_naming_the_field(spec_url, body, param):  # noqa: F811
    reply = httpx.post(f"{spec_url}/v1/responses", json={"model": "stories", **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
