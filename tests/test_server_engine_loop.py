"""The server's engine loop (draftwise.server.engine_loop) with a controllable fake engine: FIFO order, queue limit,
cancellation of waiting and running requests, stop strings stopping the engine, engine failures reported."""

from __future__ import annotations

import asyncio
import time

import pytest

from draftwise.config import SamplingParams
from draftwise.engine import SpeculativeEngine
from draftwise.machine import torch_threads
from draftwise.server.engine_loop import EngineLoop
from draftwise.server.events import Aborted, Failed, Finished, QueueFullError, TextDelta
from draftwise.server.validation import GenerationRequest
from fakes import ScriptedLM


def gated_engine() -> SpeculativeEngine:
    """The real engine over a model that repeats the prompt's first token, each pass waiting for its gate."""
    return SpeculativeEngine(ScriptedLM(lambda prompt: (prompt[0], True, False), vocab_size=32))


def failing_engine() -> SpeculativeEngine:
    return SpeculativeEngine(ScriptedLM(lambda prompt: (0, False, True), vocab_size=32))


def scheduler_for(engine: SpeculativeEngine, records, max_waiting: int) -> EngineLoop:
    return EngineLoop(engine.core, decode, records.append, max_waiting=max_waiting)


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def request(n: int, stops: tuple[str, ...] = (), max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(f"r{n}", (n,), SamplingParams(max_tokens=max_tokens), stops)


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
    engine, records = gated_engine(), []
    scheduler = scheduler_for(engine, records, max_waiting=2)

    async def scenario():
        first = scheduler.submit(request(1))
        await until(lambda: engine.target.served == [[1]])  # the engine is in its first step
        second, third = scheduler.submit(request(2)), scheduler.submit(request(3))
        with pytest.raises(QueueFullError):
            scheduler.submit(request(4))
        second.cancel()  # waiting: skipped, never reaches the engine
        assert isinstance(await second.next_event(), Aborted)
        engine.target.gate.set()
        return await drain(first), await drain(third)

    try:
        first_events, third_events = asyncio.run(scenario())
    finally:
        engine.target.gate.set()
        scheduler.shutdown()
    assert engine.target.served == [[1], [3]]
    assert "".join(e.text for e in first_events if isinstance(e, TextDelta)) == "bbb"
    assert isinstance(first_events[-1], Finished) and first_events[-1].finish_reason == "length"
    assert isinstance(third_events[-1], Finished) and third_events[-1].completion_tokens == 3
    assert sorted(r.finished_reason for r in records) == ["abort", "length", "length"]


def test_cancelling_a_running_request_stops_the_engine_and_serves_the_next():
    engine, records = gated_engine(), []
    scheduler = scheduler_for(engine, records, max_waiting=4)

    async def scenario():
        engine.target.gate.set()
        running = scheduler.submit(request(1, max_tokens=4000))  # does not finish on its own in this test
        first = await running.next_event()
        assert isinstance(first, TextDelta)
        nxt = scheduler.submit(request(2, stops=("cc",), max_tokens=4000))  # the stop completes at token 2
        running.cancel()
        return await drain(nxt)

    try:
        events = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert engine.target.served == [[1], [2]]  # both generations were stopped early, and the second ran
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 2 and not [e for e in events if isinstance(e, TextDelta)]
    assert [r.finished_reason for r in records] == ["abort", "stop"]


def test_engine_failure_is_reported_and_the_worker_survives():
    scheduler = scheduler_for(failing_engine(), [], max_waiting=4)

    async def scenario():
        return [await drain(scheduler.submit(request(n))) for n in (1, 2)]

    try:
        results = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    for events in results:
        assert isinstance(events[-1], Failed) and "the engine broke" in str(events[-1].error)


def test_the_engine_thread_starts_after_the_loading_thread_releases_its_openmp_workers(monkeypatch):
    """Start releases the caller's OpenMP pool first (kept beside the engine thread's, it made libgomp stop
    spinning: every parallel region of the engine then woke its workers through the kernel)."""
    import draftwise.server.engine_loop as scheduler_module

    calls = []
    monkeypatch.setattr(scheduler_module, "release_openmp_threads", lambda: calls.append("released") or True)
    scheduler = scheduler_for(gated_engine(), [], max_waiting=4)
    scheduler.start()
    scheduler.start()  # idempotent: one engine thread, one release
    scheduler.shutdown()
    assert calls == ["released"]


def test_releasing_openmp_workers_keeps_torch_working_on_every_thread():
    """Where PyTorch runs on libgomp (Linux wheels) the release succeeds; computing afterwards, on this thread
    or another, gives the same results (the runtime starts a new pool when needed)."""
    import sys
    import threading

    import torch

    from draftwise.machine import release_openmp_threads

    x = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    with torch_threads(2):
        before = torch.nn.functional.silu(x)
        released = release_openmp_threads()
        results = {}
        worker = threading.Thread(target=lambda: results.setdefault("thread", torch.nn.functional.silu(x)))
        worker.start()
        worker.join()
        after = torch.nn.functional.silu(x)
    assert torch.equal(after, before) and torch.equal(results["thread"], before)
    if sys.platform.startswith("linux") and torch.__config__.parallel_info().find("OpenMP") >= 0:
        assert released


def test_request_log_line_names_the_hybrid_sides():
    """The batched server's per-request INFO line: acceptance and tau when anything was drafted, the hybrid's
    steps by side when it ran (also when every step was plain), nothing for plain decoding."""
    from draftwise.server.engine_loop import _speculation
    from draftwise.stats import SpeculativeStats

    assert _speculation(None) == "" and _speculation(SpeculativeStats()) == ""
    drafted = SpeculativeStats()
    drafted.record_step(4, 3, 4)
    assert _speculation(drafted) == ", acceptance 0.75, tau 4.00"
    drafted.record_hybrid_step("suffix", 4)
    assert _speculation(drafted).endswith(", hybrid steps: suffix 1, draft model 0, plain 0")
    plain_only = SpeculativeStats()
    plain_only.record_step(0, 0, 1)
    plain_only.record_hybrid_step("suffix", 0)
    assert _speculation(plain_only) == ", hybrid steps: suffix 0, draft model 0, plain 1"


def test_a_request_is_recorded_before_its_client_gets_the_end():
    """Metrics first, then the response: a client that reads ``/metrics`` as soon as its response ends finds its
    request counted. The record callback here is slow (0.2 s), so recording after handing the end over shows."""
    engine, records = gated_engine(), []
    engine.target.gate.set()

    def slow_record(record) -> None:
        time.sleep(0.2)
        records.append(record)

    scheduler = EngineLoop(engine.core, decode, slow_record, max_waiting=2)

    async def scenario():
        events = await drain(scheduler.submit(request(1)))
        return events, len(records)

    try:
        events, recorded = asyncio.run(scenario())
    finally:
        scheduler.shutdown()
    assert isinstance(events[-1], Finished)
    assert recorded == 1
