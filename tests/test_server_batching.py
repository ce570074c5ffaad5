"""The server with continuous batching (draftwise.server.engine_loop over draftwise.batching): concurrent
streaming clients get exactly what sequential requests get, the queue limit answers 503 ``queue_full``, a
client that leaves frees its slot at the next step, shutdown fails waiting requests at once and running ones
after the grace period, a failed pass fails its requests and serving goes on, batching metrics.

End-to-end tests run a real uvicorn server over stories260K on the lean runtime with 4 slots; the scheduler's own
tests drive it with a tiny lean model whose engine steps can be held on a gate."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from conftest import tiny_llama
from draftwise.backends.lean import build_lean
from draftwise.backends.quantization import int8_kernels_available
from draftwise.engine import EngineCore
from draftwise.proposers.base import PerSequenceProposers
from draftwise.builder import EngineBundle
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.engine import SpeculativeEngine
from draftwise.proposers.ngram import NgramProposer
from draftwise.server import ServerSettings, create_app
from draftwise.server.engine_loop import EngineLoop
from draftwise.server.events import Aborted, Failed, Finished, QueueFullError, ServerClosingError, TextDelta
from draftwise.server.validation import GenerationRequest
from test_server import CHAT_TEMPLATE, PROMPTS, live_server, metric, wait_idle

MODE = "int8" if int8_kernels_available() else "none"
SLOTS = 4
WAITING = 4


class GatedEngine(EngineCore):
    """A batched engine whose every step waits for :attr:`gate` (set by default); counts its steps."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.steps = 0
        self.fail_next = False
        self.delay_s = 0.0  # seconds each step sleeps first (keeps requests running past a deadline)

    def step(self):
        assert self.gate.wait(30), "gate never opened"
        time.sleep(self.delay_s)
        self.steps += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the pass broke")
        return super().step()


# ---------------------------------------------------------------------------------------------- scheduler
@pytest.fixture(scope="module")
def tiny_multi():
    return build_lean(tiny_llama(0).model, quantization=MODE, name="tiny-batch", num_slots=SLOTS)


@pytest.fixture(scope="module")
def tiny_single():
    return build_lean(tiny_llama(0).model, quantization=MODE, name="tiny")


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def request(n: int, max_tokens: int = 10, length: int = 6, stops: tuple[str, ...] = ()) -> GenerationRequest:
    prompt = tuple((7 * n + 3 * j) % 90 + 2 for j in range(length))
    return GenerationRequest(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), stops)


async def drain(handle, timeout_s: float = 30) -> list:
    events = []
    while not handle.done:
        events.append(await asyncio.wait_for(handle.next_event(), timeout_s))
    return events


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def submit_together(scheduler, requests) -> list:
    """Submit requests so that the engine thread takes them in one go: it cannot take the first before the
    last is queued (the queue's lock is held, and it is reentrant, so submit can take it too). Without this the
    thread may start a step with only the first, and the others wait behind a gated step."""
    with scheduler._wakeup:
        return [scheduler.submit(r) for r in requests]


def scheduler_for(engine, max_waiting: int = 8):
    records, steps = [], []
    return EngineLoop(engine, decode, records.append, max_waiting, record_step=steps.append), records, steps


def test_requests_run_together_and_equal_each_alone(tiny_multi, tiny_single):
    engine = GatedEngine(tiny_multi, PerSequenceProposers(NgramProposer, "ngram"), 3, max_num_seqs=3)
    scheduler, records, steps = scheduler_for(engine)
    requests = [request(n, max_tokens=8 + n, length=5 + 9 * n) for n in range(7)]

    async def scenario():
        handles = [scheduler.submit(r) for r in requests]
        return [await drain(h) for h in handles]

    try:
        results = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    for r, events in zip(requests, results):
        expected = SpeculativeEngine(tiny_single).generate(r.prompt_ids, r.params).token_ids
        assert text_of(events) == decode(expected)
        assert isinstance(events[-1], Finished) and events[-1].completion_tokens == r.params.max_tokens
    assert max(s.num_sequences for s in steps) == 3  # at most max_num_seqs at once, and really together
    assert sorted(r.finished_reason for r in records) == ["length"] * 7
    assert all(r.ttft_s is not None and r.queue_time_s >= 0 for r in records)


def test_queue_limit_and_cancellations_free_slots(tiny_multi):
    engine = GatedEngine(tiny_multi, max_num_seqs=1)
    scheduler, records, _ = scheduler_for(engine, max_waiting=2)

    async def until(predicate):
        for _ in range(1000):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not reached")

    async def scenario():
        running = scheduler.submit(request(1, max_tokens=200))
        first = await running.next_event()  # it runs (streams) before the others arrive
        engine.gate.clear()
        waiting, later = scheduler.submit(request(2)), scheduler.submit(request(3))
        with pytest.raises(QueueFullError):
            scheduler.submit(request(4))
        waiting.cancel()  # a waiting request leaves the queue at once
        assert isinstance(await waiting.next_event(), Aborted) and scheduler.num_waiting == 1
        also = scheduler.submit(request(5))  # room again
        running.cancel()  # running: its slot frees at the next step
        engine.gate.set()
        await until(lambda: scheduler.num_running == 1)
        return first, await drain(later), await drain(also)

    try:
        first, later, also = asyncio.run(scenario())
    finally:
        engine.gate.set()
        scheduler.shutdown()
    assert isinstance(first, TextDelta)
    assert isinstance(later[-1], Finished) and isinstance(also[-1], Finished)
    assert sorted(r.finished_reason for r in records) == ["abort", "abort", "length", "length"]
    assert engine.num_running == 0 and engine.num_free_slots == 1


def test_stop_strings_end_a_sequence_in_the_batch(tiny_multi, tiny_single):
    engine = EngineCore(tiny_multi, max_num_seqs=2)
    scheduler, records, _ = scheduler_for(engine)
    plain = request(1, max_tokens=12)
    full = decode(SpeculativeEngine(tiny_single).generate(plain.prompt_ids, plain.params).token_ids)
    stop = full[4:6]
    stopped = request(1, max_tokens=12, stops=(stop,))

    async def scenario():
        handles = [scheduler.submit(stopped), scheduler.submit(request(2, max_tokens=30))]
        return [await drain(h) for h in handles]

    try:
        first, second = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert text_of(first) == full[:full.index(stop)] and first[-1].finish_reason == "stop"
    assert isinstance(second[-1], Finished) and second[-1].finish_reason == "length"


def test_shutdown_fails_waiting_at_once_and_running_after_the_grace(tiny_multi):
    engine = GatedEngine(tiny_multi, max_num_seqs=2)
    engine.delay_s = 0.02  # 500 tokens take longer than the grace period on any machine (a fast one finished)
    scheduler, records, _ = scheduler_for(engine)

    async def scenario():
        running = submit_together(scheduler, [request(n, max_tokens=500) for n in (1, 2)])
        for handle in running:
            assert isinstance(await handle.next_event(), TextDelta)
        waiting = scheduler.submit(request(3))
        scheduler.close(0.3)
        with pytest.raises(ServerClosingError):
            scheduler.submit(request(4))
        waiting_event = await asyncio.wait_for(waiting.next_event(), 5)
        ends = []
        for handle in running:  # still streaming during the grace, then failed
            event = await handle.next_event()
            while isinstance(event, TextDelta):
                event = await asyncio.wait_for(handle.next_event(), 10)
            ends.append(event)
        return waiting_event, ends

    try:
        waiting_event, ends = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert isinstance(waiting_event, Failed) and isinstance(waiting_event.error, ServerClosingError)
    assert all(isinstance(e, Failed) and isinstance(e.error, ServerClosingError) for e in ends)
    assert sorted(r.finished_reason for r in records) == ["abort"] * 3
    assert engine.num_running == 0


def test_running_requests_finish_within_the_grace(tiny_multi):
    engine = GatedEngine(tiny_multi, max_num_seqs=2)
    scheduler, _, _ = scheduler_for(engine)

    async def scenario():
        engine.gate.clear()
        handles = submit_together(scheduler, [request(n, max_tokens=5) for n in (1, 2)])
        await asyncio.sleep(0.1)
        scheduler.close(30)
        engine.gate.set()
        return [await drain(h) for h in handles]

    try:
        results = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert all(isinstance(events[-1], Finished) and events[-1].finish_reason == "length" for events in results)


def test_a_failed_pass_fails_its_requests_and_serving_goes_on(tiny_multi):
    engine = GatedEngine(tiny_multi, max_num_seqs=2)
    scheduler, records, _ = scheduler_for(engine)

    async def scenario():
        engine.gate.clear()
        doomed = submit_together(scheduler, [request(n) for n in (1, 2)])
        await asyncio.sleep(0.1)
        engine.fail_next = True
        engine.gate.set()
        failed = [await drain(h) for h in doomed]
        return failed, await drain(scheduler.submit(request(3)))

    try:
        failed, after = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert all(isinstance(events[-1], Failed) and "pass broke" in str(events[-1].error) for events in failed)
    assert isinstance(after[-1], Finished)
    assert sorted(r.finished_reason for r in records) == ["error", "error", "length"]


# ---------------------------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def stories_lean(draftwise_home, stories_path):
    from draftwise.models.loading import load_model

    return load_model(str(stories_path), quantization=MODE, runtime="lean", num_slots=SLOTS)


@pytest.fixture(scope="module")
def batch_bundle(stories_lean):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, k_policy="auto")
    engine = GatedEngine(stories_lean.backend, PerSequenceProposers(NgramProposer, "ngram"), 4,
                         eos_token_ids=stories_lean.eos_token_ids, max_num_batched_tokens=64, k_policy="auto")
    return EngineBundle(target=stories_lean, core=engine, speculative_config=config)


@pytest.fixture(scope="module")
def batch_url(batch_bundle):
    settings = ServerSettings(served_model_names=("stories",), chat_template=CHAT_TEMPLATE, disconnect_poll_s=0.1,
                              max_waiting_requests=WAITING)
    with live_server(create_app(batch_bundle, settings)) as url:
        yield url


def stream(url: str, prompt: str, max_tokens: int = 20, **extra) -> tuple[str, str | None]:
    body = {"model": "stories", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    text, finish = "", None
    for chunk in client.completions.create(**body):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_concurrent_streaming_clients_get_the_sequential_texts(stories_lean, stories_path, batch_url):
    """Eight streaming clients at once (4 slots: continuous batching with a queue) get exactly the texts the same
    requests get one at a time, and plain decoding on a one-request-at-a-time server."""
    prompts = PROMPTS + ["The sun was shining", "Sam had a red ball", "Once there was a cat", "Mia liked to"]
    sequential = {p: stream(batch_url, p) for p in prompts}
    from draftwise.models.loading import load_model
    from draftwise.server.text import OutputText

    single = load_model(str(stories_path), quantization=MODE, runtime="lean")
    for p in prompts[:4]:  # the one-request-at-a-time engine, plain decoding, through the server's text path
        ids = single.encode(p)
        oracle = SpeculativeEngine(single.backend, eos_token_ids=single.eos_token_ids).generate(
            ids, SamplingParams(max_tokens=20))
        output = OutputText(single.decode, ids)
        assert output.add_tokens(oracle.token_ids) + output.finish() == sequential[p][0]
    client = openai.AsyncOpenAI(base_url=f"{batch_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt: str):
        text, finish = "", None
        async for chunk in await client.completions.create(model="stories", prompt=prompt, max_tokens=20,
                                                           temperature=0, stream=True):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return prompt, text, finish

    async def everyone():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    before = metric(batch_url, "draftwise:batch_size_sum")
    results = asyncio.run(everyone())
    for prompt, text, finish in results:
        assert (text, finish) == sequential[prompt], prompt
    assert metric(batch_url, "draftwise:batch_size_sum") > before
    assert metric(batch_url, "draftwise:iteration_tokens_total_count") > 0
    assert metric(batch_url, "draftwise:spec_decode_batch_k_count") > 0
    assert 0 < metric(batch_url, "draftwise:engine_step_overhead_seconds") < 1.0  # measured, priced into K
    text = httpx.get(f"{batch_url}/metrics").text
    assert 'draftwise:batch_size_bucket{engine="0",le="4.0",model_name="stories"}' in text


def test_queue_full_is_a_503_and_disconnects_free_slots(batch_bundle, batch_url):
    engine = batch_bundle.core
    wait_idle(batch_url)
    statuses: list[int] = []

    def post(prompt: str) -> None:
        response = httpx.post(f"{batch_url}/v1/completions", timeout=60,
                              json={"model": "stories", "prompt": prompt, "max_tokens": 5})
        statuses.append(response.status_code)

    def long_stream(prompt: str) -> None:
        body = {"model": "stories", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{batch_url}/v1/completions", json=body, timeout=60) as response:
            statuses.append(response.status_code)
            for _ in response.iter_lines():
                pass

    def health() -> dict:
        return httpx.get(f"{batch_url}/health").json()

    def until(predicate) -> None:
        for _ in range(1500):
            if predicate():
                return
            threading.Event().wait(0.01)
        raise AssertionError("condition not reached")

    engine.gate.set()
    threads = [threading.Thread(target=long_stream, args=(f"Tom and {i}",)) for i in range(SLOTS)]
    try:
        for thread in threads:
            thread.start()
        until(lambda: health()["requests_running"] == SLOTS)  # all four slots taken
        engine.gate.clear()  # hold the engine before its next step
        threads += [threading.Thread(target=post, args=(f"Sue and {i}",)) for i in range(WAITING)]
        for thread in threads[SLOTS:]:
            thread.start()
        until(lambda: health()["requests_waiting"] == WAITING)
        response = httpx.post(f"{batch_url}/v1/completions", json={"model": "stories", "prompt": "x", "max_tokens": 3})
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "queue_full" and "overloaded" in error["message"]
    finally:
        engine.gate.set()
        for thread in threads:
            thread.join(60)
    assert statuses == [200] * (SLOTS + WAITING)

    # a streaming client that leaves frees its slot: the others go on
    aborted = metric(batch_url, "draftwise:request_success_total", finished_reason="abort")
    with httpx.stream("POST", f"{batch_url}/v1/completions", timeout=60,
                      json={"model": "stories", "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True,
                            "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break
    wait_idle(batch_url)
    assert metric(batch_url, "draftwise:request_success_total", finished_reason="abort") == aborted + 1
    assert engine.num_running == 0 and engine.num_free_slots == SLOTS
