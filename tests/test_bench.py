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
    assert labels == ["plain", "draft K=2", "draft auto(K<=2)", "ngram K=2", "ngram auto(K<=2)", "plain (repeat)"]
    assert len(data["runs"]) == 4 * len(labels)  # 3 prompts, 4 turns in all
    run = data["runs"][0]
    for key in ("prompt_id", "category", "turn", "method", "tokens_per_s", "speedup", "identical_to_plain",
                "peak_rss_bytes", "token_ids", "stats", "measurement", "warnings"):
        assert key in run
    assert set(run["measurement"]) >= {"wall_s", "cpu_s", "cpu_share", "threads", "load_before", "load_after"}
    assert data["runs"][-1]["method"] == "plain (repeat)" and data["runs"][-1]["repeat_of"] == "plain"
    assert isinstance(data["warnings"], list) and data["measurement"]["wall_s"] > 0
    assert all("warnings" in row and "baseline_spread" in row for row in data["summary"])
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
    assert ("| ! | category | method | tok/s | speedup | decode speedup | median [min, max] | alpha | tau | K | "
            "identical | predicted |") in out
    rows = [line for line in out.splitlines() if " | all | " in line]
    assert [row.split(" | ")[2] for row in rows] == ["plain", "ngram K=2", "plain (repeat)"]
    assert all(row.count("|") == 13 for row in rows)  # 12 full cells, nothing cut or wrapped
    assert "…" not in out


def test_markdown_table_escapes_pipes_and_checks_row_lengths():
    from draftwise.report import markdown_table

    assert markdown_table(("a", "b"), [("x|y", "1")]) == ["| a | b |", "|---|---|", "| x\\|y | 1 |"]
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(("a", "b"), [("only one",)])


def _run(method: str, kind: str, k, stats: dict, time_s: float = 1.0):
    from draftwise.benchmark import PromptRun

    return PromptRun(prompt_id="1", category="coding", turn=0, method=method, kind=kind, k=k, policy="fixed",
                     num_prompt_tokens=10, num_tokens=100, time_s=time_s, tokens_per_s=100 / time_s,
                     identical_to_plain=True, first_difference=None, speedup=None, peak_rss_bytes=0,
                     peak_gpu_bytes=None, stats=stats)


def test_summary_predicts_from_the_per_token_acceptance():
    """A draft right 90% of the time per token at K=8 (hand-built counts, 100 drafts): the summary reports
    accepted / drafted (0.64) as the acceptance rate but predicts the speed-up from a = 0.9; a plain row has
    no acceptance rate (None) and tau 1.0; records without rejection counts get them rebuilt."""
    from draftwise.speculation.calibration import ForwardCosts
    from draftwise.speculation.cost_model import predicted_speedup

    accepted = [round(100 * 0.9 ** (i + 1)) for i in range(8)]
    rejected = [round(100 * 0.9**i * 0.1) for i in range(8)]
    draft = {"num_draft_tokens": 800, "num_accepted_tokens": sum(accepted), "num_target_passes": 100,
             "drafted_per_position": [100] * 8, "accepted_per_position": accepted}
    plain = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_target_passes": 99}
    costs = ForwardCosts({k: 0.1 * (1 + 0.1 * (k - 1)) for k in range(1, 10)}, context_len=200)
    for stats in ({**draft, "rejected_per_position": rejected}, draft):  # with, then without, rejection counts
        rows = summarize([_run("plain", "plain", None, plain), _run("draft K=8", "draft", 8, stats, 0.5)], costs, 0.005)
        plain_row, draft_row = rows
        assert plain_row["acceptance_rate"] is None and plain_row["token_acceptance"] is None
        assert plain_row["mean_accepted_length"] == 1.0
        assert draft_row["acceptance_rate"] == pytest.approx(sum(accepted) / 800)
        assert draft_row["token_acceptance"] == pytest.approx(0.9, abs=0.005)
        assert draft_row["predicted_speedup"] == pytest.approx(
            predicted_speedup(draft_row["token_acceptance"], 8, 0.05, 1.8))
        assert draft_row["predicted_speedup"] > 2.5  # accepted / drafted would have said about 1.3


def test_summary_predicts_from_the_chains_actually_drafted():
    """A confidence stop drafts fewer than K tokens per step: the prediction prices the steps as drafted
    (``k_history``), not as K deep, so a K=8 run that drafted 2 tokens a step is predicted like one (the K-deep
    formula promised the tokens of 8-token chains it never drafted)."""
    from draftwise.speculation.calibration import ForwardCosts
    from draftwise.speculation.cost_model import predicted_speedup, predicted_speedup_of_steps

    costs = ForwardCosts({k: 0.1 * (1 + 0.1 * (k - 1)) for k in range(1, 10)}, context_len=200)
    plain = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_target_passes": 99}
    stopped = {"num_draft_tokens": 200, "num_accepted_tokens": 160, "num_target_passes": 100,
               "drafted_per_position": [100, 100], "accepted_per_position": [90, 70],
               "rejected_per_position": [10, 20], "k_history": [2] * 100}
    rows = summarize([_run("plain", "plain", None, plain), _run("draft K=8", "draft", 8, stopped, 0.5)], costs, 0.005)
    a = rows[1]["token_acceptance"]
    assert rows[1]["predicted_speedup"] == pytest.approx(predicted_speedup(a, 2, 0.05, costs.relative(3)))
    assert rows[1]["predicted_speedup"] < predicted_speedup(a, 8, 0.05, costs.relative(9))
    assert predicted_speedup_of_steps(a, [8] * 5, 0.05, costs.relative) == pytest.approx(
        predicted_speedup(a, 8, 0.05, costs.relative(9)))
    mixed = predicted_speedup_of_steps(0.8, [0, 4], 0.1, lambda n: 1 + 0.05 * (n - 1))
    assert mixed == pytest.approx((1 + (1 - 0.8**5) / 0.2) / (1 + 0.4 + 1.2))
    with pytest.raises(ValueError):
        predicted_speedup_of_steps(0.8, [], 0.1, costs.relative)


def test_summary_prices_the_drafts_catch_up_of_each_prompt():
    """With the draft's prefill rate calibrated, a fixed-K row's prediction adds every run's catch-up of its
    uncached prompt tokens (in one-token target passes) to the steps' cost. Hand-computed: a = 0.5 per token,
    K = 4 every step, c = 0.1, v_5 = 1.4: a step is worth 1 + .5 + .25 + .125 + .0625 = 1.9375 tokens and costs
    1.8 passes; two runs of 10 steps; prompts of 10 and 30 tokens (5 of them cached) at 2 ms a token against a
    100 ms target pass: 0.2 + 0.5 passes."""
    from draftwise.speculation.calibration import ForwardCosts
    from draftwise.speculation.cost_model import catch_up_passes, predicted_speedup_of_steps

    costs = ForwardCosts({k: 0.1 * (1 + 0.1 * (k - 1)) for k in range(1, 10)}, context_len=200)
    plain = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_target_passes": 99}
    draft = {"num_draft_tokens": 40, "num_accepted_tokens": 15, "num_target_passes": 10,
             "drafted_per_position": [10, 6, 4, 2], "accepted_per_position": [5, 3, 2, 1],
             "rejected_per_position": [5, 3, 2, 1], "k_history": [4] * 10, "num_cached_prompt_tokens": 0}
    second = _run("draft K=4", "draft", 4, {**draft, "num_cached_prompt_tokens": 5}, 0.5)
    second.num_prompt_tokens = 30
    runs = [_run("plain", "plain", None, plain), _run("plain", "plain", None, plain),
            _run("draft K=4", "draft", 4, draft, 0.5), second]
    before = {r["method"]: r for r in summarize(runs, costs, 0.01)}["draft K=4"]
    after = {r["method"]: r for r in summarize(runs, costs, 0.01, draft_prefill_s=0.002)}["draft K=4"]
    assert after["token_acceptance"] == pytest.approx(0.5)
    assert after["catch_up_passes"] == pytest.approx(0.2 + 0.5)
    assert before["predicted_speedup"] == pytest.approx(20 * 1.9375 / (20 * 1.8))
    assert after["predicted_speedup"] == pytest.approx(20 * 1.9375 / (20 * 1.8 + 0.7))
    assert "catch_up_passes" not in before
    assert catch_up_passes(30, 0.002, 0.1) == pytest.approx(0.6)
    assert predicted_speedup_of_steps(0.5, [4], 0.1, costs.relative, 1.0) == pytest.approx(1.9375 / 2.8)
    with pytest.raises(ValueError):
        predicted_speedup_of_steps(0.5, [4], 0.1, costs.relative, -1.0)
    with pytest.raises(ValueError):
        catch_up_passes(10, 0.002, 0.0)


def test_bench_calibrates_the_drafts_prefill_as_a_catch_up_asks(monkeypatch):
    """``bench``'s calibration times the draft's one-token pass and a prompt-sized prefill pass that asks for one
    logit row, and reports seconds per prefill token (the chunk's median / its tokens)."""
    import argparse
    import types

    from draftwise.speculation.calibration import PREFILL_CHUNK_TOKENS
    from draftwise.commands import bench
    from fakes import BigramLM, peaked_table
    from rich.console import Console

    calls = []

    def fake(backend, ks, *, context_len, num_logits=None, **_):
        calls.append((backend.name, sorted(ks), context_len, num_logits))
        return {k: [0.01 * k, 0.01 * k, 0.02 * k] for k in sorted(set(ks) | {1})}

    monkeypatch.setattr(bench, "forward_pass_samples", fake)
    target = types.SimpleNamespace(backend=BigramLM(peaked_table(16, seed=0), max_context=1024, name="target"))
    draft = types.SimpleNamespace(backend=BigramLM(peaked_table(16, seed=1), max_context=1024, name="draft"))
    calibration, _, draft_cost = bench._calibrate(Console(quiet=True), argparse.Namespace(no_calibrate=False),
                                                  target, draft, [4])
    assert calls == [("target", [1, 2, 3, 4, 5], 200, None), ("draft", [1, PREFILL_CHUNK_TOKENS], 200, 1)]
    assert draft_cost == pytest.approx(0.01)
    assert calibration["draft_prefill_token_s"] == pytest.approx(0.01)  # 0.01 * chunk / chunk


def test_summary_and_report_show_the_hybrid_steps_by_side(tmp_path):
    """A hybrid row sums its runs' passes by side, a report prints them under the table; other rows have none."""
    import dataclasses

    from draftwise.report import hybrid_lines, write_markdown

    plain = {"num_draft_tokens": 0, "num_accepted_tokens": 0, "num_target_passes": 99}
    drafts = {"num_draft_tokens": 40, "num_accepted_tokens": 30, "num_target_passes": 29,
              "drafted_per_position": [20, 20], "accepted_per_position": [16, 14]}
    runs = []
    for prompt_id, steps in (("1", {"suffix": 12, "draft_model": 8, "plain": 9}),
                             ("2", {"suffix": 1, "draft_model": 19, "plain": 0})):
        runs += [dataclasses.replace(_run("plain", "plain", None, plain), prompt_id=prompt_id),
                 dataclasses.replace(_run("hybrid K=4", "hybrid", 4, {**drafts, "hybrid_steps": steps}, 0.5),
                                     prompt_id=prompt_id)]
    rows = {row["method"]: row for row in summarize(runs)}
    assert rows["plain"]["hybrid_steps"] is None
    assert rows["hybrid K=4"]["hybrid_steps"] == {"suffix": 13, "draft_model": 27, "plain": 9}
    assert hybrid_lines(list(rows.values())) == ["hybrid K=4: hybrid steps: suffix 13, draft model 27, plain 9"]
    text = write_markdown(tmp_path / "report.md", {}, list(rows.values()), [], {}, runs).read_text()
    assert "- hybrid K=4: hybrid steps: suffix 13, draft model 27, plain 9" in text


@pytest.mark.parametrize("workload", ["prompts", "agent"])
def test_an_output_directory_is_refused_before_anything_runs(stories_path, prompts_file, tmp_path, capsys, workload):
    """A directory as --output used to crash with a traceback after the first prompt had been measured."""
    code = main(["bench", "--model", str(stories_path), "--prompts", str(prompts_file), "--workload", workload,
                 "--methods", "plain", "--max-tokens", "4", "--no-calibrate", "--output", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path}: is a directory; name the JSON file to write" in err and "Traceback" not in err


def test_the_prompts_workload_refuses_a_prefix_cache_budget(stories_path, prompts_file, capsys):
    """Found by a new-user test: ``--kv-cache-memory`` with the prompts workload (no prefix reuse) was ignored."""
    code = main(["bench", "--model", str(stories_path), "--prompts", str(prompts_file), "--methods", "plain",
                 "--max-tokens", "4", "--no-calibrate", "--kv-cache-memory", "2GiB"])
    assert code == 2
    assert "--kv-cache-memory applies to --workload agent" in capsys.readouterr().err


def test_only_draftwise_runs_that_differ_count_as_mismatches():
    """transformers' own generate (the hf anchors) runs other numerics, so its differences are reported apart
    and do not make `bench` fail; a draftwise method that differs does."""
    from dataclasses import replace

    from draftwise.benchmark import draftwise_mismatches, is_external_anchor

    plain = _run("plain", "plain", None, {})
    anchor = replace(_run("hf-assisted K=4", "hf-assisted", 4, {}), identical_to_plain=False, first_difference=3)
    lookup = replace(_run("hf-lookup K=4", "hf-lookup", 4, {}), identical_to_plain=False, first_difference=1)
    assert is_external_anchor("hf-assisted") and is_external_anchor("hf-lookup") and not is_external_anchor("draft")
    assert draftwise_mismatches([plain, anchor, lookup]) == []
    wrong = replace(_run("draft K=4", "draft", 4, {}), identical_to_plain=False, first_difference=7)
    assert draftwise_mismatches([plain, anchor, wrong]) == [wrong]


@pytest.mark.parametrize("text", ["0", "1,-1", "65", "4,1000"])
def test_ks_outside_1_to_64_are_refused_like_the_config_refuses_them(text):
    from draftwise.commands.bench import parse_ks
    from draftwise.commands.common import CliError

    with pytest.raises(CliError, match="1..64"):
        parse_ks(text)
    assert parse_ks("8,4,4") == [4, 8]


def test_a_prompt_longer_than_the_context_is_skipped_and_named(stories, caplog):
    """Found by a new-user test: one Spec-Bench prompt of 2,121 tokens against stories260K's 2,048 aborted the
    whole bench; it is now skipped with a warning that names it, and the other prompts run."""
    from draftwise.benchmark import BenchPrompt

    limit = stories.backend.max_context
    long_prompt = BenchPrompt("long", "rag", (" ".join(["Once upon a time"] * limit),))
    short_prompt = BenchPrompt("short", "writing", ("Once upon a time",))
    plain = SpeculativeEngine(stories.backend, eos_token_ids=stories.eos_token_ids)
    methods = [MethodSpec("plain", "plain", engine=plain)]
    with caplog.at_level("WARNING"):
        runs = run_benchmark(stories, methods, [long_prompt, short_prompt], SamplingParams(max_tokens=4), chat=False)
    assert [r.prompt_id for r in runs] == ["short"]
    assert "prompt long (rag) skipped" in caplog.text and f"context length is {limit} tokens" in caplog.text
