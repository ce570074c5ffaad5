"""When a benchmark figure is doubtful (issue 21, item 7): the rules on synthetic numbers, and bench / bench
--workload agent / costs on stories260K with an injected slow baseline or noisy timings. No test here asserts
on real timing: the injected figures decide every flag that is asserted."""

from __future__ import annotations

import dataclasses
import json

import pytest

from draftwise.speculation import measurement as M
from draftwise.benchmark import MethodSpec, PromptRun, summarize
from draftwise.cli import main


def figures(wall=10.0, cpu=19.0, threads=2, cores=4, load=(1.0, 2.0)) -> M.Measurement:
    return M.Measurement(wall, cpu, threads, cores, *load)


# ---------------------------------------------------------------------- the rules, synthetic numbers
def test_a_starved_run_is_flagged_and_a_clean_run_is_not():
    starved = figures(cpu=4.5)  # 2 threads for 10 s could use 20 CPU seconds; the process got 4.5
    doubt = M.machine_busy(starved, "plain")
    assert doubt.code == "C" and doubt.reason == "machine busy" and "22.5%" in doubt.detail
    assert doubt.detail.startswith("plain: ")
    assert M.machine_busy(figures()) is None  # 95% of its threads, load below the free cores
    assert M.machine_busy(figures(cpu=25.0)) is None  # more CPU than wall x threads (helper threads) is fine


def test_a_loaded_machine_is_flagged_even_when_the_process_got_its_cpu():
    # 2 of 4 cores ours; load 6.0 means about 4 runnable threads of other work for the 2 cores left
    doubt = M.machine_busy(figures(load=(6.0, 5.0)))
    assert doubt.code == "C" and "load average 6.00 on 4 cores" in doubt.detail
    assert M.machine_busy(figures(load=(4.4, 4.0))) is None  # 2.4 others for 2 free cores: within the tolerance


def test_work_done_elsewhere_is_not_judged():
    assert M.machine_busy(figures(cpu=0.01, threads=None)) is None  # a server did the work
    assert M.machine_busy(None) is None


def test_baseline_moved_only_beyond_the_spread_threshold():
    assert M.baseline_moved([1.0, 1.05]) is None
    doubt = M.baseline_moved([4.42, 1.47], "plain")  # the demo's 2.26 tok/s, then 6.79 tok/s
    assert doubt.code == "B" and "2 plain passes" in doubt.detail and "100.2% apart" in doubt.detail
    assert M.baseline_moved([3.0]) is None  # one pass: nothing to compare
    assert M.relative_spread([1.0, 1.1]) == pytest.approx(0.1 / 1.05)


def test_far_from_prediction_uses_the_ratio_range():
    doubt = M.far_from_prediction(3.26, 1.36)  # the demo run
    assert doubt.code == "P" and "3.26x" in doubt.detail and "1.36x" in doubt.detail
    assert M.far_from_prediction(1.16, 1.20) is None  # its rerun on the idle machine
    assert M.far_from_prediction(0.5, 1.0).code == "P"
    assert M.far_from_prediction(1.3, None) is None


def test_noisy_timings_and_combination():
    assert M.noisy_timings([0.100, 0.104, 0.101], "1-token pass") is None
    assert M.noisy_timings([0.100, 0.160, 0.101], "1-token pass").code == "N"
    both = M.combine([figures(wall=10, cpu=20, threads=2), figures(wall=30, cpu=30, threads=4, load=(0.5, 3.0))])
    assert both.wall_s == 40 and both.cpu_s == 50 and both.threads == pytest.approx(3.5)
    assert both.cpu_share == pytest.approx(50 / (10 * 2 + 30 * 4))
    assert (both.load_before, both.load_after) == (0.5, 3.0)
    assert M.combine([None]) is None
    assert M.Measurement.from_dict(both.to_dict()) == both and M.Measurement.from_dict({}) is None


def test_measure_records_the_process_and_the_machine():
    with M.measure(3) as recorder:
        sum(range(1000))
    result = recorder.result
    assert result.threads == 3 and result.wall_s >= 0 and result.cpu_s >= 0 and result.cpu_count >= 1
    assert set(result.to_dict()) == {"wall_s", "cpu_s", "threads", "cpu_count", "load_before", "load_after",
                                     "cpu_share"}


def test_baseline_repeat_and_rendering():
    methods = M.with_baseline_repeat([MethodSpec("plain", runner=len), MethodSpec("draft K=4", "draft", 4)])
    assert [(m.label, m.repeat_of) for m in methods] == [("plain", None), ("draft K=4", None),
                                                          ("plain (repeat)", "plain")]
    assert methods[2].runner is methods[0].runner  # the same method, run again
    doubts = [M.baseline_moved([1.0, 2.0]), M.far_from_prediction(3.0, 1.0)]
    assert M.marker(doubts) == "!BP" and M.marker([]) == ""
    assert M.legend(doubts) == "! = doubtful figure: B baseline moved, P far from prediction"
    line = M.warning_line([("plain", doubts[0]), ("draft K=4", doubts[0]), ("draft K=4", doubts[1].to_dict())])
    assert line.startswith("WARNING: 2 doubtful figure(s) (plain, draft K=4") and "idle machine" in line
    assert "baseline moved (plain: " in line and "1 more" in line and "far from prediction (draft K=4: " in line
    assert M.warning_line([]) is None


# ---------------------------------------------------------------------- the summary, synthetic runs
def prompt_run(method: str, seconds: float, measured: M.Measurement, *, kind="plain", repeat_of=None, k=None,
               stats: dict | None = None) -> PromptRun:
    return PromptRun(prompt_id="1", category="coding", turn=0, method=method, kind=kind, k=k, policy="fixed",
                     num_prompt_tokens=10, num_tokens=64, time_s=seconds, tokens_per_s=64 / seconds,
                     identical_to_plain=True, first_difference=None, speedup=None, peak_rss_bytes=0,
                     peak_gpu_bytes=None, stats={"total_time_s": seconds, **(stats or {})},
                     measurement=measured.to_dict(), repeat_of=repeat_of)


DRAFT_STATS = {"num_draft_tokens": 100, "num_accepted_tokens": 60, "num_target_passes": 25,
               "drafted_per_position": [25] * 4, "accepted_per_position": [20, 16, 13, 11]}


def summary_of(plain_s: float, plain_busy: bool, repeat_s: float, draft_s: float) -> dict[str, dict]:
    from draftwise.speculation.calibration import ForwardCosts

    costs = ForwardCosts({k: 0.119 * (1 + 0.05 * (k - 1)) for k in range(1, 6)}, context_len=200)
    runs = [prompt_run("plain", plain_s, figures(cpu=5.0 if plain_busy else 19.0)),
            prompt_run("draft K=4", draft_s, figures(), kind="draft", k=4, stats=DRAFT_STATS),
            prompt_run("plain (repeat)", repeat_s, figures(), repeat_of="plain")]
    return {row["method"]: row for row in summarize(runs, costs, 0.04)}


def test_the_demo_run_is_flagged_in_every_row_it_spoils():
    """The issue's run: plain 2.26 tok/s while another job ran, draft 7.38, plain again 6.79 (idle)."""
    rows = summary_of(64 / 2.26, True, 64 / 6.79, 64 / 7.38)
    assert rows["draft K=4"]["speedup_total"] == pytest.approx(7.38 / (64 / ((64 / 2.26 + 64 / 6.79) / 2)))
    codes = {method: M.marker(row["warnings"]) for method, row in rows.items()}
    assert codes["plain"] == "!BC" and codes["plain (repeat)"] == "!B"
    assert codes["draft K=4"] == "!BCP"  # moved baseline, starved plain pass, speed-up far from the prediction
    assert rows["draft K=4"]["baseline_pass_s"] == pytest.approx([64 / 2.26, 64 / 6.79])
    assert rows["draft K=4"]["measurement"]["cpu_share"] == pytest.approx(0.95)


def test_a_clean_run_carries_no_warning():
    rows = summary_of(64 / 6.79, False, 64 / 6.70, 64 / 7.91)
    assert all(row["warnings"] == [] for row in rows.values())
    assert rows["draft K=4"]["predicted_speedup"] == pytest.approx(rows["draft K=4"]["decode_speedup_total"], rel=0.5)


def test_agent_summary_flags_a_moved_baseline():
    from draftwise.agent_bench import AgentTurn, agent_doubts, summarize_agent

    def turn(method, wall, repeat_of=None):
        return AgentTurn(session_id="s", category="agent", turn=0, method=method, kind="plain", k=None,
                         prompt_tokens=10, cached_tokens=0, output_tokens=8, ttft_s=0.1, decode_tokens_per_s=None,
                         wall_s=wall, finish_reason="length", identical_to_plain=True, first_difference=None,
                         text="x", measurement=figures(wall=wall, cpu=wall * 1.9).to_dict(), repeat_of=repeat_of)

    summary = summarize_agent([turn("plain", 1.0), turn("ngram K=4", 0.8), turn("plain (repeat)", 2.0, "plain")])
    rows = {row["method"]: row for row in summary}
    assert rows["ngram K=4"]["speedup"] == pytest.approx(1.5 / 0.8) and rows["plain"]["baseline_pass_s"] == [1.0, 2.0]
    assert all(M.marker(row["warnings"]) == "!B" for row in summary)
    assert [what for what, _ in agent_doubts(summary)] == ["plain", "ngram K=4", "plain (repeat)"]
    steady = summarize_agent([turn("plain", 1.0), turn("ngram K=4", 0.8), turn("plain (repeat)", 1.02, "plain")])
    assert all(row["warnings"] == [] for row in steady)


# ---------------------------------------------------------------------- end to end, stories260K
PROMPTS = ('{"question_id": 1, "category": "a", "turns": ["Once upon a time"]}\n'
           '{"question_id": 2, "category": "a", "turns": ["Tom had a red ball."]}\n')


def slow_every_second_call(runner, factor: float = 10.0):
    """Wrap a method's runner so that every second call (the baseline's repeat on each prompt) reports
    ``factor`` times the time it took."""
    calls = []

    def run(ids, params):
        result = runner(ids, params)
        calls.append(1)
        if len(calls) % 2 == 0:
            result.stats.total_time_s *= factor
        return result

    return run


def test_bench_marks_a_moved_baseline_in_table_json_and_last_line(stories_path, tmp_path, capsys, monkeypatch):
    from draftwise.commands import bench

    real_build = bench.build_methods

    def build_with_slow_repeat(*args, **kwargs):
        specs = real_build(*args, **kwargs)
        plain = specs[0]
        return [dataclasses.replace(plain, runner=slow_every_second_call(plain.run)), *specs[1:]]

    monkeypatch.setattr(bench, "build_methods", build_with_slow_repeat)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(PROMPTS)
    out = tmp_path / "b.json"
    code = main(["bench", "--model", str(stories_path), "--prompts", str(prompts), "--methods", "plain,ngram",
                 "--ks", "2", "--max-tokens", "6", "--chat", "off", "--no-calibrate", "--no-plots", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    rows = {line.split(" | ")[2]: line for line in printed.splitlines() if " | all | " in line}
    assert set(rows) == {"plain", "ngram K=2", "plain (repeat)"}
    assert all(line.startswith("| !") and "B" in line.split(" | ")[0] for line in rows.values())
    assert "! = doubtful figure: " in printed and "B baseline moved" in printed
    assert "baseline: plain " in printed and "% apart; speed-ups are over their mean" in printed
    last = [line for line in printed.splitlines() if line.strip()][-1]
    assert last.startswith("WARNING: ") and "baseline moved (plain: the 2 plain passes took" in last
    assert "idle machine" in last
    data = json.loads(out.read_text())
    assert {(w["row"], w["code"]) for w in data["warnings"]} >= {("plain", "B"), ("ngram K=2", "B"),
                                                                ("plain (repeat)", "B")}
    summary = {row["method"]: row for row in data["summary"]}
    assert len(summary["plain"]["baseline_pass_s"]) == 2 and summary["plain"]["baseline_spread"] > 0.1
    assert any(w["code"] == "B" for w in summary["ngram K=2"]["warnings"])
    assert set(data["measurement"]) >= {"wall_s", "cpu_s", "cpu_share", "load_before", "load_after"}
    assert "## Measurement" in out.with_suffix(".md").read_text()


def test_agent_bench_marks_a_moved_baseline(stories_path, tmp_path, capsys, monkeypatch):
    from draftwise.agent_bench import EngineTurnRunner

    sessions = tmp_path / "s.jsonl"
    sessions.write_text('{"id": "s1", "turns": ["Write a story.", "Make it shorter."]}\n')
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    opened: list[EngineTurnRunner] = []
    real_run_turn = EngineTurnRunner.run_turn

    def run_turn(self, messages):
        if self not in opened:
            opened.append(self)
        outcome = real_run_turn(self, messages)
        if opened.index(self) == 2:  # plain, ngram, then plain again: that pass reports 10x its time
            outcome = dataclasses.replace(outcome, wall_s=outcome.wall_s * 10)
        return outcome

    monkeypatch.setattr(EngineTurnRunner, "run_turn", run_turn)
    out = tmp_path / "agent.json"
    code = main(["bench", "--workload", "agent", "--model", str(stories_path), "--methods", "plain,ngram", "--ks", "3",
                 "--sessions", str(sessions), "--chat-template", str(template), "--max-tokens", "6", "--device", "cpu",
                 "--no-plots", "--output", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| !") and " | 1 | 2 | " in line]
    assert [row.split(" | ")[1] for row in rows] == ["plain", "ngram K=3", "plain (repeat)"]
    assert all("B" in row.split(" | ")[0] for row in rows)
    last = [line for line in printed.splitlines() if line.strip()][-1]
    assert last.startswith("WARNING: ") and "baseline moved" in last
    data = json.loads(out.read_text())
    assert {(w["row"], w["code"]) for w in data["warnings"]} >= {("plain", "B"), ("ngram K=3", "B")}
    assert "## Measurement" in out.with_suffix(".md").read_text()


def test_costs_marks_noisy_timings(stories_path, capsys, monkeypatch):
    from draftwise.commands import costs

    def samples(backend, ks, *, context_len, repeats):
        return {k: [0.010 * k, 0.011 * k, 0.030 * k] if k == 2 else [0.010 * k] * 3 for k in sorted(set(ks) | {1})}

    monkeypatch.setattr(costs, "forward_pass_samples", samples)
    assert main(["costs", str(stories_path), "--ks", "2,3", "--context", "8", "--bandwidth-mib", "16", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert [(w["row"], w["code"]) for w in result["warnings"] if w["code"] == "N"] == [("k=2", "N")]
    assert result["spread"]["2"] == pytest.approx(0.020 / 0.011) and result["spread"]["1"] == 0.0
    assert "cpu_share" in result["measurement"]
    assert [line for line in captured.err.splitlines() if line.strip()][-1].startswith("WARNING: ")
    assert main(["costs", str(stories_path), "--ks", "2,3", "--context", "8", "--bandwidth-mib", "16"]) == 0
    table = capsys.readouterr().out
    row_two = next(line for line in table.splitlines() if "│ 2 │" in line or "| 2 |" in line)
    assert "!" in row_two and "N" in row_two
    assert "N noisy timings" in table and table.strip().splitlines()[-1].startswith("WARNING: ")
