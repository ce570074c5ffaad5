"""The benchmark library and command on stories260K: JSON schema, resume, exactness check, reports."""

from __future__ import annotations

import json

import pytest

from draftwise.benchmark import MethodSpec, load_prompts, load_results, run_benchmark, summarize, write_json
from draftwise.cli import main
from draftwise.config import SamplingParams
from draftwise.engine import GenerationResult, SpeculativeEngine
from draftwise.proposers.ngram import NgramProposer

PROMPTS = ('{"question_id": 1, "category": "a", "turns": ["Once upon a time", "What happened next?"]}\n'
           '{"question_id": 2, "category": "b", "turns": ["Tom had a red ball."]}\n'
           '{"prompt": "Lily saw a cat.", "category": "b"}\n')


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(PROMPTS)
    return path


def test_load_prompts_filters_and_limits(prompts_file):
    prompts = load_prompts(prompts_file)
    assert [(p.id, p.category, len(p.turns)) for p in prompts] == [("1", "a", 2), ("2", "b", 1), ("3", "b", 1)]
    assert [p.id for p in load_prompts(prompts_file, ["b"], limit=1)] == ["2"]


def test_load_prompts_rejects_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"turns": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompts(path)


def corrupting_runner(engine: SpeculativeEngine, position: int):
    """A deliberately wrong method: plain decoding with the token at `position` changed."""

    def run(ids, params):
        result = engine.generate(ids, params)
        tokens = list(result.token_ids)
        tokens[position] = (tokens[position] + 1) % 512
        return GenerationResult(tokens, result.finish_reason, result.stats)

    return run


def test_exactness_check_catches_a_wrong_method(stories, prompts_file):
    plain = SpeculativeEngine(stories.backend, eos_token_ids=stories.eos_token_ids)
    methods = [MethodSpec("plain", "plain", engine=plain),
               MethodSpec("ngram K=3", "ngram", 3, engine=SpeculativeEngine(stories.backend, NgramProposer(), 3)),
               MethodSpec("broken", "ngram", 3, runner=corrupting_runner(plain, 5))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = run_benchmark(stories, methods, load_prompts(prompts_file)[:2], params, chat=False)
    assert len(runs) == 6
    by_method = {m: [r for r in runs if r.method == m] for m in ("plain", "ngram K=3", "broken")}
    assert all(r.identical_to_plain for r in by_method["ngram K=3"])
    assert all(not r.identical_to_plain and r.first_difference == 5 for r in by_method["broken"])
    summary = {row["method"]: row for row in summarize(runs)}
    assert summary["broken"]["identical"] == 0 and summary["ngram K=3"]["identical"] == 2


def test_resume_skips_finished_prompts_and_redoes_partial_ones(stories, prompts_file, tmp_path):
    calls = []
    plain = SpeculativeEngine(stories.backend, eos_token_ids=stories.eos_token_ids)

    def counting(ids, params):
        calls.append(len(ids))
        return plain.generate(ids, params)

    methods = [MethodSpec("plain", "plain", runner=counting)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = load_prompts(prompts_file)
    first = run_benchmark(stories, methods, prompts[:2], params, chat=False, all_turns=True)
    assert len(calls) == 3  # prompt 1 has two turns
    path = write_json(tmp_path / "r.json", {}, first[:-1], [], {}, complete=False)  # prompt 2 left unfinished
    _, done, _ = load_results(path)
    calls.clear()
    resumed = run_benchmark(stories, methods, prompts, params, chat=False, all_turns=True, done=done)
    assert len(calls) == 2  # prompts 2 and 3, not prompt 1
    assert sorted((r.prompt_id, r.turn) for r in resumed) == [("1", 0), ("1", 1), ("2", 0), ("3", 0)]


def test_bench_command_json_schema_markdown_and_plots(stories, stories_path, prompts_file, tmp_path):
    out = tmp_path / "out" / "bench.json"
    code = main(["bench", "--model", str(stories_path), "--draft", str(stories_path), "--prompts", str(prompts_file),
                 "--methods", "plain,draft,ngram", "--ks", "2", "--k-policies", "fixed,auto", "--max-tokens", "10",
                 "--chat", "off", "--output", str(out), "--turns", "all"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["complete"] is True
    assert set(data) >= {"config", "environment", "calibration", "summary", "runs"}
    labels = [row["method"] for row in data["summary"]]
    assert labels == ["plain", "draft K=2", "draft auto(K<=2)", "ngram K=2", "ngram auto(K<=2)"]
    assert len(data["runs"]) == 4 * len(labels)  # 3 prompts, 4 turns in all
    run = data["runs"][0]
    for key in ("prompt_id", "category", "turn", "method", "tokens_per_s", "speedup", "identical_to_plain",
                "peak_rss_bytes", "token_ids", "stats"):
        assert key in run
    assert all(r["identical_to_plain"] for r in data["runs"])
    assert "v2" in " ".join(f"v{k}" for k in data["calibration"]["target"]["relative"])
    assert "## Exactness" in out.with_suffix(".md").read_text()
    plots = sorted(p.name for p in (tmp_path / "out" / "bench-plots").iterdir())
    assert plots == ["acceptance_by_position.png", "speedup_by_category.png", "tokens_per_s_over_time.png"]


def test_result_table_is_readable_when_output_is_not_a_terminal(stories_path, prompts_file, tmp_path, capsys,
                                                                 monkeypatch):
    """Issue 15: piped output got rich's 80-column default and every column cut to three letters."""
    for variable in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(variable, raising=False)
    code = main(["bench", "--model", str(stories_path), "--prompts", str(prompts_file), "--limit", "1",
                 "--methods", "plain,ngram", "--ks", "2", "--max-tokens", "4", "--chat", "off", "--no-calibrate",
                 "--no-plots", "--output", str(tmp_path / "b.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert ("| category | method | tok/s | speedup | decode speedup | median [min, max] | alpha | tau | K | identical "
            "| predicted |") in out
    rows = [line for line in out.splitlines() if line.startswith("| all | ")]
    assert [row.split(" | ")[1] for row in rows] == ["plain", "ngram K=2"]
    assert all(row.count("|") == 12 for row in rows)  # 11 full cells, nothing cut or wrapped
    assert "…" not in out


def test_markdown_table_escapes_pipes_and_checks_row_lengths():
    from draftwise.report import markdown_table

    assert markdown_table(("a", "b"), [("x|y", "1")]) == ["| a | b |", "|---|---|", "| x\\|y | 1 |"]
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(("a", "b"), [("only one",)])
