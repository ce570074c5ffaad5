"""The default prefix-cache budget: a quarter of the memory available at start, capped at 4 GiB, the cap when
the available memory cannot be read; ``bench --workload agent`` resolves it once for all its methods."""

from __future__ import annotations

import os

import pytest

import draftwise.builder as builder
from draftwise.builder import DEFAULT_KV_CACHE_MEMORY, default_kv_cache_memory, kv_cache_budget
from draftwise.check.memory import available_ram
from draftwise.cli import build_parser

GIB = 2**30


@pytest.mark.parametrize("available, expected", [(2 * GIB, GIB // 2), (10 * GIB, 10 * GIB // 4),
                                                 (16 * GIB, 4 * GIB), (256 * GIB, 4 * GIB), (0, 0)])
def test_a_quarter_of_the_available_memory_capped_at_4_gib(available, expected):
    assert default_kv_cache_memory(available) == expected
    assert kv_cache_budget(None, available).nbytes == expected


def test_a_budget_above_the_available_memory_is_used_with_a_warning(caplog):
    caplog.set_level("WARNING", logger="draftwise.builder")
    assert kv_cache_budget(64 * GIB, available_bytes=8 * GIB).nbytes == 64 * GIB
    assert "more than the 8.00 GiB of memory available now" in caplog.text
    caplog.clear()
    assert kv_cache_budget(GIB, available_bytes=8 * GIB).nbytes == GIB and not caplog.text


def test_the_log_line_says_which_bound_applied():
    def line(available):
        return kv_cache_budget(None, available).describe()

    assert line(10 * GIB) == "prefix cache: 2.50 GiB (1/4 of 10.0 GiB available; cap 4.00 GiB)"
    assert line(16 * GIB) == "prefix cache: 4.00 GiB (1/4 of 16.0 GiB available; cap 4.00 GiB)"
    assert line(24 * GIB) == "prefix cache: 4.00 GiB (the cap; 1/4 of 24.0 GiB available is more)"


def test_unknown_available_memory_gives_the_cap(monkeypatch):
    monkeypatch.setattr(builder, "available_ram", lambda: None)
    assert default_kv_cache_memory() == DEFAULT_KV_CACHE_MEMORY == 4 * GIB
    assert kv_cache_budget(None).describe() == "prefix cache: 4.00 GiB (available memory unknown; cap 4.00 GiB)"


def test_a_value_given_is_used_as_is():
    assert kv_cache_budget(64 * GIB, available_bytes=GIB).nbytes == 64 * GIB
    assert kv_cache_budget(0, available_bytes=GIB).nbytes == 0


def _no_sysconf(name):
    raise ValueError(name)


def test_available_memory_reads_meminfo_and_never_raises(tmp_path, monkeypatch):
    meminfo, no_group = tmp_path / "meminfo", tmp_path / "no-cgroup"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   10485760 kB\n")
    assert available_ram(meminfo, no_group) == 10 * GIB
    monkeypatch.setattr(os, "sysconf", _no_sysconf)  # no free-pages fallback either
    assert available_ram(tmp_path / "missing", no_group) is None
    meminfo.write_text("MemAvailable:   lots kB\n")
    assert available_ram(meminfo, no_group) is None
    meminfo.write_text("MemTotal:       24000000 kB\n")  # a kernel before 3.14
    assert available_ram(meminfo, no_group) is None


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_container_memory_limit_bounds_the_available_memory(tmp_path, version):
    """In a memory-limited container MemAvailable is the host's: the group's limit less its usage counts too."""
    meminfo, group = tmp_path / "meminfo", tmp_path / "cgroup"
    meminfo.write_text("MemAvailable:   10485760 kB\n")  # 10 GiB on the host
    limit, usage = (group / "memory.max", group / "memory.current") if version == "v2" else \
        (group / "memory" / "memory.limit_in_bytes", group / "memory" / "memory.usage_in_bytes")
    limit.parent.mkdir(parents=True)
    limit.write_text(f"{4 * GIB}\n")
    usage.write_text(f"{GIB}\n")
    assert available_ram(meminfo, group) == 3 * GIB
    limit.write_text("max\n" if version == "v2" else "9223372036854771712\n")  # no limit: the host's figure
    assert available_ram(meminfo, group) == 10 * GIB
    limit.write_text(f"{64 * GIB}\n")  # a limit above the host's free memory
    assert available_ram(meminfo, group) == 10 * GIB
    usage.write_text("garbled\n")
    assert available_ram(meminfo, group) == 10 * GIB


def test_bench_resolves_the_budget_once_for_every_method(monkeypatch):
    """Unset: every in-process method's engine gets the same share (read once, before any model loads), the run's
    config records it, and plain-nocache gets none; a value given is used as is. No model is loaded."""
    from draftwise.commands.bench import _agent_methods
    from draftwise.commands.common import sampling_params_from_args

    reads = []
    monkeypatch.setattr(builder, "available_ram", lambda: reads.append(1) or 8 * GIB)
    budgets = {}

    class Loaded(Exception):
        pass

    def fake_build_engine(target, spec_config, **kwargs):
        budgets[spec_config.method if spec_config else "plain"] = kwargs["kv_cache_memory"]
        raise Loaded

    monkeypatch.setattr(builder, "build_engine", fake_build_engine)

    def opened(*flags):
        args = build_parser().parse_args(["bench", "--workload", "agent", "--model", "t.gguf", "--methods",
                                          "plain,plain-nocache,ngram", "--ks", "2", "--chat-template", "{{ 1 }}",
                                          *flags])
        methods, config = _agent_methods(args, sampling_params_from_args(args))
        found = []
        for method in methods:
            budgets.clear()
            with pytest.raises(Loaded), method.open():
                pass
            found.append(next(iter(budgets.values())))
        return found, config["kv_cache_memory"]

    assert build_parser().parse_args(["bench"]).kv_cache_memory is None
    assert opened() == ([2 * GIB, 0, 2 * GIB], 2 * GIB)
    assert len(reads) == 1
    assert opened("--kv-cache-memory", "1GiB") == ([GIB, 0, GIB], GIB)
    assert len(reads) == 2  # once per run: a value given is checked against the available memory
