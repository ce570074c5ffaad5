"""Whose fault an error is (issue 50, item 3): a :class:`RequestError` from request validation is the one source of
4xx, and validation refuses whatever the engine core's ``add`` would; every failure after a request is queued is a
5xx that ``/health`` counts, whatever its type (``verify``, ``OneSlot.forward`` and the llama.cpp slots raise
``ValueError`` for internal faults: those used to reach clients as 400s that ``/health`` never counted).

The server runs over the fakes of ``test_server_hardening``: a tokenizer with one id per character and the real
engine over a :class:`ScriptedLM`.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from draftwise.builder import EngineBundle
from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import LoadedModel
from draftwise.proposers.ngram import NgramProposer
from draftwise.server import ServerSettings, create_app
from draftwise.server.errors import RequestError
from draftwise.server.protocol import CompletionRequest
from draftwise.server.text import TextCodec
from draftwise.server.validation import EngineLimits, RequestValidator
from fakes import ScriptedLM
from test_server_hardening import CharTokenizer, ScriptedEngine, assert_openai_error, fake_bundle

VOCAB = 128  # CharTokenizer gives ord(c) (at most 255): ASCII is inside this vocabulary, "é" (233) is not
CONTEXT = 64
INTERNAL = "an internal fault raised as a ValueError"


def small_model(proposer=None, k: int = 3) -> tuple[SpeculativeEngine, LoadedModel]:
    """The real engine over a ScriptedLM of VOCAB ids and CONTEXT positions that always predicts id 50 ("2"),
    with the character tokenizer; ``proposer``: speculate up to ``k`` tokens."""
    lm = ScriptedLM(lambda prompt: (50, False, False), vocab_size=VOCAB, max_context=CONTEXT, name="small")
    engine = SpeculativeEngine(lm, proposer, k) if proposer is not None else SpeculativeEngine(lm)
    return engine, LoadedModel(backend=lm, tokenizer=CharTokenizer(), name="small", eos_token_ids=())


def break_forward(monkeypatch, engine: SpeculativeEngine) -> None:
    """Every target pass of a sequence whose prompt starts with ``VALUE`` raises a ValueError, as
    ``OneSlot.forward`` or the llama.cpp slots do for internal faults."""
    target, inner = engine.target, engine.target.forward

    def forward(token_ids, **kwargs):
        prompt = list(token_ids) if not target.tokens else target.tokens
        if CharTokenizer().decode(prompt).startswith("VALUE"):
            raise ValueError(INTERNAL)
        return inner(token_ids, **kwargs)

    monkeypatch.setattr(target, "forward", forward)


def test_a_value_error_inside_the_engine_step_is_a_500_counted_by_health(monkeypatch):
    engine = ScriptedEngine()
    break_forward(monkeypatch, engine)
    with TestClient(create_app(fake_bundle(engine))) as client:
        for n in range(2):
            response = client.post("/v1/completions", json={"prompt": f"VALUE {n}", "max_tokens": 2})
            error = assert_openai_error(response, 500)
            assert error["type"] == "server_error" and f"ValueError: {INTERNAL}" in error["message"]
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "VALUE streamed", "max_tokens": 2, "stream": True}) as streamed:
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert '"type": "server_error"' in lines[-2] and INTERNAL in lines[-2] and lines[-1] == "data: [DONE]"
        health = client.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["consecutive_engine_failures"] == 3 and INTERNAL in health.json()["reason"]
        assert client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["consecutive_engine_failures"] == 0


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "hi é"}, "prompt", None),  # the tokenizer gives an id outside the model's vocabulary
    ({"prompt": [1, VOCAB]}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": "x" * CONTEXT}, "prompt", "context_length_exceeded"),  # BOS + 64 ids: no room
    ({"prompt": "hi", "max_tokens": CONTEXT}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "hi", "num_speculative_tokens": 1}, "num_speculative_tokens", None),  # a plain server
])
def test_a_request_the_engine_would_refuse_is_a_400_naming_the_field_and_never_queued(body, param, code):
    engine, model = small_model()
    with TestClient(create_app(EngineBundle(target=model, core=engine.core))) as client:
        assert_openai_error(client.post("/v1/completions", json=body), 400, param, code)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["consecutive_engine_failures"] == 0
        assert engine.target.served == []  # refused before the queue: the engine never saw it
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("prompt, k", [
    ([], None), ([1, VOCAB], None), ([5, VOCAB - 1], None), ([2] * (CONTEXT - 1), None), ([2] * CONTEXT, None),
    ([2, 3], 0), ([2, 3], 3), ([2, 3], 4),
])
def test_validation_refuses_exactly_what_the_engine_core_refuses(prompt, k):
    """The server's validation and ``EngineCore.add`` agree on every prompt and K (so nothing ``add`` raises is
    the client's fault once a request passed validation)."""
    engine, model = small_model(NgramProposer(), k=3)
    validator = RequestValidator(TextCodec(model), EngineLimits.of(engine.core), ServerSettings(), "small")
    request = CompletionRequest(prompt=prompt, max_tokens=1, num_speculative_tokens=k)
    try:
        validator.completion(request)
        refused_by_validation = False
    except RequestError as exc:
        assert 400 <= exc.status < 500 and exc.param in ("prompt", "num_speculative_tokens")
        refused_by_validation = True
    try:
        engine.core.add(prompt, engine_params())
        if k is not None:  # the K check, on a fresh core
            engine.core.add([2], engine_params(), num_speculative_tokens=k)
        refused_by_engine = False
    except ValueError:
        refused_by_engine = True
    assert refused_by_validation == refused_by_engine


def engine_params() -> SamplingParams:
    return SamplingParams(max_tokens=1)


def test_a_request_error_is_always_a_4xx():
    assert RequestError("bad", param="prompt").status == 400
    assert RequestError("who?", param="model", status=404).to_body()["error"]["param"] == "model"
    with pytest.raises(ValueError, match="4xx"):
        RequestError("not a client's fault", status=500)


def test_the_engine_loop_counts_a_core_that_refuses_a_validated_request(monkeypatch):
    """Should ``add`` refuse a request that passed validation (a bug on the server's side), the client gets a
    500, and ``/health`` counts it."""
    engine = ScriptedEngine()

    def refuse(*args, **kwargs):
        raise ValueError("the core refused it")

    monkeypatch.setattr(engine.core, "add", refuse)
    with TestClient(create_app(fake_bundle(engine))) as client:
        error = assert_openai_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 500)
        assert "ValueError: the core refused it" in error["message"]
        assert client.get("/health").json()["consecutive_engine_failures"] == 1
