"""The server under hostile input and shutdown (issue 15, "Server"): lone surrogates, oversized bodies,
tokenization that must not stall other clients, graceful shutdown with queued and running requests, the queue
limit with cancelled requests, the served model name, the API key, the empty prompt, engine failures.

Most tests run a real uvicorn server (:class:`DrainingServer`, as ``draftwise serve`` does) over a fake model
whose tokenizer maps characters to ids and whose engine is scripted by the prompt: ``WAIT...`` blocks on a gate
between tokens, ``FAIL...`` raises inside the engine, anything else yields ``max_tokens`` tokens. The test of
tokenization against the engine uses the real stories260K tokenizer and engine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from draftwise.builder import EngineBundle
from draftwise.commands.common import CliError
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import LoadedModel
from draftwise.server import ServerSettings, create_app
from draftwise.server.errors import APIError, error_body
from draftwise.server.middleware import bearer_token
from draftwise.server.engine_loop import EngineLoop
from draftwise.server.events import Failed, Finished, QueueFullError, ServerClosingError
from draftwise.server.settings import public_model_name
from draftwise.server.text import TextCodec
from draftwise.server.validation import GenerationRequest
from draftwise.server.serving import make_server
from fakes import ScriptedLM
from test_server import _free_port, running

SECRET_PATH = "/secret/place/fake-model.gguf"
BOS = 1


# ---------------------------------------------------------------------- fakes
class CharTokenizer:
    """One id per character (``ord``, below 256), BOS first. Like the Rust tokenizers, it cannot encode text
    that is not valid Unicode (a lone surrogate raises ``UnicodeEncodeError``). ``EXPLODE`` raises a
    ``RuntimeError`` (an unexpected internal error)."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        text.encode("utf-8")
        if text.startswith("EXPLODE"):
            raise RuntimeError("tokenizer exploded")
        return [BOS] + [min(ord(c), 255) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > BOS)


class ScriptedEngine(SpeculativeEngine):
    """The real engine over a :class:`ScriptedLM` that behaves by the prompt's first characters: ``WAIT`` waits
    for :attr:`gate` before every pass, ``FAIL`` raises in its first pass, anything else yields ``max_tokens``
    tokens ``"x"``. Records the prompts served."""

    def __init__(self) -> None:
        def rule(prompt: list[int]) -> tuple[int, bool, bool]:
            text = CharTokenizer().decode(prompt)
            return ord("x"), text.startswith("WAIT"), text.startswith("FAIL")

        super().__init__(ScriptedLM(rule, vocab_size=256, name=SECRET_PATH))

    @property
    def gate(self):
        return self.target.gate

    @property
    def served(self) -> list[str]:
        return [CharTokenizer().decode(prompt) for prompt in self.target.served]


def fake_bundle(engine: ScriptedEngine | None = None, name: str = SECRET_PATH) -> EngineBundle:
    engine = engine or ScriptedEngine()
    target = LoadedModel(backend=engine.target, tokenizer=CharTokenizer(), name=name, eos_token_ids=())
    return EngineBundle(target=target, core=engine.core)


@contextmanager
def live(app):
    """Serve ``app`` with :class:`DrainingServer` (what ``draftwise serve`` runs) on a loopback port in a
    thread; yields ``(base_url, server)``. Setting ``server.should_exit`` is what SIGTERM does."""
    server = make_server(app, port=_free_port(), log_level="warning")
    with running(server, join_s=30, must_stop=True) as url:
        yield url, server


def metric(base_url: str, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if not line.startswith(name + "{") or any(f'{k}="{v}"' not in line for k, v in labels.items()):
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def health(base_url: str) -> dict:
    return httpx.get(f"{base_url}/health").json()


def post_raw(base_url: str, path: str, body: str | bytes, **headers) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", content=body, headers={"content-type": "application/json", **headers},
                      timeout=30)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.fixture(scope="module")
def fake():
    """One fake server for the tests that do not shut it down: ``(base_url, engine)``."""
    engine = ScriptedEngine()
    settings = ServerSettings(max_request_bytes=4096, disconnect_poll_s=0.05)
    with live(create_app(fake_bundle(engine), settings)) as (url, _):
        yield url, engine
    engine.gate.set()


# ---------------------------------------------------------------------- 2. lone surrogates, encodable errors
SURROGATE_REQUESTS = [
    ("/v1/completions", r'{"prompt": "hi \ud800 there"}', "prompt"),
    ("/v1/completions", r'{"prompt": ["\udfff"]}', "prompt.0"),
    ("/v1/completions", r'{"prompt": "hi", "model": "\ud800"}', "model"),
    ("/v1/completions", r'{"prompt": "hi", "stop": "\ud800"}', "stop"),
    ("/v1/completions", r'{"prompt": "hi", "stop": ["ok", "\ud800"]}', "stop.1"),
    ("/v1/completions", r'{"prompt": "hi", "user": "\ud800"}', "user"),
    ("/v1/completions", r'{"prompt": "hi", "suffix": "\ud800"}', "suffix"),
    ("/v1/completions", r'{"prompt": "hi", "logit_bias": {"\ud800": 1}}', "logit_bias"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages.0.content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "\ud800", "text": "a"}]}]}',
     "messages.0.content.0.type"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "a", "name": "\udbff"}]}',
     "messages.0.name"),
    ("/v1/chat/completions", r'{"messages": [{"role": "\ud800", "content": "a"}]}', "messages.0.role"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_REQUESTS)
def test_lone_surrogates_in_any_string_are_400s(fake, path, body, param):
    url, _ = fake
    error = assert_openai_error(post_raw(url, path, body), 400, param)
    assert "\\ud" not in error["param"]


def test_valid_surrogate_pairs_and_unknown_fields_work(fake):
    url, _ = fake
    response = post_raw(url, "/v1/completions", r'{"prompt": "smile \ud83d\ude00", "max_tokens": 2, '
                        r'"temperature": 0, "some_extension": "\ud800"}')
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "xx"


def test_invalid_utf8_body_is_a_json_400(fake):
    url, _ = fake
    assert_openai_error(post_raw(url, "/v1/completions", b'{"prompt": "\xff\xfe"}'), 400)


def test_error_bodies_always_encode():
    """An error message that quotes a lone surrogate is escaped, never a failure to render the error."""
    response = APIError(404, "The model `\ud800` does not exist", param="model\udfff").to_response()
    body = json.loads(response.body)
    assert body["error"]["message"] == "The model `\\ud800` does not exist"
    assert body["error"]["param"] == "model\\udfff"
    assert error_body("a\ud800b")["error"]["message"].encode("utf-8") == b"a\\ud800b"


def _exchange(conn: http.client.HTTPConnection, body: str) -> tuple[int, dict]:
    conn.request("POST", "/v1/completions", body=body.encode("utf-8", "surrogatepass"),
                 headers={"content-type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_keep_alive_connection_survives_bad_input_and_internal_errors(fake):
    """A 400 for a surrogate and a 500 for an unexpected exception both leave the connection open: the next
    request is answered on the same socket."""
    url, _ = fake
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    try:
        status, body = _exchange(conn, '{"prompt": "ok", "max_tokens": 1}')
        assert status == 200
        sock = conn.sock
        status, body = _exchange(conn, r'{"prompt": "\ud800"}')
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = _exchange(conn, '{"prompt": "EXPLODE"}')
        assert status == 500 and body["error"]["type"] == "server_error"
        assert "RuntimeError" in body["error"]["message"]
        status, body = _exchange(conn, '{"prompt": "ok", "max_tokens": 3}')
        assert status == 200 and body["choices"][0]["text"] == "xxx"
        assert conn.sock is sock, "the server closed the keep-alive connection"
    finally:
        conn.close()


# ---------------------------------------------------------------------- 1. temperature / top_p validation
@pytest.mark.parametrize(("body", "param"), [
    ('{"prompt": "hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "hi", "temperature": -Infinity}', "temperature"),
    ('{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "hi", "temperature": -0.5}', "temperature"),
    ('{"prompt": "hi", "temperature": -1e-300}', "temperature"),
    ('{"prompt": "hi", "top_p": NaN}', "top_p"),
    ('{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ('{"prompt": "hi", "top_p": -0.1}', "top_p"),
    ('{"prompt": "hi", "top_p": 0}', "top_p"),
    ('{"prompt": "hi", "top_p": 1.5}', "top_p"),
])
def test_non_finite_or_negative_temperature_and_top_p_are_400s(fake, body, param):
    url, _ = fake
    assert_openai_error(post_raw(url, "/v1/completions", body), 400, param)


# ---------------------------------------------------------------------- 8. empty prompts
@pytest.mark.parametrize("prompt", ["", [""], [], [[]]])
def test_empty_prompts_are_400s(fake, prompt):
    url, _ = fake
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt}, timeout=30)
    error = assert_openai_error(response, 400, "prompt")
    assert "empty" in error["message"]


# ---------------------------------------------------------------------- 3. oversized bodies
def test_oversized_body_with_content_length_is_a_413(fake):
    url, _ = fake
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "a" * 5000}, timeout=30)
    error = assert_openai_error(response, 413, None, "request_too_large")
    assert "4096" in error["message"] and response.headers["connection"] == "close"


def test_oversized_chunked_body_is_a_413(fake):
    """No Content-Length: the bytes are counted as they arrive."""
    url, _ = fake

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    response = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413, None, "request_too_large")
    small = httpx.post(f"{url}/v1/completions", content=iter([b'{"prompt": "hi", ', b'"max_tokens": 2}']),
                       timeout=30, headers={"content-type": "application/json"})
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == "xx"


@dataclass
class GatedModel(LoadedModel):
    """A real model whose encoding of a text starting with ``BIG`` waits for :attr:`gate` (a long tokenization
    held open); counts the encodings running at once and the tokenizer objects they use."""

    gate: threading.Event = field(default_factory=threading.Event)
    entered: threading.Event = field(default_factory=threading.Event)
    stats: dict = field(default_factory=lambda: {"now": 0, "most": 0, "tokenizers": set()})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def encode(self, text: str) -> list[int]:
        with self.lock:
            self.stats["now"] += 1
            self.stats["most"] = max(self.stats["most"], self.stats["now"])
            self.stats["tokenizers"].add(id(self.tokenizer))
        try:
            if text.startswith("BIG"):
                self.entered.set()
                assert self.gate.wait(60), "gate never opened"
            return super().encode(text)
        finally:
            with self.lock:
                self.stats["now"] -= 1


def gated(model: LoadedModel) -> GatedModel:
    return GatedModel(backend=model.backend, tokenizer=model.tokenizer, name=model.name,
                      eos_token_ids=model.eos_token_ids)


def test_a_long_tokenization_stalls_neither_the_engine_nor_other_clients(stories):
    """While one request's prompt is being tokenized (held open here), a streaming request runs to its end
    (the engine thread decodes every token) and a small request is answered: both finish before it."""
    model = gated(stories)
    engine = SpeculativeEngine(model.backend, eos_token_ids=model.eos_token_ids)
    order: list[str] = []
    with live(create_app(EngineBundle(target=model, core=engine.core))) as (url, _):
        def big():
            response = httpx.post(f"{url}/v1/completions", json={"prompt": "BIG Once upon a time", "max_tokens": 4,
                                                                 "temperature": 0}, timeout=90)
            order.append(f"big {response.status_code}")

        thread = threading.Thread(target=big)
        thread.start()
        try:
            assert model.entered.wait(30)
            body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
                events = [line for line in response.iter_lines() if line]
            assert events[-1] == "data: [DONE]" and len(events) > 2
            order.append("stream done")
            small = httpx.post(f"{url}/v1/completions", json={"prompt": "Lily", "max_tokens": 4, "temperature": 0},
                               timeout=30)
            assert small.status_code == 200
            order.append("small done")
        finally:
            model.gate.set()
            thread.join(60)
    assert order == ["stream done", "small done", "big 200"]
    assert id(stories.tokenizer) not in model.stats["tokenizers"]  # encodings ran on copies


def test_tokenizer_copies_bound_parallel_encodings_and_never_block_decoding(stories):
    """transformers tokenizers are copied, never shared between threads: at most ``copies`` encodings run at
    once, each on its own copy, and decoding (the engine thread's copy) works while all are busy."""
    model = gated(stories)
    codec = TextCodec(model, copies=2)
    results: list[list[int]] = []

    def encode():
        results.append(codec.encode("BIG Once upon a time"))

    threads = [threading.Thread(target=encode) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: model.stats["now"] == 2)
        time.sleep(0.1)
        assert model.stats["now"] == 2  # the other two wait for a free copy
        assert codec.decode(stories.encode("Once upon a time")) == "Once upon a time"
    finally:
        model.gate.set()
        for thread in threads:
            thread.join(30)
    assert results == [stories.encode("BIG Once upon a time")] * 4
    assert model.stats["most"] == 2 and len(model.stats["tokenizers"]) == 2
    assert id(stories.tokenizer) not in model.stats["tokenizers"]


# ---------------------------------------------------------------------- 4. shutdown
def _start_stream(url: str, prompt: str, sink: list, max_tokens: int = 5) -> threading.Thread:
    """Stream a completion in a thread; ``sink`` receives ``(status, [event lines])``."""

    def run():
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            sink.append((response.status_code, [line for line in response.iter_lines() if line]))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _start_post(url: str, prompt: str, sink: list, max_tokens: int = 5) -> threading.Thread:
    def run():
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)
        sink.append((response.status_code, response.json()))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _assert_stream_failed_closing(status: int, events: list[str]) -> None:
    assert status == 200 and events[-1] == "data: [DONE]", events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_closing" and error["type"] == "server_error"


def test_shutdown_answers_queued_requests_503_and_fails_the_running_one_after_the_grace():
    engine = ScriptedEngine()
    app = create_app(fake_bundle(engine), ServerSettings(shutdown_grace_s=0.5))
    running, queued_post, queued_stream = [], [], []
    with live(app) as (url, server):
        threads = [_start_stream(url, "WAIT running", running)]
        wait_for(lambda: health(url)["requests_running"] == 1)
        threads += [_start_post(url, "queued", queued_post), _start_stream(url, "queued stream", queued_stream)]
        wait_for(lambda: health(url)["requests_waiting"] == 2)
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        for thread in threads:
            thread.join(30)
        engine.gate.set()  # let the engine thread leave its step
    status, body = queued_post[0]
    assert status == 503 and body["error"]["code"] == "server_closing" and body["error"]["type"] == "server_error"
    _assert_stream_failed_closing(*queued_stream[0])
    _assert_stream_failed_closing(*running[0])  # it never finished: failed after the grace period
    assert engine.served == ["WAIT running"]


def test_shutdown_lets_the_running_request_finish_within_the_grace():
    engine = ScriptedEngine()
    app = create_app(fake_bundle(engine), ServerSettings(shutdown_grace_s=30))
    running, queued = [], []
    with live(app) as (url, server):
        threads = [_start_post(url, "WAIT running", running, max_tokens=3)]
        wait_for(lambda: health(url)["requests_running"] == 1)
        threads.append(_start_post(url, "queued", queued))
        wait_for(lambda: health(url)["requests_waiting"] == 1)
        server.should_exit = True
        threads[1].join(30)
        assert queued and queued[0][0] == 503 and not running  # refused at once; the running one goes on
        engine.gate.set()
        threads[0].join(30)
    status, body = running[0]
    assert status == 200 and body["choices"][0]["text"] == "xxx" and body["choices"][0]["finish_reason"] == "length"


def test_new_requests_during_shutdown_get_503_server_closing():
    bundle = fake_bundle()
    app = create_app(bundle, ServerSettings())
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        app.state.draftwise.begin_shutdown()
        response = client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "server_closing"


def request(n: int, text: str = "WAIT") -> GenerationRequest:
    return GenerationRequest(f"r{n}", tuple(CharTokenizer().encode(f"{text} {n}")), SamplingParams(max_tokens=3))


async def _next(handle, timeout_s: float = 10):
    return await asyncio.wait_for(handle.next_event(), timeout_s)


def test_shutdown_while_a_request_runs_ends_its_handle():
    """The engine is stuck in a step: shutdown still gives the running request a Failed event at once."""
    engine, records = ScriptedEngine(), []
    scheduler = EngineLoop(engine.core, CharTokenizer().decode, records.append, max_waiting=4)

    async def scenario():
        running = scheduler.submit(request(1))
        waiting = scheduler.submit(request(2))
        await asyncio.to_thread(wait_for, lambda: engine.served == ["WAIT 1"])  # the engine is in its step
        await asyncio.to_thread(scheduler.shutdown, 0.2)
        return await _next(running), await _next(waiting)

    try:
        running_event, waiting_event = asyncio.run(scenario())
    finally:
        engine.gate.set()
    for event in (running_event, waiting_event):
        assert isinstance(event, Failed) and isinstance(event.error, ServerClosingError)
    assert engine.served == ["WAIT 1"]


# ---------------------------------------------------------------------- 5. queue limit and cancellation
def test_cancelled_waiting_requests_do_not_count_toward_the_queue_limit():
    engine, records = ScriptedEngine(), []
    scheduler = EngineLoop(engine.core, CharTokenizer().decode, records.append, max_waiting=2)

    async def scenario():
        running = scheduler.submit(request(1))
        await asyncio.to_thread(wait_for, lambda: engine.served == ["WAIT 1"])
        first, second = scheduler.submit(request(2)), scheduler.submit(request(3))
        with pytest.raises(QueueFullError):
            scheduler.submit(request(4))
        first.cancel()
        second.cancel()
        assert scheduler.num_waiting == 0
        third, fourth = scheduler.submit(request(5, "go")), scheduler.submit(request(6, "go"))  # room again
        engine.gate.set()
        return [await _drain(h) for h in (running, third, fourth)]

    try:
        results = asyncio.run(scenario())
    finally:
        engine.gate.set()
        scheduler.shutdown()
    assert all(isinstance(events[-1], Finished) for events in results)
    assert engine.served == ["WAIT 1", "go 5", "go 6"]
    assert sorted(r.finished_reason for r in records) == ["abort", "abort", "length", "length", "length"]


async def _drain(handle) -> list:
    events = [await _next(handle)]
    while not handle.done:
        events.append(await _next(handle))
    return events


# ---------------------------------------------------------------------- 6. served model name
@pytest.mark.parametrize(("spec", "name"), [
    ("/a/b/model.gguf", "model"),
    ("/a/b/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M"),
    ("models/x.GGUF", "x"),
    ("./llama-dir/", "llama-dir"),
    ("~/models/tiny", "tiny"),
    ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b"),
    ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B"),
])
def test_public_model_name(spec, name):
    assert public_model_name(spec) == name


def test_public_model_name_of_an_existing_directory(tmp_path):
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert public_model_name(str(tmp_path / "org" / "model")) == "model"


def test_the_target_path_never_appears_in_health_metrics_or_responses(fake):
    url, _ = fake
    texts = [httpx.get(f"{url}/health").text, httpx.get(f"{url}/metrics").text, httpx.get(f"{url}/v1/models").text,
             httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).text,
             httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "model": "nope"}).text,
             httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]}).text]
    for text in texts:
        assert "/secret" not in text and "secret/place" not in text, text
    assert httpx.get(f"{url}/health").json()["model"] == "fake-model"
    model = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert model["id"] == model["root"] == "fake-model"
    assert 'model_name="fake-model"' in texts[1]
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                     "model": "fake-model"}).json()["model"] == "fake-model"


# ---------------------------------------------------------------------- 7. API key
def _serve_plan(*argv: str):
    from draftwise.cli import build_parser
    from draftwise.commands.serve import plan_from_args

    return plan_from_args(build_parser().parse_args(["serve", "t.gguf", *argv]))


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_is_refused(key, monkeypatch):
    monkeypatch.delenv("DRAFTWISE_API_KEY", raising=False)
    with pytest.raises(CliError, match="--api-key is empty"):
        _serve_plan("--api-key", key)
    monkeypatch.setenv("DRAFTWISE_API_KEY", key)
    with pytest.raises(CliError, match="DRAFTWISE_API_KEY is empty"):
        _serve_plan()
    with pytest.raises(ValueError, match="empty"):
        ServerSettings(api_key=key)


def test_api_key_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv("DRAFTWISE_API_KEY", "from-env")
    assert _serve_plan().settings.api_key == "from-env"
    assert _serve_plan("--api-key", "from-flag").settings.api_key == "from-flag"
    monkeypatch.delenv("DRAFTWISE_API_KEY")
    assert _serve_plan().settings.api_key is None


@pytest.mark.parametrize(("header", "token"), [
    (b"Bearer k", b"k"), (b"bearer k", b"k"), (b"BEARER  k ", b"k"), (b"Basic k", None), (b"Bearer", None),
    (b"Bearerk", None), (b"", None),
])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_bearer_scheme_is_case_insensitive():
    from fastapi.testclient import TestClient

    client = TestClient(create_app(fake_bundle(), ServerSettings(api_key="sk-1")))
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        assert client.get("/v1/models", headers={"Authorization": f"{scheme} sk-1"}).status_code == 200, scheme
    for header in ("Bearer sk-2", "Basic sk-1", "sk-1", "Bearer"):
        response = client.get("/v1/models", headers={"Authorization": header})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", header


# ---------------------------------------------------------------------- 9. engine failures
def test_engine_failures_are_counted_and_logged_as_errors_not_aborts(fake, caplog):
    url, _ = fake
    errors_before = metric(url, "draftwise:request_success_total", finished_reason="error")
    aborts_before = metric(url, "draftwise:request_success_total", finished_reason="abort")
    with caplog.at_level(logging.INFO, logger="draftwise.server"):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "FAIL now", "max_tokens": 2}, timeout=30)
        wait_for(lambda: health(url)["requests_running"] == 0)
    error = assert_openai_error(response, 500)
    assert "the engine broke" in error["message"] and error["type"] == "server_error"
    assert metric(url, "draftwise:request_success_total", finished_reason="error") == errors_before + 1
    assert metric(url, "draftwise:request_success_total", finished_reason="abort") == aborts_before
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("draftwise.server")]
    assert any("engine failure: RuntimeError: the engine broke" in line for line in lines), lines
    assert not any("abandoned" in line for line in lines), lines
    again = httpx.post(f"{url}/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=30)
    assert again.status_code == 200  # the server keeps serving


# ---------------------------------------------------------------------- issue 21 A. the API docs
DOCS_PATHS = ["/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"]


@pytest.mark.parametrize("path", DOCS_PATHS)
def test_api_docs_are_not_served_by_default(path):
    from fastapi.testclient import TestClient

    for settings in (ServerSettings(), ServerSettings(api_key="sk-1")):
        headers = {"Authorization": "Bearer sk-1"} if settings.api_key else {}
        response = TestClient(create_app(fake_bundle(), settings)).get(path, headers=headers)
        assert response.status_code == 404 and response.json()["error"]["message"] == f"no such endpoint: GET {path}"


@pytest.mark.parametrize("path", DOCS_PATHS)
def test_enabled_api_docs_need_the_api_key_like_v1(path):
    from fastapi.testclient import TestClient

    client = TestClient(create_app(fake_bundle(), ServerSettings(api_key="sk-1", enable_docs=True)))
    for headers in ({}, {"Authorization": "Bearer sk-2"}, {"Authorization": "Basic sk-1"}):
        refused, v1_refused = client.get(path, headers=headers), client.get("/v1/models", headers=headers)
        assert refused.status_code == v1_refused.status_code == 401, (path, headers)
        assert refused.json() == v1_refused.json() and refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["www-authenticate"] == "Bearer"
    assert client.get(path, headers={"Authorization": "bearer sk-1"}).status_code == 200
    assert client.get("/health").status_code == 200  # still open


def test_enabled_api_docs_without_a_key_are_open_like_v1():
    from fastapi.testclient import TestClient

    client = TestClient(create_app(fake_bundle(), ServerSettings(enable_docs=True)))
    schema = client.get("/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    assert client.get("/docs").status_code == client.get("/redoc").status_code == 200


def test_enable_docs_flag():
    assert _serve_plan().settings.enable_docs is False
    assert _serve_plan("--enable-docs").settings.enable_docs is True


# ---------------------------------------------------------------------- issue 21 B. bodies the parser refuses
@pytest.fixture(scope="module")
def client():
    """A TestClient on a fake app with the default body limit (8 MiB)."""
    from fastapi.testclient import TestClient

    with TestClient(create_app(fake_bundle(), ServerSettings())) as test_client:
        yield test_client


def _post(client, body: bytes, path: str = "/v1/completions"):
    return client.post(path, content=body, headers={"content-type": "application/json"})


def _assert_served(client) -> None:
    """The server still answers a normal request."""
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "xx"


def _nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "extra": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(("body", "words"), [
    (b'{"prompt": "\xff\xfe"}', ["not valid UTF-8", "0xff", "offset 12"]),
    (b'{"prompt": "ok", "user": "\xc3"}', ["not valid UTF-8", "0xc3", "offset 26"]),
    (_nested(5000), ["nested deeper than 256 levels", "level 257", "line 1 column 282 (char 281)"]),
    (b"[" * 5000, ["nested deeper than 256 levels", "char 256"]),
    (b'{"prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", ["more than 4300 digits", "5000 digits"]),
    (b'{"prompt": "hi", "seed": -' + b"9" * 4301 + b"}", ["more than 4300 digits", "4301 digits"]),
    (b'{"prompt": "hi",\n "max_tokens": }', ["not valid JSON", "line 2 column 16 (char 32)"]),
], ids=["utf8-start", "utf8-truncated", "deep", "deep-unclosed", "digits", "negative-digits", "syntax"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bodies_the_parser_refuses_are_400s_naming_the_problem(client, path, body, words):
    response = _post(client, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] is None
    assert "error parsing the body" not in error["message"]
    for word in words:
        assert word in error["message"], (word, error["message"])
    _assert_served(client)


def test_what_the_parser_limits_leave_alone_is_served(client):
    """Nesting up to the limit, brackets and long digit runs inside strings, a UTF-8 BOM: all accepted."""
    from draftwise.server.body import MAX_JSON_DEPTH

    assert _post(client, _nested(MAX_JSON_DEPTH - 1)).status_code == 200
    brackets = json.dumps({"prompt": "[" * 1000 + "{" * 1000, "max_tokens": 1}).encode()
    assert _post(client, brackets).status_code == 200
    digits = json.dumps({"prompt": "hi", "max_tokens": 1, "seed": 7, "extra": "2" * 9000}).encode()
    assert _post(client, digits).status_code == 200
    assert _post(client, b"\xef\xbb\xbf" + json.dumps({"prompt": "hi", "max_tokens": 1}).encode()).status_code == 200


def test_nesting_past_the_recursion_limit_is_a_400_too(client, monkeypatch):
    """Should the depth limit ever exceed the interpreter's stack, the parser's RecursionError is a 400 too."""
    import draftwise.server.body as body_module

    monkeypatch.setattr(body_module, "MAX_JSON_DEPTH", 10**9)
    response = _post(client, _nested(100_000))
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]
    _assert_served(client)


@pytest.mark.parametrize(("best_of", "words"), [
    (0, ["must be at least 1", "got 0"]), (-3, ["must be at least 1", "got -3"]),
    (2, ["best_of=2 is more than this server runs at once", "--max-num-seqs 1"]),
])
def test_best_of_errors_say_what_is_wrong_with_the_value(client, best_of, words):
    response = client.post("/v1/completions", json={"prompt": "hi", "best_of": best_of})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "best_of"
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert client.post("/v1/completions", json={"prompt": "hi", "best_of": 1, "max_tokens": 1}).status_code == 200


def test_a_4300_digit_max_tokens_is_a_400_that_does_not_echo_it(client):
    """Regression: the context-length message printed prompt + max_tokens, which Python refuses to convert past
    4,300 digits (a 500)."""
    for name in ("max_tokens",):
        body = b'{"prompt": "x", "' + name.encode() + b'": ' + b"9" * 4300 + b"}"
        response = _post(client, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and error["code"] == "context_length_exceeded"
        assert "4300-digit number" in error["message"] and len(error["message"]) < 400
    _assert_served(client)


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/completions", {"functions": [{"name": "f"}]}, "tools"),
    ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
])
def test_fields_that_would_change_the_output_are_refused_on_both_endpoints(client, path, extra, param):
    """Regression: the completions endpoint accepted and ignored the chat-only fields docs/server.md says are
    refused; chat ignored top_logprobs and a required tool_choice."""
    body = {"max_tokens": 2, **extra}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    _assert_served(client)


@pytest.mark.parametrize("ids", [[99999], [-1], [2**70], [0] * 100000])
def test_stop_token_ids_outside_the_vocabulary_or_too_many_are_a_400(client, ids):
    """Regression: stop_token_ids were not range-checked (the tester's finding)."""
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": ids})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "stop_token_ids"
    _assert_served(client)


# ---------------------------------------------------------------------- defaults an agent expects
def test_no_max_tokens_means_the_rest_of_the_context_window(fake):
    """A request without ``max_tokens`` runs to the end of the context (vLLM's default), not to a fixed cap that
    cuts an agent's long reply with ``finish_reason: "length"``; ``--default-max-tokens`` still caps it."""
    url, _ = fake
    body = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=120).json()
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 4096  # ScriptedLM's context
    assert body["choices"][0]["finish_reason"] == "length"
    capped = ServerSettings(default_max_tokens=7)
    with live(create_app(fake_bundle(), capped)) as (capped_url, _):
        short = httpx.post(f"{capped_url}/v1/completions", json={"prompt": "hi"}, timeout=60).json()
    assert short["usage"]["completion_tokens"] == 7 and short["choices"][0]["text"] == "x" * 7
