"""Penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` through the server: served (the same text with
speculation as without at temperature 0, and with a seed), they change the output, and bad values are
OpenAI-style 400s naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest

from test_server import PROMPTS, plain, plain_bundle, plain_url, spec, spec_bundle, spec_url  # noqa: F401  (fixtures)

FIELDS = {"presence_penalty": 0.5, "frequency_penalty": 0.4}
EXTRAS = {"repetition_penalty": 1.2, "min_tokens": 12, "min_p": 0.05}


def complete(client: openai.OpenAI, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 24, **kwargs}
    return client.completions.create(model="stories", prompt=PROMPTS[0], **kwargs).choices[0]


def token_id(bundle, text: str) -> int:
    """The last token id of ``text`` in the served model's tokenizer."""
    return bundle.target.encode(text)[-1]


def test_the_fields_are_served_and_the_same_with_speculation(spec, plain, spec_bundle):  # noqa: F811
    the = str(token_id(spec_bundle, " the"))
    kwargs = dict(**FIELDS, logit_bias={the: 3.0}, extra_body=EXTRAS)
    with_spec, without = complete(spec, **kwargs), complete(plain, **kwargs)
    assert with_spec.text == without.text
    assert with_spec.text != complete(plain).text  # the fields changed the output
    seeded = dict(kwargs, temperature=0.9, seed=5)
    assert complete(spec, **seeded).text == complete(plain, **seeded).text
    chat = spec.chat.completions.create(model="stories", messages=[{"role": "user", "content": PROMPTS[1]}],
                                        temperature=0, max_tokens=16, **kwargs)
    assert chat.choices[0].message.content


def test_min_tokens_holds_off_the_stop_tokens(spec, spec_bundle):  # noqa: F811
    period = token_id(spec_bundle, ".")
    free = spec.completions.create(model="stories", prompt=PROMPTS[0], temperature=0, max_tokens=40,
                                   extra_body={"stop_token_ids": [period]})
    held = spec.completions.create(model="stories", prompt=PROMPTS[0], temperature=0, max_tokens=40,
                                   extra_body={"stop_token_ids": [period], "min_tokens": 30})
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 30
    assert held.usage.completion_tokens >= 30


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),  # stories260K's vocabulary is 512 tokens
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_values_are_400s_naming_the_field(spec_url, endpoint, body, param):  # noqa: F811
    prompt = {"prompt": "hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(f"{spec_url}/v1/{endpoint}", json={"model": "stories", "max_tokens": 8, **prompt, **body},
                       timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert len(error["message"]) < 300


def test_non_finite_values_are_400s(spec_url):  # noqa: F811
    for field in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        body = '{"model": "stories", "prompt": "hi", "max_tokens": 4, "%s": NaN}' % field
        reply = httpx.post(f"{spec_url}/v1/completions", content=body, headers={"content-type": "application/json"},
                           timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
