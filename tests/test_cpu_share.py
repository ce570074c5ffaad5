"""Sharing the CPUs (draftwise.cpu_share): the contention estimate from /proc readings, the governor's thread
count (hysteresis of two readings, clamped to 1..cpus), the lean target's thread-count check, and the engine
applying the governor between steps without changing the output."""

from __future__ import annotations

import pytest
import torch

from draftwise.cpu_share import CpuContention, CpuTimes, ThreadGovernor, read_cpu_times


class ScriptedTimes:
    """A scripted machine: each look at :meth:`clock` advances the wall time by ``step_s``; a reading carries the
    CPU time accumulated since the last one, with ``others`` CPUs busy elsewhere and ``own`` CPUs used by this
    process."""

    def __init__(self, step_s: float = 1.0) -> None:
        self.step_s = step_s
        self.wall = 0.0
        self.now = CpuTimes(1000.0, 10.0, 0.0)
        self.others = 0.0
        self.own = 1.0
        self.reads = 0

    def clock(self) -> float:
        self.wall += self.step_s
        return self.wall

    def __call__(self) -> CpuTimes:
        self.reads += 1
        elapsed = self.wall - self.now.wall_s
        self.now = CpuTimes(self.now.busy_s + (self.others + self.own) * elapsed, self.now.own_s + self.own * elapsed,
                            self.wall)
        return self.now


def test_proc_readings_are_parsed_on_linux(tmp_path):
    stat = tmp_path / "stat"
    own = tmp_path / "self_stat"
    stat.write_text("cpu  100 0 50 1000 5 0 10 20 0 0\ncpu0 1 2 3\n")
    own.write_text("123 (a (weird) name) R " + " ".join(["0"] * 10) + " 30 20 0 0\n")
    times = read_cpu_times(stat, own)
    ticks = 100.0
    assert times.busy_s == pytest.approx((100 + 50 + 10 + 20) / ticks, rel=0.5)  # tick length from sysconf
    assert times.own_s * 180 == pytest.approx(times.busy_s * 50)  # utime 30 + stime 20 of the same ticks
    assert read_cpu_times(tmp_path / "missing", own) is None
    assert read_cpu_times() is None or read_cpu_times().busy_s > 0


def test_contention_is_the_cpu_time_of_other_processes_per_second():
    times = ScriptedTimes()
    contention = CpuContention(interval_s=0.5, read=times, clock=times.clock)
    assert contention.sample() is not None and contention.busy_elsewhere == pytest.approx(0.0)
    times.others = 1.0
    assert contention.sample() == pytest.approx(1.0)
    times.own, times.others = 2.0, 0.25
    assert contention.sample() == pytest.approx(0.25)
    assert contention.readings == 3
    with pytest.raises(ValueError):
        CpuContention(interval_s=0)


def test_contention_waits_for_the_interval():
    times = ScriptedTimes(step_s=0.1)
    contention = CpuContention(interval_s=0.5, read=times, clock=times.clock)
    times.others = 1.0
    assert contention.sample() is None  # 0.1 s since the first reading
    for _ in range(3):
        contention.sample()
    assert times.reads == 1  # within the interval no /proc file is read: only the first reading happened
    assert contention.sample() == pytest.approx(1.0)


def test_the_governor_follows_the_free_cpus_after_two_readings_that_agree():
    times = ScriptedTimes()
    applied: list[int] = []
    governor = ThreadGovernor(2, [applied.append], CpuContention(interval_s=0.5, read=times, clock=times.clock))
    assert governor.update() == 2 and applied == []
    times.others = 1.0
    assert governor.update() == 2  # one reading is not enough
    assert governor.update() == 1 and applied == [1]
    times.others = 1.6  # more than the CPUs left: still one thread
    assert governor.update() == 1 and governor.update() == 1 and applied == [1]
    times.others = 0.1
    governor.update()
    times.others = 1.0  # a burst: the pending change is dropped
    governor.update()
    assert governor.threads == 1
    times.others = 0.0
    governor.update()
    assert governor.update() == 2 and applied == [1, 2] and governor.changes == 2


def test_the_governor_refuses_nonsense():
    with pytest.raises(ValueError):
        ThreadGovernor(0, [print])
    with pytest.raises(ValueError):
        ThreadGovernor(2, [])


def test_the_lean_target_is_checked_for_thread_count_invariance(draftwise_home, stories_path, monkeypatch):
    from draftwise.models.loading import load_model

    model = load_model(str(stories_path), device="cpu", runtime="lean", quantization="int8").backend.model
    assert model.check_thread_invariance(1, context=20, rows=4)  # int32 accumulation: no thread-dependent sums
    assert model.cache.lengths[0] == 0  # the slot is left empty
    forward_rows = model.forward_rows

    def thread_dependent(*args, **kwargs):
        logits, hidden = forward_rows(*args, **kwargs)
        return logits + (torch.get_num_threads() == 1) * 1e-6, hidden

    monkeypatch.setattr(model, "forward_rows", thread_dependent)
    if torch.get_num_threads() > 1:
        assert not model.check_thread_invariance(1, context=20, rows=4)


def test_the_engine_applies_the_governor_between_steps_and_the_output_stays(stories):
    from draftwise.config import SamplingParams
    from draftwise.engine import one_slot_core

    prompt = stories.tokenizer.encode("Once upon a time")
    params = SamplingParams(max_tokens=24)
    plain = one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids).generate([prompt], params)[0]
    times = ScriptedTimes()
    applied: list[int] = []
    core = one_slot_core(stories.backend, eos_token_ids=stories.eos_token_ids)
    core.threads = ThreadGovernor(2, [applied.append], CpuContention(interval_s=0.5, read=times, clock=times.clock))
    times.others = 1.0
    result = core.generate([prompt], params)[0]
    assert applied == [1]  # the second reading, at the second step
    assert result.token_ids == plain.token_ids
    assert torch.get_num_threads() >= 1
