"""scripts/bench/draft_goals.py: the issue-23 goal table from benchmark reports (synthetic reports, no models)."""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "draft_goals.py"


@pytest.fixture(scope="module")
def goals():
    spec = importlib.util.spec_from_file_location("draft_goals", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["draft_goals"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["draft_goals"]


def _row(method, kind, policy="fixed", speedup=1.0, tokens_per_s=10.0, category="all", identical=5, runs=5,
         spread=0.01):
    return {"method": method, "kind": kind, "policy": policy, "category": category, "speedup_total": speedup,
            "tokens_per_s": tokens_per_s, "identical": identical, "runs": runs, "baseline_spread": spread}


def _costs(c, context):
    target = 0.060
    return {"context_len": context, "seconds": {"1": target, "5": 0.07}, "draft_1_token_s": c * target,
            "cost_ratio_c": c}


def _coding(draft_auto=2.1, draft_fixed=2.0, hf_tps=14.0, identical=5):
    return {"complete": True, "summary": [
        _row("plain", "plain", speedup=1.0, tokens_per_s=15.0),
        _row("draft K=4", "draft", speedup=draft_fixed, tokens_per_s=15.0 * draft_fixed),
        _row("draft auto(K<=8)", "draft", "auto", draft_auto, 15.0 * draft_auto, identical=identical),
        _row("hf-assisted K=4", "hf-assisted", tokens_per_s=hf_tps, identical=0),
        _row("hf-lookup K=4", "hf-lookup", tokens_per_s=30.0, identical=0)]}


def _categories(per_category, overall=1.4, fixed=1.35):
    rows = [_row("plain", "plain", category="all"), _row("draft K=8", "draft", speedup=fixed),
            _row("draft auto(K<=8)", "draft", "auto", overall)]
    for category, speedup in per_category.items():
        rows.append(_row("draft auto(K<=8)", "draft", "auto", speedup, category=category))
        rows.append(_row("plain", "plain", category=category))
    return {"complete": True, "summary": rows}


def _thirteen(**speedups):
    """Auto's speed-up in each of 13 categories (1.5x unless given)."""
    names = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "translation",
             "summarization", "qa", "math_reasoning", "rag"]
    return {name: speedups.get(name, 1.5) for name in names}


def _agent(nocache=180.0, draft=70.0, suffix=76.0, hybrid=61.0, spread=0.01):
    def row(method, kind, wall):
        return {"method": method, "kind": kind, "wall_s": wall, "identical": 8, "turns": 8,
                "baseline_spread": spread}
    return {"complete": True, "summary": [row("plain", "plain", 140.0), row("plain no-reuse", "plain-nocache", nocache),
                                          row("draft auto(K<=8)", "draft", draft),
                                          row("suffix auto(K<=8)", "suffix", suffix),
                                          row("hybrid auto(K<=8)", "hybrid", hybrid)]}


def _reports(**overrides):
    reports = {"costs-200.json": _costs(0.15, 200), "costs-1000.json": _costs(0.19, 1000), "coding.json": _coding(),
               "categories.json": _categories(_thirteen(rag=1.01)), "agent.json": _agent()}
    reports.update(overrides)
    return reports


def _verdicts(goals, reports):
    found, flags = goals.evaluate(reports)
    return {goal.name: goal.met for goal in found}, flags


def test_every_goal_met(goals):
    verdicts, flags = _verdicts(goals, _reports())
    assert len(verdicts) == 10
    assert all(verdicts.values()), verdicts
    assert flags == []


def test_each_goal_can_fail(goals):
    cases = {
        "c at context 200": {"costs-200.json": _costs(0.26, 200)},
        "c at context 1,000": {"costs-1000.json": _costs(0.31, 1000)},
        "draft on coding prompts": {"coding.json": _coding(draft_auto=1.9, draft_fixed=1.95)},
        "draft vs transformers' assisted generation": {"coding.json": _coding(hf_tps=25.0)},
        "auto vs best fixed K, coding": {"coding.json": _coding(draft_auto=2.0, draft_fixed=2.1)},
        "auto, every category": {"categories.json": _categories(_thirteen(rag=0.98))},
        "auto, all 13 categories": {"categories.json": _categories(_thirteen(), overall=1.29, fixed=1.2)},
        "auto vs best fixed K, 13 categories": {"categories.json": _categories(_thirteen(), overall=1.4, fixed=1.5)},
        "agent: draft vs plain without reuse": {"agent.json": _agent(draft=73.0)},
        "agent: hybrid vs suffix": {"agent.json": _agent(hybrid=77.0)},
    }
    for name, override in cases.items():
        verdicts, _ = _verdicts(goals, _reports(**override))
        failed = {goal for goal, met in verdicts.items() if met is False}
        assert name in failed, (name, verdicts)


def test_missing_reports_are_not_judged(goals):
    verdicts, flags = _verdicts(goals, {name: None for name in _reports()})
    assert set(verdicts.values()) == {None}
    assert flags == []


def test_differing_outputs_and_a_moved_baseline_are_flagged(goals):
    _, flags = _verdicts(goals, _reports(**{"coding.json": _coding(identical=4)},
                                         **{"agent.json": _agent(spread=0.11)}))
    assert any("draft auto(K<=8) identical to plain in 4 of 5 (VOID)" in flag for flag in flags), flags
    assert any("agent.json: plain passes 11% apart" in flag for flag in flags), flags
    assert not any("hf-" in flag for flag in flags)  # the anchors run another runtime's numerics


def test_evaluate_prints_the_table(goals, tmp_path, capsys):
    for name, report in _reports().items():
        (tmp_path / name).write_text(json.dumps(report))
    assert goals.main(["evaluate", str(tmp_path)], cpu_line=lambda: "test CPU") == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: test CPU")
    assert "| c at context 200 | <= 0.25 | 0.150" in out
    assert "| agent: draft vs plain without reuse | >= 2.5x | 2.57x" in out


def test_bad_inputs_are_one_line_errors(goals, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        goals.main(["evaluate", str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    (tmp_path / "coding.json").write_text("{not json")
    with pytest.raises(SystemExit):
        goals.main(["evaluate", str(tmp_path)])
    assert "is not a JSON report" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        goals.main(["run", "--out", str(tmp_path), "--stages", "costs,typo"])
    assert "unknown stage(s) typo" in capsys.readouterr().err


def test_run_writes_the_costs_reports_and_skips_done_stages(goals, tmp_path, capsys):
    fake = tmp_path / "draftwise"
    calls = tmp_path / "calls"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" >> {calls}\n"
                    "echo '{\"cost_ratio_c\": 0.2, \"draft_1_token_s\": 0.012, \"seconds\": {\"1\": 0.06}}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "reports"
    argv = ["run", "--out", str(out), "--stages", "costs", "--draftwise", str(fake)]
    assert goals.main(argv, cpu_line=lambda: "test CPU") == 0
    assert json.loads((out / "costs-1000.json").read_text())["cost_ratio_c"] == 0.2
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and "--context 200" in lines[0] and "--context 1000" in lines[1]
    assert "| c at context 1,000 | <= 0.30 | 0.200" in capsys.readouterr().out
    goals.main(argv, cpu_line=lambda: "test CPU")
    assert len(calls.read_text().splitlines()) == 2  # the reports were there: not run again


def test_per_category_rows_come_from_a_real_reports_runs(goals, tmp_path):
    """A real 13 x 5 report (``tests/data/bench-13-categories.json``: a ``bench`` JSON of 2026-12-05, token ids and
    step times left out): its JSON summary covers all prompts only, so the per-category verdict needs the rows the
    script computes from the runs."""
    real = Path(__file__).resolve().parent / "data" / "bench-13-categories.json"
    (tmp_path / "categories.json").write_text(real.read_text())
    reports = goals.load_reports(tmp_path)
    categories = {row["category"] for row in reports["categories.json"]["summary"]} - {"all"}
    assert len(categories) == 13
    verdict = {goal.name: goal for goal in goals.category_goals(reports["categories.json"])}
    assert verdict["auto, every category"].figure == "lowest 0.98x (rag; 13 categories)"
    assert verdict["auto, all 13 categories"].met is True


def test_the_agent_goal_takes_the_fastest_row_of_each_kind(goals):
    """An agent report with two draft rows (K=4 and K=8) is judged on the faster one, whichever comes last."""
    report = _agent(draft=73.0)
    report["summary"].insert(2, {**report["summary"][2], "method": "draft K=4", "wall_s": 70.0})
    verdicts, _ = _verdicts(goals, _reports(**{"agent.json": report}))
    assert verdicts["agent: draft vs plain without reuse"] is True  # 180 / 70 = 2.57x; the K=8 row: 2.47x


def test_category_goals_need_all_thirteen_categories(goals):
    found = {g.name: g for g in goals.category_goals(_categories({"rag": 1.2, "coding": 1.9}))}
    assert found["auto, every category"].met is None and "2 categories" in found["auto, every category"].figure
    assert found["auto, all 13 categories"].met is None


def test_a_moved_baseline_in_one_category_is_flagged(goals):
    report = _categories(_thirteen())
    report["summary"][5]["baseline_spread"] = 0.15
    _, flags = _verdicts(goals, _reports(**{"categories.json": report}))
    assert any("15% apart in 1 categories" in flag for flag in flags), flags


def test_reports_of_the_wrong_shape_and_an_empty_folder_are_one_line_errors(goals, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        goals.main(["evaluate", str(tmp_path)])
    assert exc.value.code == 2 and "no reports in" in capsys.readouterr().err
    cases = (("coding.json", {}), ("coding.json", []), ("costs-200.json", {"cost_ratio_c": 0.2}),
             ("agent.json", {"summary": [{"method": "plain", "kind": "plain", "wall_s": 0}]}))
    for i, (name, content) in enumerate(cases):
        folder = tmp_path / f"case-{i}"
        folder.mkdir()
        (folder / name).write_text(json.dumps(content))
        with pytest.raises(SystemExit) as exc:
            goals.main(["evaluate", str(folder)])
        assert exc.value.code == 2 and f"{name} is not a" in capsys.readouterr().err


def test_a_failing_command_is_a_one_line_error_and_an_incomplete_stage_runs_again(goals, tmp_path, capsys):
    out = tmp_path / "reports"
    assert goals.main(["run", "--out", str(out), "--stages", "costs", "--draftwise", "/bin/false"]) == 1
    assert "stage costs: /bin/false costs failed (exit 1)" in capsys.readouterr().err
    assert goals.main(["run", "--out", str(out), "--stages", "costs", "--draftwise", str(tmp_path / "none")]) == 1
    assert "cannot run" in capsys.readouterr().err
    (out / "agent.json").write_text(json.dumps({**_agent(), "complete": False}))
    assert not goals.stage_done(out, "agent")
    (out / "agent.json").write_text(json.dumps(_agent()))
    assert goals.stage_done(out, "agent")
