"""Regression (issue 21, items 2 and 3): a fault injected into one request's part of a batched step fails that
request only (the others finish with the text they get alone); a fault no request can be told apart as the
cause fails all of them with an error that says so; ``/health`` turns 503 with the reason after repeated engine
failures and back to 200 after a success."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.quantization import int8_kernels_available
from draftwise.engine import EngineCore, UnattributedStepError
from draftwise.proposers.base import PerSequenceProposers
from draftwise.builder import EngineBundle
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.prefix_cache import PrefixCache
from draftwise.proposers.ngram import NgramProposer
from draftwise.server import ServerSettings, create_app
from draftwise.server.events import Failed, Finished
from draftwise.server.health import EngineHealth
from test_server import CHAT_TEMPLATE, live_server
from test_server_batching import decode, drain, request, scheduler_for, text_of

MODE = "int8" if int8_kernels_available() else "none"
POISON = 93  # a token id the helper prompts never hold (they use 2..91)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture()
def tiny_multi():
    return build_lean(tiny_llama(0).model, quantization=MODE, name="tiny-faults", num_slots=4)


class Poisoned:
    """Wraps ``model.forward_rows``: a pass whose rows hold the poison token raises (``always``: every pass)."""

    def __init__(self, model, always: bool = False) -> None:
        self.model, self.inner, self.always = model, model.forward_rows, always
        self.calls = 0

    def __enter__(self):
        self.model.forward_rows = self
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward_rows  # the instance attribute shadowed the method

    def __call__(self, rows, **kwargs):
        self.calls += 1
        if self.always or bool((rows.tokens == POISON).any()):
            raise RuntimeError("injected fault")
        return self.inner(rows, **kwargs)


def engine_for(target, prefix_cache=None) -> EngineCore:
    return EngineCore(target, PerSequenceProposers(lambda: NgramProposer(1, 3), "ngram"), 3,
                         prefix_cache=prefix_cache)


def test_a_fault_in_one_sequence_fails_it_alone(tiny_multi):
    clean = [list(request(n).prompt_ids) for n in (1, 2, 3)]
    alone = [engine_for(tiny_multi).generate([p], GREEDY)[0].token_ids for p in clean]
    engine = engine_for(tiny_multi)
    with Poisoned(engine.model):
        sequences = [engine.add(p, GREEDY) for p in clean[:2]]
        bad = engine.add(clean[2][:3] + [POISON] + clean[2][3:], GREEDY)
        sequences.append(engine.add(clean[2], GREEDY))
        errors = []
        while engine.has_work:
            errors += [o.error for o in engine.step() if o.error is not None]
    assert bad.finish_reason == "error" and len(errors) == 1 and "injected fault" in str(errors[0])
    assert [s.result.token_ids for s in sequences] == alone
    assert all(s.finish_reason == "length" for s in sequences)


def test_a_fault_no_sequence_can_be_told_apart_from_fails_all_and_says_so(tiny_multi):
    engine = engine_for(tiny_multi)
    with Poisoned(engine.model, always=True):
        for n in (1, 2):
            engine.add(request(n).prompt_ids, GREEDY)
        outputs = engine.step()
    assert len(outputs) == 2 and not engine.has_work
    assert all(isinstance(o.error, UnattributedStepError) and "cannot be attributed" in str(o.error)
               and "injected fault" in str(o.error) for o in outputs)


def test_a_failed_prefix_import_fails_only_that_request(tiny_multi, monkeypatch):
    engine = engine_for(tiny_multi, PrefixCache(1 << 30))
    prompt = list(request(1).prompt_ids)
    first = engine.generate([prompt], GREEDY)[0].token_ids

    def broken(*args, **kwargs):
        raise RuntimeError("import failed")

    monkeypatch.setattr(engine.model.cache, "import_slot", broken)
    hit = engine.add(prompt, GREEDY)  # a prefix hit: its import fails
    other = engine.add(list(request(2).prompt_ids), GREEDY)  # no hit
    while engine.has_work:
        engine.step()
    assert hit.finish_reason == "error" and other.finish_reason == "length"
    monkeypatch.undo()
    assert engine.generate([prompt], GREEDY)[0].token_ids == first


def test_scheduler_fails_only_the_poisoned_request(tiny_multi):
    engine = engine_for(tiny_multi)
    scheduler, records, _ = scheduler_for(engine)
    good = request(4)
    poisoned = request(5)
    poisoned = type(poisoned)(poisoned.request_id, poisoned.prompt_ids + (POISON,), poisoned.params, ())

    async def scenario():
        return await asyncio.gather(drain(scheduler.submit(good)), drain(scheduler.submit(poisoned)))

    expected = decode(engine_for(tiny_multi).generate([list(good.prompt_ids)], good.params)[0].token_ids)
    try:
        with Poisoned(engine.model):
            good_events, bad_events = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert isinstance(good_events[-1], Finished) and text_of(good_events) == expected
    assert isinstance(bad_events[-1], Failed) and "injected fault" in str(bad_events[-1].error)
    assert scheduler.health.consecutive_failures == 0  # the good request's steps succeeded after it


def test_engine_health_counts_every_engine_failure_whatever_its_type():
    """Issue 50: a ValueError from inside the engine (``verify``, ``OneSlot.forward``, the llama.cpp slots) is the
    server's fault too; the client's faults never reach the engine (request validation refuses them)."""
    health = EngineHealth(unhealthy_after=2)
    health.failed(RuntimeError("boom"))
    assert health.unhealthy_reason() is None
    health.failed(ValueError("an internal fault raised as a ValueError"))
    assert "2 times in a row" in health.unhealthy_reason() and "ValueError: an internal" in health.unhealthy_reason()
    health.succeeded()
    assert health.unhealthy_reason() is None and health.consecutive_failures == 0
    with pytest.raises(ValueError):
        EngineHealth(0)


def test_health_is_503_after_repeated_engine_failures_and_200_after_a_success(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    target = load_model(str(stories_path), quantization=MODE, runtime="lean", num_slots=2)
    engine = engine_for(target.backend)
    bundle = EngineBundle(target=target, core=engine,
                          speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    settings = ServerSettings(served_model_names=("stories",), chat_template=CHAT_TEMPLATE)
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    with live_server(create_app(bundle, settings)) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        with Poisoned(engine.model, always=True):
            for _ in range(3):
                response = httpx.post(f"{url}/v1/completions", timeout=60, json=body)
                assert response.status_code == 500 and "injected fault" in response.json()["error"]["message"]
            health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json()["status"] == "unhealthy" and "injected fault" in health.json()["reason"]
        assert httpx.post(f"{url}/v1/completions", timeout=60, json=body).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
