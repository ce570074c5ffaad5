"""Log-probabilities through the server with the official ``openai`` client: chat ``logprobs`` / ``top_logprobs``,
completions ``logprobs`` (with ``echo``, the prompt's tokens first), vLLM's ``prompt_logprobs``, streamed and not,
on stories260K's lean runtime (row-invariant: the values with speculation equal plain decoding's bit for bit at
temperature 0), and the 400s for bad counts."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from draftwise.builder import EngineBundle
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.ngram import NgramProposer
from draftwise.server import ServerSettings, create_app
from test_server import CHAT_TEMPLATE, live_server
from test_server_tools import ADD, QUESTION, tool_url  # noqa: F401  (fixture)

MESSAGES = [{"role": "user", "content": "Once upon a time there was a little dog."}]
PROMPT = "Lily and Ben went to the park. They saw"


@pytest.fixture(scope="module")
def lean_target(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    return load_model(str(stories_path), device="cpu", runtime="lean")


def _url(target, proposer, k):
    engine = SpeculativeEngine(target.backend, proposer, k, eos_token_ids=target.eos_token_ids)
    settings = ServerSettings(served_model_names=("stories",), chat_template=CHAT_TEMPLATE)
    return live_server(create_app(EngineBundle(target=target, core=engine.core), settings))


@pytest.fixture(scope="module")
def clients(lean_target, draftwise_home, stories_path):
    """``plain``, ``draft`` (a 3-layer lean draft, K=4) and ``ngram`` (K=8) servers over their own lean targets."""
    from draftwise.models.loading import derive_layer_draft, load_model

    def target():
        return load_model(str(stories_path), device="cpu", runtime="lean")

    draft_target = target()
    draft = derive_layer_draft(draft_target, num_layers=3)
    with _url(lean_target, None, 0) as plain, \
            _url(draft_target, DraftModelProposer(draft.backend, draft_target.backend.vocab_size), 4) as drafted, \
            _url(target(), NgramProposer(), 8) as ngram:
        yield {name: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
               for name, url in (("plain", plain), ("draft", drafted), ("ngram", ngram))}


def _chat(client, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 24, "logprobs": True, "top_logprobs": 3, **kwargs}
    return client.chat.completions.create(model="stories", messages=MESSAGES, **kwargs)


def _as_tuples(content):
    return [(e.token, e.logprob, tuple(e.bytes), tuple((t.token, t.logprob) for t in e.top_logprobs))
            for e in content]


def test_chat_logprobs_with_speculation_equal_plain_exactly(clients):
    plain = _chat(clients["plain"]).choices[0]
    assert len(plain.logprobs.content) == 24  # one per generated token (max_tokens, no EOS on this prompt)
    for name in ("draft", "ngram"):
        reply = _chat(clients[name])
        choice = reply.choices[0]
        assert choice.message.content == plain.message.content
        assert _as_tuples(choice.logprobs.content) == _as_tuples(plain.logprobs.content), name
        assert reply.usage.model_extra["speculative"]["num_draft_tokens"] > 0


def test_chat_top_logprobs_are_sorted_and_hold_the_greedy_token(clients):
    content = _chat(clients["draft"], top_logprobs=5).choices[0].logprobs.content
    text = _chat(clients["draft"], logprobs=False, top_logprobs=None).choices[0].message.content
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content).strip() == text.strip()
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5 and entry.token == bytes(entry.bytes).decode()


def test_streamed_chat_chunks_carry_logprobs_that_add_up_to_the_reply(clients):
    whole = _chat(clients["draft"]).choices[0]
    streamed, text = [], ""
    for chunk in _chat(clients["draft"], stream=True):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            streamed += choice.logprobs.content
            assert choice.logprobs.content or choice.finish_reason  # no empty logprobs on a content chunk
    assert text == whole.message.content
    assert _as_tuples(streamed) == _as_tuples(whole.logprobs.content)


def test_completion_logprobs_streamed_and_not_and_equal_plain(clients):
    kwargs = {"model": "stories", "prompt": PROMPT, "temperature": 0, "max_tokens": 16, "logprobs": 2}
    plain = clients["plain"].completions.create(**kwargs).choices[0]
    choice = clients["ngram"].completions.create(**kwargs).choices[0]
    assert choice.text == plain.text and choice.logprobs == plain.logprobs
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(16)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 2 <= len(top) <= 3 and max(top.values()) == value  # greedy: the best
    tokens, values, offsets = [], [], []
    for chunk in clients["ngram"].completions.create(stream=True, **kwargs):
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, values, offsets) == (lp.tokens, lp.token_logprobs, lp.text_offset)


def test_logprobs_follow_the_grammar(clients):
    """The rows are processed by the request's grammar: the alternatives are the tokens it allows."""
    choices = ["yes", "no", "maybe"]
    reply = _chat(clients["draft"], top_logprobs=20, extra_body={"guided_choice": choices}).choices[0]
    assert reply.message.content in choices
    first = reply.logprobs.content[0]
    allowed = {c.encode()[:n] for c in choices for n in range(1, len(c) + 1)}
    assert 1 <= len(first.top_logprobs) < 20 and all(bytes(t.bytes) in allowed for t in first.top_logprobs)
    assert sum(math.exp(t.logprob) for t in first.top_logprobs) == pytest.approx(1.0, abs=1e-4)


def test_prompt_logprobs_on_both_endpoints(clients, lean_target):
    ids = lean_target.encode(PROMPT)
    reply = clients["draft"].completions.create(model="stories", prompt=PROMPT, temperature=0, max_tokens=2,
                                                extra_body={"prompt_logprobs": 2})
    field = reply.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    for token, ranked in zip(ids[1:], field[1:]):
        assert str(token) in ranked and {entry["rank"] for entry in ranked.values()} >= {1, 2}
    plain = clients["plain"].completions.create(model="stories", prompt=PROMPT, temperature=0, max_tokens=2,
                                                extra_body={"prompt_logprobs": 2})
    assert plain.choices[0].model_extra["prompt_logprobs"] == field
    assert reply.choices[0].logprobs is None  # only what was asked for
    chat = _chat(clients["draft"], max_tokens=2, logprobs=False, top_logprobs=None,
                 extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 5
    streamed = [c.model_extra.get("prompt_logprobs") for c in _chat(
        clients["draft"], max_tokens=2, logprobs=False, top_logprobs=None, stream=True,
        extra_body={"prompt_logprobs": 0})]
    assert [p for p in streamed if p is not None] == [chat.model_extra["prompt_logprobs"]]


def test_echo_with_logprobs_puts_the_prompts_tokens_first_streamed_and_not(clients, lean_target):
    ids = lean_target.encode(PROMPT)
    kwargs = {"model": "stories", "prompt": PROMPT, "temperature": 0, "max_tokens": 6, "logprobs": 2}
    generated = clients["plain"].completions.create(**kwargs).choices[0]
    prompt_field = clients["plain"].completions.create(
        **{**kwargs, "max_tokens": 1}, extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    choice = clients["ngram"].completions.create(echo=True, **kwargs).choices[0]
    assert choice.text == PROMPT + generated.text
    assert choice.model_extra.get("prompt_logprobs") is None  # not asked for: only inside logprobs
    lp, count = choice.logprobs, len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == count + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert lp.token_logprobs[1:count] == [prompt_field[i][str(ids[i])]["logprob"] for i in range(1, count)]
    for i in range(1, count):  # the prompt token and its 2 most likely alternatives
        top = lp.top_logprobs[i]
        assert top[lp.tokens[i]] == lp.token_logprobs[i] and 1 <= len(top) <= 3
        assert set(top.values()) <= {entry["logprob"] for entry in prompt_field[i].values()}
    assert lp.tokens[count:] == generated.logprobs.tokens
    assert lp.token_logprobs[count:] == generated.logprobs.token_logprobs
    assert lp.top_logprobs[count:] == generated.logprobs.top_logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(count + 6)]
    text, tokens, values, offsets = "", [], [], []
    for chunk in clients["ngram"].completions.create(echo=True, stream=True, **kwargs):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert (text, tokens, values, offsets) == (choice.text, lp.tokens, lp.token_logprobs, lp.text_offset)


def test_no_logprobs_unless_asked(clients):
    reply = _chat(clients["draft"], logprobs=False, top_logprobs=None, max_tokens=4)
    assert reply.choices[0].logprobs is None and reply.model_extra.get("prompt_logprobs") is None


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"prompt_logprobs": -2}, "prompt_logprobs"),
])
def test_bad_counts_are_400s_naming_the_field(clients, path, body, param):
    base = str(clients["draft"].base_url).rstrip("/")
    payload = {"model": "stories", **({"messages": MESSAGES} if path.startswith("chat") else {"prompt": PROMPT}),
               **body}
    reply = httpx.post(f"{base}/{path}", json=payload, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


# ---------------------------------------------------------------------- the Responses API
def test_responses_include_output_text_logprobs_streamed_and_not(clients):
    kwargs = {"model": "stories", "input": "Once upon a time there was a little dog.", "temperature": 0,
              "max_output_tokens": 12, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = clients["draft"].responses.create(**kwargs)
    part = response.output[0].content[0]
    chat = _chat(clients["plain"], max_tokens=12, top_logprobs=2).choices[0]
    assert part.text == chat.message.content
    assert [(e.token, e.logprob, tuple((t.token, t.logprob) for t in e.top_logprobs)) for e in part.logprobs] == \
        [(e.token, e.logprob, tuple((t.token, t.logprob) for t in e.top_logprobs)) for e in chat.logprobs.content]
    deltas, done = [], None
    for event in clients["draft"].responses.create(stream=True, **kwargs):
        if event.type == "response.output_text.delta":
            deltas += event.logprobs
        elif event.type == "response.output_text.done":
            done = event.logprobs
    assert [(e.token, e.logprob) for e in deltas] == [(e.token, e.logprob) for e in done] == \
        [(e.token, e.logprob) for e in part.logprobs]
    plain = clients["draft"].responses.create(**{**kwargs, "include": None, "top_logprobs": None})
    assert plain.output[0].content[0].logprobs == []


def test_responses_top_logprobs_without_the_include_is_a_400(clients):
    base = str(clients["draft"].base_url).rstrip("/")
    for body, param in (({"top_logprobs": 3}, "top_logprobs"),
                        ({"top_logprobs": 30, "include": ["message.output_text.logprobs"]}, "top_logprobs")):
        reply = httpx.post(f"{base}/responses", json={"model": "stories", "input": "hi", **body}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param


def test_a_stop_string_keeps_the_logprobs_of_the_tokens_counted(clients):
    """Cut by a stop string: one logprob per counted token (up to the one that completed it), streamed or not."""
    free = _chat(clients["draft"], max_tokens=24).choices[0].message.content
    stop = free.strip().split()[2]  # a word a few tokens in
    reply = _chat(clients["draft"], stop=[stop])
    assert reply.choices[0].finish_reason == "stop" and stop not in reply.choices[0].message.content
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens < 24
    assert stop in "".join(e.token for e in content)
    streamed = [e for chunk in _chat(clients["draft"], stop=[stop], stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert _as_tuples(streamed) == _as_tuples(content)


def test_a_huge_count_is_a_short_400(clients):
    base = str(clients["draft"].base_url).rstrip("/")
    body = '{"model": "stories", "prompt": "hi", "logprobs": -' + "9" * 400 + "}"
    reply = httpx.post(f"{base}/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs"
    assert len(reply.json()["error"]["message"]) < 200


# ---------------------------------------------------------------------- a reply of tool calls (scripted model)
@pytest.fixture(scope="module")
def tool_client(tool_url) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=f"{tool_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_tool_call_replies_carry_every_tokens_logprobs_streamed_and_not(tool_client):
    kwargs = {"model": "tool-model", "messages": QUESTION, "tools": [ADD], "logprobs": True, "top_logprobs": 1}
    reply = tool_client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert len(choice.logprobs.content) == reply.usage.completion_tokens
    assert "<tool_call>" in "".join(e.token for e in choice.logprobs.content)  # the call's tokens are there
    streamed, calls = [], 0
    for chunk in tool_client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
        calls += bool(chunk.choices and chunk.choices[0].delta.tool_calls)
    assert calls and _as_tuples(streamed) == _as_tuples(choice.logprobs.content)
