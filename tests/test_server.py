"""The OpenAI-compatible server end to end: real uvicorn servers on loopback ports, the real stories260K model,
and the official ``openai`` client.

Two servers run for the module: ``spec`` (stories260K + a real derived draft of its first 4 layers, K=3: an
imperfect draft, so the exactness check means something) and ``plain`` (a separately loaded stories260K with
plain decoding, behind an API key). Both get a small test chat template, since stories260K has none.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
import uvicorn

from draftwise.builder import EngineBundle
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.draft_model import DraftModelProposer
from draftwise.proposers.hybrid import HybridProposer
from draftwise.proposers.suffix import SuffixProposer
from draftwise.server import ServerSettings, create_app

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
API_KEY = "test-key"
PROMPTS = ["Once upon a time", "Lily and Ben went to the park. They saw", "The little dog", "One day, Tom"]


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids OpenMP barrier stalls."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running(server: uvicorn.Server, join_s: float = 15, must_stop: bool = False):
    """Run a uvicorn server in a background thread until the block ends; yields its base URL. With
    ``must_stop``, fail if the server thread has not ended ``join_s`` seconds after it was told to exit."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(join_s)
        if must_stop:
            assert not thread.is_alive(), "server did not stop"


@contextmanager
def live_server(app):
    """Run an app with uvicorn on a free loopback port in a background thread; yields the base URL."""
    with running(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))) as url:
        yield url


@pytest.fixture(scope="module")
def spec_bundle(draftwise_home, stories_path):
    from draftwise.models.loading import derive_layer_draft, load_model

    target = load_model(str(stories_path), device="cpu")
    draft = derive_layer_draft(target, 4)
    config = SpeculativeConfig(model=draft.name, num_speculative_tokens=3)
    engine = SpeculativeEngine(target.backend, DraftModelProposer(draft.backend, target.backend.vocab_size), 3,
                               eos_token_ids=target.eos_token_ids)
    return EngineBundle(target=target, core=engine.core, speculative_config=config, draft=draft)


@pytest.fixture(scope="module")
def plain_bundle(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    target = load_model(str(stories_path), device="cpu")
    return EngineBundle(target=target, core=SpeculativeEngine(target.backend, eos_token_ids=target.eos_token_ids).core)


@pytest.fixture(scope="module")
def hybrid_url(draftwise_home, stories_path):
    """A third server: the hybrid (suffix decoding or the 2-layer derived draft; fixed costs: a draft token
    costs a tenth of a target pass), for the per-side counts."""
    from draftwise.models.loading import derive_layer_draft, load_model

    @dataclass
    class Costs:
        draft_seconds_per_token: float = 0.1

        def verify_cost(self, num_tokens: int) -> float:
            return 1.0 + 0.05 * (num_tokens - 1)

    target = load_model(str(stories_path), device="cpu")
    draft = derive_layer_draft(target, 2)
    proposer = HybridProposer(SuffixProposer(), DraftModelProposer(draft.backend, target.backend.vocab_size), Costs(),
                              max_k=3, priced_by_engine=False)
    engine = SpeculativeEngine(target.backend, proposer, 3, eos_token_ids=target.eos_token_ids)
    config = SpeculativeConfig(method="hybrid", model=draft.name, num_speculative_tokens=3)
    bundle = EngineBundle(target=target, core=engine.core, speculative_config=config, draft=draft)
    with live_server(create_app(bundle, ServerSettings(served_model_names=("stories",)))) as url:
        yield url


@pytest.fixture(scope="module")
def spec_url(spec_bundle):
    settings = ServerSettings(served_model_names=("stories", "stories-alias"), chat_template=CHAT_TEMPLATE,
                              disconnect_poll_s=0.1)
    with live_server(create_app(spec_bundle, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def plain_url(plain_bundle):
    settings = ServerSettings(served_model_names=("stories",), chat_template=CHAT_TEMPLATE, api_key=API_KEY)
    with live_server(create_app(plain_bundle, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def spec(spec_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{spec_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(plain_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{plain_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt: str, **kwargs):
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model="stories", prompt=prompt, **kwargs)


def stream_text(client: openai.OpenAI, prompt: str, **kwargs) -> tuple[str, str | None]:
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    text, finish = "", None
    for chunk in client.completions.create(model="stories", prompt=prompt, stream=True, **kwargs):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def metric(base_url: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        match = re.match(r"^([^{\s]+)(?:\{(.*)\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def wait_idle(base_url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{base_url}/health").json()
        if health["requests_running"] == 0 and health["requests_waiting"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server stayed busy")


# ---------------------------------------------------------------------- basics
def test_models_and_health(spec, spec_url):
    ids = [m.id for m in spec.models.list().data]
    assert ids == ["stories", "stories-alias"]
    health = httpx.get(f"{spec_url}/health").json()
    assert health["status"] == "ok" and health["method"] == "draft_model"


def test_greedy_text_is_identical_with_and_without_speculation(spec, plain, plain_bundle):
    for prompt in PROMPTS[:3]:
        fast = complete(spec, prompt, max_tokens=32)
        slow = complete(plain, prompt, max_tokens=32)
        assert fast.choices[0].text == slow.choices[0].text and fast.choices[0].text
        assert fast.choices[0].finish_reason == slow.choices[0].finish_reason
        assert fast.usage.completion_tokens == slow.usage.completion_tokens
        assert stream_text(spec, prompt, max_tokens=32) == (fast.choices[0].text, fast.choices[0].finish_reason)
        # the text is the detokenized plain-decoding oracle (leading spaces kept)
        target = plain_bundle.target
        oracle = plain_bundle.engine.generate(target.encode(prompt), SamplingParams(max_tokens=32))
        assert prompt + fast.choices[0].text == target.decode(target.encode(prompt) + oracle.token_ids)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    fast_chat = spec.chat.completions.create(model="stories", messages=messages, max_tokens=32, temperature=0)
    slow_chat = plain.chat.completions.create(model="stories", messages=messages, max_tokens=32, temperature=0)
    assert fast_chat.choices[0].message.content == slow_chat.choices[0].message.content
    assert fast_chat.choices[0].message.role == "assistant"


def test_usage_carries_speculative_statistics(spec, plain):
    fast = complete(spec, PROMPTS[0], max_tokens=32)
    stats = fast.usage.speculative  # extra field: the openai client keeps it
    assert fast.usage.prompt_tokens > 0 and fast.usage.completion_tokens == 32
    assert fast.usage.total_tokens == fast.usage.prompt_tokens + 32
    assert stats["method"] == "draft_model" and stats["num_speculative_tokens"] == 3
    assert stats["num_draft_tokens"] > 0 and 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["acceptance_rate"] == pytest.approx(stats["num_accepted_tokens"] / stats["num_draft_tokens"])
    assert 1.0 <= stats["mean_accepted_length"] <= 4.0
    assert len(stats["acceptance_by_position"]) == 3
    assert stats["hybrid_steps"] is None  # only the hybrid method counts its sides
    slow = complete(plain, PROMPTS[0], max_tokens=8)
    assert slow.usage.speculative["method"] == "plain" and slow.usage.speculative["num_draft_tokens"] == 0


def test_usage_of_plain_and_one_token_requests(spec, plain):
    """Nothing drafted: acceptance_rate is null (not 0.0) and mean_accepted_length 1.0 (not 0.0), as documented."""
    for client, max_tokens in ((plain, 8), (plain, 1), (spec, 1)):
        stats = complete(client, PROMPTS[0], max_tokens=max_tokens).usage.speculative
        assert stats["num_draft_tokens"] == 0
        assert stats["acceptance_rate"] is None and stats["mean_accepted_length"] == 1.0


def test_plain_server_names_why_it_refuses_a_k(plain, plain_url):
    """A plain server takes ``num_speculative_tokens`` 0 and says it decodes plainly when asked for more."""
    zero = complete(plain, PROMPTS[0], max_tokens=2, extra_body={"num_speculative_tokens": 0})
    assert zero.usage.speculative["num_speculative_tokens"] == 0
    response = httpx.post(f"{plain_url}/v1/completions", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"prompt": "hi", "max_tokens": 2, "num_speculative_tokens": 5})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "num_speculative_tokens" and "decodes plainly" in error["message"], error


def test_chat_streaming_matches_non_streaming(spec):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A dog story."}]
    whole = spec.chat.completions.create(model="stories-alias", messages=messages, max_tokens=24, temperature=0)
    chunks = list(spec.chat.completions.create(model="stories-alias", messages=messages, max_tokens=24,
                                               temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.model == "stories" and whole.object == "chat.completion"


def test_raw_sse_format(spec_url):
    body = {"model": "stories", "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{spec_url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]


# ---------------------------------------------------------------------- stop strings, seeds
def test_stop_strings_cut_exactly_like_openai(spec):
    full = complete(spec, PROMPTS[0], max_tokens=40).choices[0].text
    stop = full[12:16]
    assert stop.strip(), full
    expected = full[:full.index(stop)]
    cut = complete(spec, PROMPTS[0], max_tokens=40, stop=stop)
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 40
    assert stream_text(spec, PROMPTS[0], max_tokens=40, stop=stop) == (expected, "stop")
    later = full[20:23]
    both = complete(spec, PROMPTS[0], max_tokens=40, stop=[later, stop])  # the first to complete wins
    first = min((stop, later), key=lambda s: full.index(s) + len(s))
    assert both.choices[0].text == full[:full.index(first)]
    absent = complete(spec, PROMPTS[0], max_tokens=40, stop=["\x00never"])
    assert absent.choices[0].text == full and absent.choices[0].finish_reason == "length"


def test_seed_makes_sampling_reproducible(spec):
    kwargs = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    first = complete(spec, PROMPTS[2], seed=1234, **kwargs).choices[0].text
    again = complete(spec, PROMPTS[2], seed=1234, **kwargs).choices[0].text
    streamed, _ = stream_text(spec, PROMPTS[2], seed=1234, **kwargs)
    assert first == again == streamed
    others = {complete(spec, PROMPTS[2], seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert len(others | {first}) > 1


# ---------------------------------------------------------------------- concurrency, disconnects
def test_sixteen_concurrent_streaming_clients(spec, spec_url):
    expected = {p: complete(spec, p, max_tokens=16).choices[0].text for p in PROMPTS}
    client = openai.AsyncOpenAI(base_url=f"{spec_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt: str) -> tuple[str, str, str | None]:
        text, finish = "", None
        stream = await client.completions.create(model="stories", prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return prompt, text, finish

    async def all_clients():
        try:
            return await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(16)))
        finally:
            await client.close()

    results = asyncio.run(all_clients())
    assert len(results) == 16
    for prompt, text, finish in results:
        assert text == expected[prompt] and finish == "length"


def test_disconnecting_clients_free_the_engine(spec, spec_url):
    wait_idle(spec_url)
    aborted_before = metric(spec_url, "draftwise:request_success_total", finished_reason="abort")
    tokens_before = metric(spec_url, "draftwise:generation_tokens_total")
    expected = complete(spec, PROMPTS[1], max_tokens=16).choices[0].text
    tokens_before += 16
    long_body = {"model": "stories", "prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True,
                 "temperature": 0, "stream": True}
    results: dict[str, str] = {}

    def bystander():  # queued behind the long request; must complete untouched
        results["text"], results["finish"] = stream_text(spec, PROMPTS[1], max_tokens=16)

    with httpx.stream("POST", f"{spec_url}/v1/completions", json=long_body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        other = threading.Thread(target=bystander)
        other.start()
        time.sleep(0.2)
        # leaving the block closes the connection mid-stream
    other.join(60)
    assert results == {"text": expected, "finish": "length"}

    # a non-streaming client that gives up (timeout) is noticed too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{spec_url}/v1/completions", json={**long_body, "stream": False}, timeout=0.5)
    wait_idle(spec_url)
    assert metric(spec_url, "draftwise:request_success_total", finished_reason="abort") == aborted_before + 2
    generated = metric(spec_url, "draftwise:generation_tokens_total") - tokens_before
    assert generated < 1500  # both long requests stopped early (the bystander added 16)
    assert complete(spec, PROMPTS[1], max_tokens=16).choices[0].text == expected


# ---------------------------------------------------------------------- bad input
LONG_PROMPT = "Once upon a time there was a little girl. " * 300
BAD_REQUESTS = [
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("completions", {"model": "stories"}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", '{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("completions", "[" * 100000, 400, None),
    ("completions", '{"prompt": "hi", "seed": 99999999999999999999999999}', 400, "seed"),
    ("completions", {"prompt": "hi", "seed": -3}, 400, "seed"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "hi", "stop": ""}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": [1]}, 400, "stop"),
    ("completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),  # OpenAI allows 0..5
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),  # the tokenizer would give [BOS]: still empty
    ("completions", {"prompt": [[]]}, 400, "prompt"),
    ("completions", r'{"prompt": "once \ud800"}', 400, "prompt"),  # a lone surrogate
    ("completions", r'{"prompt": "hi", "model": "\ud800"}', 400, "model"),
    ("completions", '{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("completions", '{"prompt": "hi", "top_p": -Infinity}', 400, "top_p"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    # found by a new-user test: these three were accepted (200), or refused with a message that contradicted itself
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
                          "max_tokens": -5}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools.0"),  # tools are served (tests/test_server_tools.py); a tool without a function is malformed
    ("chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages"),
    ("chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "\ud800"}]}]}', 400,
     "messages.0.content.0.type"),
    # a speculative setting in a request body was silently ignored (found by a new-user test): it is the server's
    ("completions", {"prompt": "hi", "k_policy": "auto"}, 400, "k_policy"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                          "speculative_config": {"method": "ngram"}}, 400, "speculative_config"),
    ("completions", {"prompt": "hi", "K_Policy": "auto"}, 400, "K_Policy"),
    ("completions", {"prompt": "hi", "draft_model": "x"}, 400, "draft_model"),
    # the --speculative-config fields without a speculative word in their names were logged and ignored (200)
    ("completions", {"prompt": "hi", "method": "ngram"}, 400, "method"),
    ("completions", {"prompt": "hi", "catch_up": "deferred"}, 400, "catch_up"),
    ("completions", {"prompt": "hi", "backend": "llama.cpp"}, 400, "backend"),
    ("completions", {"prompt": "hi", "suffix_decoding_min_token_prob": 0.5}, 400, "suffix_decoding_min_token_prob"),
    # vLLM extras that change the output were ignored (200): min_p 0.99 changed nothing (min_p is served now)
    ("completions", {"prompt": "hi", "length_penalty": 0.5}, 400, "length_penalty"),
    ("completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_json": "{not json"}, 400,
     "guided_json"),  # structured output is served; a schema that is not JSON is the client's fault
]


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(spec, spec_url):
    for endpoint, body, status, param in BAD_REQUESTS:
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
            else {"json": body}
        response = httpx.post(f"{spec_url}/v1/{endpoint}", timeout=30, **kwargs)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], body
        assert error["param"] == param, (body, error)
    assert complete(spec, PROMPTS[0], max_tokens=4).choices[0].text
    null_n = httpx.post(f"{spec_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": None}, timeout=30)
    assert null_n.status_code == 200, null_n.text  # OpenAI's API allows null for n (meaning 1)
    other = httpx.post(f"{spec_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "metadata": {"a": 1}},
                       timeout=30)
    assert other.status_code == 200, other.text  # another unknown field is ignored (and logged), as vLLM does
    for harmless in ({"fallback_policy": "x"}, {"drafts_enabled": True}, {"min_p": 0}, {"use_beam_search": False}):
        response = httpx.post(f"{spec_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **harmless},
                              timeout=30)
        assert response.status_code == 200, (harmless, response.text)  # whole words only; no-op values pass
    with pytest.raises(openai.BadRequestError, match="context length"):
        complete(spec, PROMPTS[0], max_tokens=10**6)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        spec.completions.create(model="nope", prompt="hi")
    assert httpx.get(f"{spec_url}/health").json()["status"] == "ok"
    assert httpx.get(f"{spec_url}/v1/nothing-here").status_code == 404


def test_chat_without_a_template_is_a_clear_400(plain_bundle):
    from fastapi.testclient import TestClient

    client = TestClient(create_app(plain_bundle))  # no lifespan: validation only, the engine is never used
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert "no chat template" in response.json()["error"]["message"]
    assert response.json()["error"]["code"] == "chat_template_missing"


def test_api_key(plain_url):
    anonymous = openai.OpenAI(base_url=f"{plain_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.completions.create(model="stories", prompt="hi", max_tokens=2)
    response = httpx.post(f"{plain_url}/v1/completions", content="{broken")  # 401 before the body is read
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{plain_url}/v1/models").status_code == 401
    assert httpx.get(f"{plain_url}/health").status_code == 200
    assert httpx.get(f"{plain_url}/metrics").status_code == 200
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{plain_url}/v1/models", headers=headers).json()["data"][0]["id"] == "stories"


# ---------------------------------------------------------------------- metrics
def test_metrics_follow_vllm_names(spec, spec_url):
    before = metric(spec_url, "draftwise:spec_decode_num_draft_tokens_total")
    result = complete(spec, PROMPTS[3], max_tokens=20)
    stats = result.usage.speculative
    assert metric(spec_url, "draftwise:spec_decode_num_draft_tokens_total") == before + stats["num_draft_tokens"]
    text = httpx.get(f"{spec_url}/metrics").text
    for name in ("draftwise:spec_decode_num_drafts_total", "draftwise:spec_decode_num_accepted_tokens_total",
                 "draftwise:generation_tokens_total", "draftwise:prompt_tokens_total",
                 "draftwise:e2e_request_latency_seconds_bucket", "draftwise:time_to_first_token_seconds_count",
                 "draftwise:request_queue_time_seconds_sum", "draftwise:num_requests_running",
                 "draftwise:num_requests_waiting"):
        assert name in text, name
    assert 'draftwise:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="stories",position="0"}' \
        in text
    accepted = metric(spec_url, "draftwise:spec_decode_num_accepted_tokens_total")
    per_position = metric(spec_url, "draftwise:spec_decode_num_accepted_tokens_per_pos_total")
    assert accepted == per_position > 0
    assert metric(spec_url, "draftwise:request_success_total", finished_reason="length") >= 1
    assert metric(spec_url, "draftwise:time_to_first_token_seconds_count") >= 1


def test_hybrid_steps_in_usage_and_metrics(hybrid_url):
    """A hybrid server reports each response's passes by side in ``usage.speculative.hybrid_steps`` and adds them
    to ``draftwise:spec_decode_hybrid_steps_total{side}``."""
    client = openai.OpenAI(base_url=f"{hybrid_url}/v1", api_key="unused", max_retries=0, timeout=120)
    name = "draftwise:spec_decode_hybrid_steps_total"
    before = {side: metric(hybrid_url, name, side=side) for side in ("suffix", "draft_model", "plain")}
    seen = dict.fromkeys(before, 0)
    for prompt in ("Once upon a time", "One two three. One two three. One two three. One two three. One two"):
        stats = complete(client, prompt, max_tokens=32).usage.speculative
        steps = stats["hybrid_steps"]
        assert stats["method"] == "hybrid" and set(steps) == set(before)
        assert steps["suffix"] + steps["draft_model"] == stats["num_drafts"] > 0
        seen = {side: seen[side] + n for side, n in steps.items()}
    assert seen["suffix"] > 0 and seen["draft_model"] > 0
    assert {side: metric(hybrid_url, name, side=side) - before[side] for side in before} == seen
    off = complete(client, PROMPTS[0], max_tokens=4, extra_body={"num_speculative_tokens": 0}).usage.speculative
    assert off["method"] == "plain" and off["hybrid_steps"] is None


def test_ignored_request_fields_are_logged_by_name(caplog):
    from draftwise.server.protocol import CompletionRequest
    from draftwise.server.validation import _check_extra_fields

    caplog.set_level("WARNING", logger="draftwise.server.validation")
    _check_extra_fields(CompletionRequest(prompt="hi", metadata={"a": 1}, foo=2))
    assert "request fields ignored" in caplog.text and "'foo', 'metadata'" in caplog.text
    caplog.clear()  # a name cannot forge a log line, and thousands of names make one short line
    _check_extra_fields(CompletionRequest(prompt="hi", **{"x\nINFO fake: pwned": 1}))
    assert "\nINFO fake" not in caplog.text and "\\nINFO fake" in caplog.text
    caplog.clear()
    _check_extra_fields(CompletionRequest(prompt="hi", **{f"f{i}": i for i in range(20000)}))
    assert "and 19990 more" in caplog.text and len(caplog.text) < 1000
    caplog.clear()
    _check_extra_fields(CompletionRequest(prompt="hi", num_speculative_tokens=2))
    assert not caplog.text
    _check_extra_fields(CompletionRequest(prompt="hi", stream=True, stream_options={"continuous_usage_stats": True}))
    assert "'stream_options.continuous_usage_stats'" in caplog.text
