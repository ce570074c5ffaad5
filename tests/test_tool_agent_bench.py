"""The tool-using agent workload (``bench --workload agent-tools``): sessions whose model calls use tools over a
virtual repository, replayed through the real server app started in process, with the scripted coding agent of
:func:`tool_agents.coding_reply` (stories260K's tokenizer, a Qwen2.5-style template) for plain and n-gram
decoding; transcripts identical, the report's fields, and one-line errors for bad session files."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from draftwise.agent_bench import AgentMethod, TurnOutcome, run_agent_benchmark
from draftwise.builder import EngineBundle, assemble_engine, build_proposer
from draftwise.cli import main
from draftwise.config import SamplingParams, SpeculativeConfig
from draftwise.report import tool_agent_columns, tool_agent_rows
from draftwise.server import ServerSettings, create_app
from draftwise.tool_agent_bench import (
    TOOL_NAMES,
    TestCheck,
    VirtualRepo,
    default_tool_sessions_path,
    load_tool_sessions,
    parse_tool_session,
    replay_tool_session,
    served_app,
    served_method,
    summarize_tool_agent,
)
from tool_agents import BUG, HERMES_TEMPLATE, tool_model

CALC = "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a + b\n"
FIXED = CALC.replace(BUG, BUG.replace("a + b", "a - b"))
SESSION = {"id": "calc", "task": "Fix subtract in calc.py.", "files": {"calc.py": CALC},
           "tests": [{"name": "test_subtract", "file": "calc.py", "contains": "return a - b",
                      "failure": "E  assert 8 == 2"}], "max_calls": 6}
GREEDY = SamplingParams(temperature=0.0, max_tokens=400)


@pytest.fixture
def session_file(tmp_path):
    path = tmp_path / "tool_sessions.jsonl"
    path.write_text(json.dumps(SESSION) + "\n" + json.dumps({**SESSION, "id": "calc-2", "max_calls": 2}) + "\n")
    return path


def _method(model, label: str, spec: SpeculativeConfig | None) -> AgentMethod:
    def build():
        proposer = build_proposer(spec, model, device="cpu", dtype=None)[0] if spec else None
        engine = assemble_engine(model, proposer, spec.num_speculative_tokens if spec else 5)
        return EngineBundle(target=model, core=engine.core, speculative_config=spec)

    settings = ServerSettings(served_model_names=("tool-model",), chat_template=HERMES_TEMPLATE)
    return served_method(label, "plain" if spec is None else spec.method, spec and spec.num_speculative_tokens,
                         build, settings, GREEDY, timeout_s=60)


# ---------------------------------------------------------------------- the repository and its tools
def test_tools_are_deterministic_and_invalid_calls_change_nothing():
    repo = VirtualRepo({"calc.py": CALC}, [TestCheck("test_subtract", "calc.py", ("return a - b",), (), "E  boom")])
    assert repo.call("list_files", "{}").content == "calc.py"
    assert repo.call("read_file", '{"path": "calc.py"}').content == CALC
    assert repo.call("read_file", '{"path": "nope.py"}').content == "error: no such file: nope.py"
    failing = repo.call("run_tests", "{}")
    assert failing.valid and "test_subtract FAILED" in failing.content and "E  boom" in failing.content
    assert failing.content.endswith("=== 1 failed ===")
    for name, arguments in [("delete_file", "{}"), ("read_file", "{not json"), ("read_file", '{"file": "x"}'),
                            ("write_file", '{"path": "calc.py", "content": 3}'), ("run_tests", "[]")]:
        result = repo.call(name, arguments)
        assert not result.valid and result.content.startswith("error: "), (name, arguments)
    assert repo.files == {"calc.py": CALC}
    assert repo.call("write_file", json.dumps({"path": "calc.py", "content": FIXED})).valid
    assert repo.call("run_tests", "{}").content.endswith("=== 1 passed ===")


def test_shipped_sessions_are_valid_coding_tasks_that_fail_first():
    sessions = load_tool_sessions(default_tool_sessions_path())
    assert len(sessions) >= 3 and len({s.id for s in sessions}) == len(sessions)
    for session in sessions:
        assert all(10 <= len(content.splitlines()) <= 80 for content in session.files.values()), session.id
        assert "failed" in VirtualRepo(session.files, session.tests).call("run_tests", "{}").content, session.id


@pytest.mark.parametrize("row, message", [
    ("{not json", r"tool_sessions.jsonl:1: not valid JSON"),
    (json.dumps({**SESSION, "task": ""}), r":1: 'task' must be a non-empty string"),
    (json.dumps({**SESSION, "files": {}}), r":1: 'files' must be a non-empty object"),
    (json.dumps({**SESSION, "files": {"a.py": 3}}), r":1: 'files' must be a non-empty object"),
    (json.dumps({**SESSION, "tests": [{"name": "t", "file": "other.py"}]}), r":1: test 't' checks 'other.py'"),
    (json.dumps({**SESSION, "tests": [{"name": "t"}]}), r":1: each test needs a 'name' and a 'file'"),
    (json.dumps({**SESSION, "tests": [{"name": "t", "file": "calc.py", "contains": 3}]}), r"'contains' must be"),
    (json.dumps({**SESSION, "max_calls": 0}), r":1: 'max_calls' must be an integer >= 1"),
    (json.dumps([SESSION]), r":1: expected a session object"),
    (json.dumps(SESSION) + "\n" + json.dumps(SESSION), r"session ids repeat"),
    ("\n", r"no tool sessions in"),
])
def test_bad_session_files_are_one_line_errors(tmp_path, row, message):
    path = tmp_path / "tool_sessions.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(ValueError, match=message) as raised:
        load_tool_sessions(path)
    assert "\n" not in str(raised.value)


def test_bad_session_file_is_a_cli_error(tmp_path, capsys):
    path = tmp_path / "tool_sessions.jsonl"
    path.write_text(json.dumps({**SESSION, "task": 3}) + "\n")
    assert main(["bench", "--workload", "agent-tools", "--sessions", str(path), "--url", "http://127.0.0.1:9"]) == 2
    assert "'task' must be a non-empty string" in capsys.readouterr().err


# ---------------------------------------------------------------------- end to end through the real server
@pytest.fixture(scope="module")
def replayed(stories):
    """plain, ngram K=4 and plain again through the real app, on the shipped-format session file."""
    model = tool_model(stories)
    sessions = [load_tool_sessions_from(SESSION)]
    methods = [_method(model, "plain", None),
               _method(model, "ngram K=4", SpeculativeConfig(method="ngram", num_speculative_tokens=4))]
    repeat = dataclasses.replace(methods[0], label="plain (repeat)", repeat_of="plain")
    turns, elapsed = run_agent_benchmark(methods + [repeat], sessions,
                                         replay_session=functools.partial(replay_tool_session, tool_choice="auto"))
    return turns, summarize_tool_agent(turns, elapsed)


def load_tool_sessions_from(row: dict):
    return parse_tool_session(row, "test", 1)


def test_the_agent_loop_calls_tools_fixes_the_file_and_stops(replayed):
    turns, _ = replayed
    plain = [t for t in turns if t.method == "plain"]
    assert [[c["name"] for c in t.tool_calls] for t in plain] == [["list_files", "read_file"], ["write_file"],
                                                                 ["run_tests"], []]
    assert plain[-1].text.strip() == "Fixed subtract: === 1 passed ==="  # the tests passed after the write
    assert json.loads(plain[1].tool_calls[0]["arguments"])["content"] == FIXED
    assert all(t.valid_calls == len(t.tool_calls) and t.invalid_calls == 0 for t in plain)
    assert [t.finish_reason for t in plain] == ["tool_calls"] * 3 + ["stop"]


def test_ngram_transcript_is_plains_and_the_report_splits_tool_turns(replayed):
    turns, summary = replayed
    assert [r["method"] for r in summary] == ["plain", "ngram K=4", "plain (repeat)"]
    for row in summary:
        assert row["transcript_identical"] is True and row["identical"] == row["turns"] == 4
        assert row["tool_turns"] == 3 and row["other_turns"] == 1
        assert row["calls"] == row["valid_calls"] == 4
        assert row["wall_s"] > 0 and row["speedup"] > 0 and row["tokens_per_s"] > 0
        assert "grammar_s_per_token" not in row  # tool_choice auto: no grammar ran
    plain, ngram = summary[0], summary[1]
    assert plain["alpha_tool"] is None and plain["tau_tool"] == 1.0  # nothing drafted
    # the write copies the file read one turn earlier: n-gram drafts pay on tool-call turns
    assert ngram["alpha_tool"] > 0.3 and ngram["tau_tool"] > 1.5
    assert ngram["alpha_other"] is None or 0.0 <= ngram["alpha_other"] <= 1.0
    ngram_turns = [t for t in turns if t.method == "ngram K=4"]
    assert sum(t.stats["num_accepted_tokens"] for t in ngram_turns) > 0
    assert ngram_turns[1].stats["method"] == "ngram"
    columns = tool_agent_columns(summary)
    assert "grammar s/token" not in columns
    cells = tool_agent_rows(summary)
    assert all(len(row) == len(columns) and row[-1] == "identical" for row in cells)


def test_a_differing_transcript_is_flagged(replayed):
    turns, _ = replayed
    bent = [dataclasses.replace(t, identical_to_plain=False, first_difference=0)
            if t.method == "ngram K=4" and t.turn == 1 else t for t in turns]
    summary = summarize_tool_agent(bent)
    assert [r["transcript_identical"] for r in summary] == [True, False, True]
    assert tool_agent_rows(summary)[1][-1] == "DIFFERS (bug)"


def test_grammar_time_is_reported_per_token_when_the_server_sends_it(replayed):
    turns, _ = replayed
    timed = [dataclasses.replace(t, stats={**t.stats, "grammar_time_s": 0.01}) for t in turns]
    summary = summarize_tool_agent(timed)
    for row in summary:
        assert row["grammar_s_per_token"] == pytest.approx(0.01 * row["turns"] / row["output_tokens"])
    assert "grammar s/token" in tool_agent_columns(summary)


def test_replay_compares_calls_not_only_text():
    """Same content, different arguments: the transcript differs at the calls."""

    class Runner:
        threads = None

        def __init__(self, path):
            self.path = path

        def run_turn(self, messages, params=None, *, extra_body=None):
            assert [t["function"]["name"] for t in extra_body["tools"]] == list(TOOL_NAMES)
            call = {"id": "call_1", "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": self.path})}}
            return TurnOutcome(text="Reading.", output_tokens=5, prompt_tokens=9, cached_tokens=None, ttft_s=0.1,
                               wall_s=0.2, finish_reason="tool_calls", tool_calls=(call,) if messages[-1]["role"] ==
                               "user" else ())

    session = dataclasses.replace(load_tool_sessions_from(SESSION), max_calls=3)
    method = AgentMethod("m", None)
    base = replay_tool_session(Runner("calc.py"), method, session, {}, None)
    assert len(base) == 2 and base[0].tool_calls[0]["name"] == "read_file" and base[1].tool_calls == []
    same = replay_tool_session(Runner("calc.py"), method, session, {(b.session_id, b.turn): b for b in base}, None)
    other = replay_tool_session(Runner("x.py"), method, session, {(b.session_id, b.turn): b for b in base}, None)
    assert all(t.identical_to_plain for t in same)
    assert not other[0].identical_to_plain and other[0].first_difference > len("Reading.")


def test_cli_in_process_on_stories(stories_path, tmp_path, session_file):
    """The command builds each method as serve does and serves it on loopback; stories260K itself calls no
    tool, so each session is one model call."""
    template = tmp_path / "template.jinja"
    template.write_text(HERMES_TEMPLATE)
    out = tmp_path / "run.json"
    code = main(["bench", "--workload", "agent-tools", "--model", str(stories_path), "--methods", "plain,ngram",
                 "--ks", "3", "--sessions", str(session_file), "--chat-template", str(template), "--max-tokens", "8",
                 "--device", "cpu", "--no-plots", "--output", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["workload"] == "agent-tools" and data["config"]["tool_choice"] == "auto"
    assert [r["method"] for r in data["summary"]] == ["plain", "ngram K=3", "plain (repeat)"]
    for row in data["summary"]:
        assert row["transcript_identical"] is True
        for key in ("alpha_tool", "tau_tool", "alpha_other", "tau_other", "calls", "valid_calls", "speedup"):
            assert key in row
    assert "## Tool calls" in out.with_suffix(".md").read_text()


def test_cli_url_mode_against_the_scripted_agent(stories, tmp_path, session_file):
    """``--url`` servers: the scripted coding agent behind two real servers (plain, ngram); four calls in
    session calc (three with tool calls), two in calc-2 (its max_calls)."""
    model = tool_model(stories)
    settings = ServerSettings(served_model_names=("tool-model",), chat_template=HERMES_TEMPLATE)
    plain = EngineBundle(target=model, core=assemble_engine(model).core)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    ngram = EngineBundle(target=model, core=assemble_engine(model, build_proposer(spec, model, device="cpu",
                                                                                   dtype=None)[0], 3).core)
    out = tmp_path / "url.json"
    with served_app(create_app(plain, settings)) as plain_url, served_app(create_app(ngram, settings)) as ngram_url:
        code = main(["bench", "--workload", "agent-tools", "--url", f"plain={plain_url}", "--url",
                     f"ngram={ngram_url}/v1", "--sessions", str(session_file), "--max-tokens", "400", "--no-plots",
                     "--no-baseline-repeat", "--concurrency", "2", "--output", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["config"]["mode"] == "http"
    rows = {r["method"]: r for r in data["summary"]}
    assert rows["plain"]["turns"] == rows["ngram"]["turns"] == 6
    assert rows["ngram"]["transcript_identical"] and rows["ngram"]["tool_turns"] == 5
    assert rows["ngram"]["valid_calls"] == rows["ngram"]["calls"] == 7
    assert rows["ngram"]["alpha_tool"] > 0.3
