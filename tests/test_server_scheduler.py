"""The server's request scheduler with a controllable fake engine: FIFO order, queue limit, cancellation of
waiting and running requests, stop strings stopping the engine, engine failures reported."""

from __future__ import annotations

import asyncio
import threading

import pytest

from draftwise.config import SamplingParams
from draftwise.engine import Generation, GenerationResult
from draftwise.server.requests import GenerationRequest
from draftwise.server.scheduler import Aborted, Failed, Finished, QueueFullError, Scheduler, TextDelta
from draftwise.stats import SpeculativeStats


class GatedEngine:
    """Yields one token per step, each step waiting for ``gate`` to be set; records the prompts it served."""

    def __init__(self, steps: int = 3) -> None:
        self.gate = threading.Event()
        self.steps = steps
        self.served: list[int] = []
        self.closed: list[int] = []

    def stream(self, prompt_ids, params, **request_options) -> Generation:
        request = prompt_ids[0]
        self.served.append(request)
        generated: list[int] = []

        def steps():
            for _ in range(self.steps):
                assert self.gate.wait(10)
                generated.append(request)
                yield [request]

        def finish(reason: str) -> GenerationResult:
            if len(generated) < self.steps:
                self.closed.append(request)
            return GenerationResult(list(generated), "length" if len(generated) == self.steps else reason,
                                    SpeculativeStats(num_generated_tokens=len(generated)))

        return Generation(steps(), finish)


class FailingEngine:
    def stream(self, prompt_ids, params, **request_options) -> Generation:
        def steps():
            raise RuntimeError("boom")
            yield []

        return Generation(steps(), lambda reason: GenerationResult([], reason, SpeculativeStats()))


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def request(n: int, stops: tuple[str, ...] = ()) -> GenerationRequest:
    return GenerationRequest(f"r{n}", (n,), SamplingParams(max_tokens=8), stops)


async def drain(handle) -> list:
    events = []
    while not handle.done:
        events.append(await asyncio.wait_for(handle.next_event(), 10))
    return events


async def until(predicate, timeout_s: float = 10) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_fifo_order_queue_limit_and_cancellation():
    engine, records = GatedEngine(), []
    scheduler = Scheduler(engine, decode, records.append, max_waiting=2)

    async def scenario():
        first = scheduler.submit(request(1))
        await until(lambda: scheduler.num_running == 1)
        second, third = scheduler.submit(request(2)), scheduler.submit(request(3))
        with pytest.raises(QueueFullError):
            scheduler.submit(request(4))
        second.cancel()  # waiting: skipped, never reaches the engine
        assert isinstance(await second.next_event(), Aborted)
        engine.gate.set()
        return await drain(first), await drain(third)

    try:
        first_events, third_events = asyncio.run(scenario())
    finally:
        engine.gate.set()
        scheduler.shutdown()
    assert engine.served == [1, 3]
    assert "".join(e.text for e in first_events if isinstance(e, TextDelta)) == "bbb"
    assert isinstance(first_events[-1], Finished) and first_events[-1].finish_reason == "length"
    assert isinstance(third_events[-1], Finished) and third_events[-1].completion_tokens == 3
    assert sorted(r.finished_reason for r in records) == ["abort", "length", "length"]


def test_cancelling_a_running_request_stops_the_engine_and_serves_the_next():
    engine, records = GatedEngine(steps=10**9), []  # never finishes on its own
    scheduler = Scheduler(engine, decode, records.append, max_waiting=4)

    async def scenario():
        engine.gate.set()
        running = scheduler.submit(request(1))
        first = await running.next_event()
        assert isinstance(first, TextDelta)
        nxt = scheduler.submit(request(2, stops=("cc",)))  # 'c' * n: the stop string completes at token 2
        running.cancel()
        return await drain(nxt)

    try:
        events = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert engine.served == [1, 2] and engine.closed == [1, 2]  # both generations were closed early
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 2 and not [e for e in events if isinstance(e, TextDelta)]
    assert [r.finished_reason for r in records] == ["abort", "stop"]


def test_engine_failure_is_reported_and_the_worker_survives():
    scheduler = Scheduler(FailingEngine(), decode, lambda record: None, max_waiting=4)

    async def scenario():
        return [await drain(scheduler.submit(request(n))) for n in (1, 2)]

    try:
        results = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    for events in results:
        assert isinstance(events[-1], Failed) and "boom" in str(events[-1].error)
