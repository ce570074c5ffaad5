"""Tool-using agent workload: coding sessions whose turns call tools and feed the results back (issue 51, item 5).

A *tool session* is a task ("fix the failing test in calc.py", "rename a function across the repository") over a
small virtual repository (path -> content, given in the session file). The model is offered four function tools,
:data:`TOOLS`: ``read_file(path)``, ``write_file(path, content)``, ``list_files()`` and ``run_tests()``. Each model
call is one OpenAI chat request with ``tools`` (and ``tool_choice``); the reply's ``tool_calls`` are run against the
session's own copy of the repository and their results sent back as ``tool`` messages in the next request, as a
coding agent's loop does (mini-swe-agent, OpenHands, smolagents' ToolCallingAgent). A session ends at a reply
without tool calls or after ``max_calls`` model calls.

Everything is deterministic: the tools are pure functions of the repository and their arguments, and
``run_tests`` returns a canned pytest-like report computed from the files' content (each check of the session
passes when its file contains every ``contains`` string and none of its ``absent`` strings). The same replies
therefore give the same tool results and the same next prompts, so an exact method replays plain decoding's
sessions call for call, and its *transcript* (every reply's content and tool calls, names and argument strings;
call ids left out, a server draws them) is compared with the baseline's turn by turn.

Calls run over HTTP through :class:`draftwise.agent_bench.HttpTurnRunner` (streamed, ``usage.speculative`` read
from the last chunk), against ``--url`` servers or against the real draftwise app started in process for each
method on a loopback port (:func:`served_method`), so the whole tool path (chat template with ``tools``, tool-call
parser, grammar of a forced ``tool_choice``) is what a client gets.

Sessions file (``.jsonl``, one object per line, or ``.json``: a list or ``{"sessions": [...]}``)::

    {"id": "fix-subtract",                      # optional (default: the position, from 1)
     "category": "agent-tools",                 # optional
     "system": "You are ...",                   # optional (default DEFAULT_TOOL_SYSTEM_PROMPT)
     "task": "The test test_subtract fails ...",# the user's request
     "files": {"calc.py": "...", ...},          # the repository: path -> content, at least one file
     "tests": [{"name": "test_subtract", "file": "calc.py", "contains": ["return a - b"],
                "absent": ["return a + b"], "failure": "assert add(2, 3) ..."}],   # run_tests's checks
     "max_calls": 8}                            # optional: model calls per session (default DEFAULT_MAX_CALLS)

Per method the summary (:func:`summarize_tool_agent`) adds to :func:`draftwise.agent_bench.summarize_agent`'s
rows: acceptance ``alpha`` (accepted / drafted tokens) and mean accepted length ``tau`` (1 + accepted / target
passes, vLLM's definition) on tool-call turns (replies with ``tool_calls``) and on the other turns, the calls and
valid calls, whether the transcript equals the baseline's, and, where the server reports ``grammar_time_s`` or
``processor_time_s`` in ``usage.speculative``, grammar seconds per output token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from draftwise.agent_bench import (
    AgentBenchError,
    AgentMethod,
    AgentTurn,
    HttpTurnRunner,
    make_turn,
    shipped_sessions_path,
    summarize_agent,
)
from draftwise.benchmark import first_difference
from draftwise.speculation import measurement

__all__ = ["TOOLS", "TOOL_NAMES", "DEFAULT_MAX_CALLS", "DEFAULT_TOOL_SYSTEM_PROMPT", "TestCheck", "ToolSession",
           "VirtualRepo", "ToolResult", "default_tool_sessions_path", "parse_tool_session", "load_tool_sessions", "replay_tool_session",
           "transcript_of", "summarize_tool_agent", "served_app", "served_method", "GRAMMAR_TIME_FIELDS"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_CALLS = 8
DEFAULT_TOOL_SYSTEM_PROMPT = (
    "You are a coding agent working in a small Python repository. Use the tools to look at files, change them and "
    "run the tests. Write whole files with write_file. When the tests pass, answer with one sentence saying what "
    "you changed.")
#: ``usage.speculative`` fields that may carry the seconds spent in the request's logits processors (grammar).
GRAMMAR_TIME_FIELDS = ("grammar_time_s", "processor_time_s")


def _function(name: str, description: str, properties: dict[str, str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "string", "description": d}
                                                        for p, d in properties.items()},
                       "required": list(properties), "additionalProperties": False}}}


#: The OpenAI function tools offered on every call (JSON-schema parameters, all strings).
TOOLS: tuple[dict, ...] = (
    _function("list_files", "List the paths of all files in the repository.", {}),
    _function("read_file", "Return the content of a file.", {"path": "the file's path, e.g. calc.py"}),
    _function("write_file", "Replace a file's whole content (creates the file if needed).",
              {"path": "the file's path", "content": "the complete new content of the file"}),
    _function("run_tests", "Run the repository's test suite and return pytest's report.", {}),
)
TOOL_NAMES = tuple(tool["function"]["name"] for tool in TOOLS)


@dataclass(frozen=True)
class TestCheck:
    """One canned test of ``run_tests``: passes when ``file`` holds every ``contains`` string and no ``absent``
    string; ``failure`` is the text shown under a failure."""

    __test__ = False  # not a pytest class

    name: str
    file: str
    contains: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    failure: str = "AssertionError"

    def passes(self, files: Mapping[str, str]) -> bool:
        """Whether the check passes on ``files`` (a missing file fails)."""
        content = files.get(self.file)
        return content is not None and all(s in content for s in self.contains) and \
            not any(s in content for s in self.absent)


@dataclass(frozen=True)
class ToolSession:
    """One tool-using session (see the module docstring for the file format).

    Attributes:
        id, category: names in tables and JSON.
        task: the user's request.
        files: the initial repository, path -> content.
        tests: the checks ``run_tests`` reports.
        system: the system prompt.
        max_calls: model calls at most (>= 1).
    """

    id: str
    task: str
    files: Mapping[str, str]
    tests: tuple[TestCheck, ...]
    system: str = DEFAULT_TOOL_SYSTEM_PROMPT
    max_calls: int = DEFAULT_MAX_CALLS
    category: str = "agent-tools"

    @property
    def turns(self) -> range:
        """The model calls a session may make (``len`` is ``max_calls``: the progress bar's total)."""
        return range(self.max_calls)

    def first_messages(self) -> list[dict]:
        """The conversation of the first call: the system prompt and the task."""
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returned (``content``, sent back as the ``tool`` message) and whether the call was
    valid: a known tool, arguments a JSON object with exactly the tool's string parameters."""

    content: str
    valid: bool


class VirtualRepo:
    """A session's repository in memory, and the tools over it. Deterministic: a result depends only on the
    files and the call."""

    def __init__(self, files: Mapping[str, str], tests: Sequence[TestCheck]) -> None:
        self.files = dict(files)
        self.tests = tuple(tests)

    def call(self, name: str | None, arguments: str | None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (the JSON string of a tool call). An invalid call (unknown tool,
        arguments that are not a JSON object of the tool's string parameters) changes nothing and returns an
        ``error: ...`` text, as agent frameworks send back to the model."""
        spec = next((t["function"] for t in TOOLS if t["function"]["name"] == name), None)
        if spec is None:
            return ToolResult(f"error: unknown tool {name!r}; the tools are {', '.join(TOOL_NAMES)}", False)
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return ToolResult(f"error: the arguments are not valid JSON ({exc.msg})", False)
        expected = set(spec["parameters"]["properties"])
        if not isinstance(args, dict) or set(args) != expected or not all(isinstance(v, str) for v in args.values()):
            wanted = ", ".join(f"{p} (string)" for p in sorted(expected)) or "no arguments"
            return ToolResult(f"error: {name} takes {wanted}", False)
        return ToolResult(getattr(self, f"_{name}")(**args), True)

    def _list_files(self) -> str:
        return "\n".join(sorted(self.files))

    def _read_file(self, path: str) -> str:
        return self.files[path] if path in self.files else f"error: no such file: {path}"

    def _write_file(self, path: str, content: str) -> str:
        self.files[path] = content
        return f"wrote {len(content.encode('utf-8'))} bytes to {path}"

    def _run_tests(self) -> str:
        results = [(check, check.passes(self.files)) for check in self.tests]
        lines = [f"collected {len(results)} items", ""]
        lines += [f"test_{check.file.removesuffix('.py')}.py::{check.name} {'PASSED' if ok else 'FAILED'}"
                  for check, ok in results]
        failed = [check for check, ok in results if not ok]
        for check in failed:
            lines += ["", f"___ {check.name} ___", check.failure]
        passed = len(results) - len(failed)
        summary = ", ".join(part for part in (f"{len(failed)} failed" if failed else "",
                                              f"{passed} passed" if passed else "") if part)
        return "\n".join(lines + ["", f"=== {summary or 'no tests ran'} ==="])


# ---------------------------------------------------------------------- sessions file
def default_tool_sessions_path() -> Path:
    """``data/agent_tool_sessions.jsonl`` of the source checkout (:func:`draftwise.agent_bench.shipped_sessions_path`)."""
    return shipped_sessions_path("agent_tool_sessions.jsonl", "tool sessions")


def _strings(value: object, where: str, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: '{name}' must be a string or a list of strings")
    return tuple(value)


def _parse_check(row: object, where: str, files: Mapping[str, str]) -> TestCheck:
    if not isinstance(row, dict) or not isinstance(row.get("name"), str) or not isinstance(row.get("file"), str):
        raise ValueError(f"{where}: each test needs a 'name' and a 'file' (strings)")
    if row["file"] not in files:
        raise ValueError(f"{where}: test {row['name']!r} checks {row['file']!r}, which is not in 'files'")
    failure = row.get("failure", "AssertionError")
    if not isinstance(failure, str):
        raise ValueError(f"{where}: test {row['name']!r}: 'failure' must be a string")
    return TestCheck(row["name"], row["file"], _strings(row.get("contains", []), where, "contains"),
                     _strings(row.get("absent", []), where, "absent"), failure)


def parse_tool_session(row: object, where: str, position: int) -> ToolSession:
    """The :class:`ToolSession` of one session object of a sessions file (format in the module docstring);
    ``where`` (file and line) starts every error message, ``position`` is the default id.

    Raises:
        ValueError: one line naming ``where`` and the malformed field.
    """
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a session object with 'task', 'files' and 'tests'")
    task, files, tests = row.get("task"), row.get("files"), row.get("tests", [])
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"{where}: 'task' must be a non-empty string")
    if not isinstance(files, dict) or not files or not all(isinstance(k, str) and isinstance(v, str)
                                                           for k, v in files.items()):
        raise ValueError(f"{where}: 'files' must be a non-empty object of path -> content strings")
    if not isinstance(tests, list):
        raise ValueError(f"{where}: 'tests' must be a list")
    system = row.get("system", DEFAULT_TOOL_SYSTEM_PROMPT)
    if not isinstance(system, str) or not system.strip():
        raise ValueError(f"{where}: 'system' must be a non-empty string")
    max_calls = row.get("max_calls", DEFAULT_MAX_CALLS)
    if not isinstance(max_calls, int) or isinstance(max_calls, bool) or max_calls < 1:
        raise ValueError(f"{where}: 'max_calls' must be an integer >= 1, got {max_calls!r}")
    return ToolSession(id=str(row.get("id", position)), task=task, files=dict(files),
                       tests=tuple(_parse_check(t, where, files) for t in tests), system=system,
                       max_calls=max_calls, category=str(row.get("category", "agent-tools")))


def load_tool_sessions(path: str | Path, *, limit: int | None = None,
                       max_calls: int | None = None) -> list[ToolSession]:
    """Read tool sessions (format in the module docstring).

    Args:
        limit: keep the first ``limit`` sessions (None: all).
        max_calls: replace every session's ``max_calls`` (None: the file's).

    Raises:
        FileNotFoundError: missing file. ValueError: one line naming the file, line (or position) and the
            problem: malformed JSON, a malformed session, repeated ids, no session, a bad limit.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if limit is not None and limit < 1 or max_calls is not None and max_calls < 1:
        raise ValueError("the session limit and the calls per session must be >= 1")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
        items = data.get("sessions") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a list of sessions or an object with a 'sessions' list")
        rows = [(item, f"{path}: session {i}") for i, item in enumerate(items, 1)]
    else:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((json.loads(line), f"{path}:{number}"))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from exc
    sessions = [parse_tool_session(row, where, i) for i, (row, where) in enumerate(rows, 1)][:limit]
    if max_calls is not None:
        sessions = [dataclasses.replace(s, max_calls=max_calls) for s in sessions]
    if not sessions:
        raise ValueError(f"no tool sessions in {path}")
    ids = [s.id for s in sessions]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: session ids repeat: give each session a distinct 'id'")
    return sessions


# ---------------------------------------------------------------------- the loop
def transcript_of(text: str, tool_calls: Sequence[Mapping] | None) -> str:
    """A reply as one comparable string: its content, then each call's name and argument string (ids left
    out: servers draw them at random)."""
    calls = [[c.get("name"), c.get("arguments")] for c in tool_calls or ()]
    return text + ("\n" + json.dumps(calls, ensure_ascii=False) if calls else "")


def replay_tool_session(runner: HttpTurnRunner, method: AgentMethod, session: ToolSession,
                        baseline: dict[tuple[str, int], AgentTurn], on_turn,
                        tool_choice: str | dict = "auto") -> list[AgentTurn]:
    """Run ``session``'s agent loop on ``runner``: call the model with :data:`TOOLS`, run the reply's calls on
    the session's :class:`VirtualRepo`, send the results back, until a reply has no tool calls or
    ``max_calls`` calls were made. Each call is an :class:`~draftwise.agent_bench.AgentTurn` (``tool_calls``,
    ``valid_calls``, ``invalid_calls`` filled) compared with the baseline's same turn by :func:`transcript_of`;
    the signature is :func:`draftwise.agent_bench.run_agent_benchmark`'s ``replay_session`` (bind
    ``tool_choice`` with :func:`functools.partial`).

    Raises:
        AgentBenchError: what the runner raises.
    """
    repo = VirtualRepo(session.files, session.tests)
    messages = session.first_messages()
    extra = {"tools": list(TOOLS), "tool_choice": tool_choice}
    turns: list[AgentTurn] = []
    threads = getattr(runner, "threads", None)
    for index in session.turns:
        with measurement.measure(threads) as measured:
            outcome = runner.run_turn(messages, extra_body=extra)
        sent = [{**c, "id": c.get("id") or f"call_{index}_{n}"} for n, c in enumerate(outcome.tool_calls)]
        calls = [dict(c["function"]) for c in sent]
        results = [repo.call(c["name"], c["arguments"]) for c in calls]
        turn = make_turn(session, index, method, outcome, None, measured.result)
        reference = baseline.get((session.id, index))
        diff = None
        if reference is not None:
            diff = first_difference(transcript_of(outcome.text, calls),
                                    transcript_of(reference.text, reference.tool_calls))
        turn = dataclasses.replace(turn, tool_calls=calls, valid_calls=sum(r.valid for r in results),
                                   invalid_calls=sum(not r.valid for r in results),
                                   identical_to_plain=diff is None, first_difference=diff)
        if reference is not None and diff is not None:
            logger.warning("%s's transcript differs from the baseline's in session %s call %d at character %d",
                           method.label, session.id, index, diff)
        turns.append(turn)
        if on_turn:
            on_turn(turn)
        if not outcome.tool_calls:
            break
        messages.append({"role": "assistant", "content": outcome.text, "tool_calls": sent})
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": result.content}
                     for call, result in zip(sent, results)]
    return turns


# ---------------------------------------------------------------------- summaries
def _acceptance(turns: Sequence[AgentTurn]) -> tuple[float | None, float | None]:
    """(alpha, tau) over ``turns`` from their ``usage.speculative``: alpha = accepted / drafted tokens; tau =
    1 + accepted / target passes, a turn's passes read back from its own tau (``accepted / (tau - 1)``) or,
    with nothing accepted, taken as its output tokens (one token per pass). (None, None) without statistics."""
    with_stats = [t for t in turns if t.stats]
    if not with_stats:
        return None, None
    drafted = sum(t.stats.get("num_draft_tokens", 0) or 0 for t in with_stats)
    accepted = sum(t.stats.get("num_accepted_tokens", 0) or 0 for t in with_stats)
    passes = 0.0
    for turn in with_stats:
        mine, tau = turn.stats.get("num_accepted_tokens", 0) or 0, turn.stats.get("mean_accepted_length") or 1.0
        passes += mine / (tau - 1.0) if mine and tau > 1.0 else max(turn.output_tokens - 1, 0)
    return (accepted / drafted if drafted else None), (1.0 + accepted / passes if passes else 1.0)


def _grammar_seconds(turns: Sequence[AgentTurn]) -> float | None:
    """Summed grammar / processor seconds of ``turns`` (:data:`GRAMMAR_TIME_FIELDS`); None when no turn ran a
    grammar (none reports the field, or every one reports 0: ``tool_choice`` auto)."""
    found = [next((t.stats[f] for f in GRAMMAR_TIME_FIELDS if t.stats.get(f) is not None), None) for t in turns]
    total = sum(float(v) for v in found if v is not None)
    return total if total > 0 else None


def summarize_tool_agent(turns: Sequence[AgentTurn], elapsed: dict[str, float] | None = None) -> list[dict]:
    """:func:`draftwise.agent_bench.summarize_agent`'s rows (wall time, speed-up over the baseline, tokens/s,
    acceptance, measurement doubts) plus, per method: ``tool_turns`` / ``other_turns`` (replies with / without
    tool calls), ``alpha_tool`` / ``tau_tool`` and ``alpha_other`` / ``tau_other`` (:func:`_acceptance`),
    ``calls`` and ``valid_calls``, ``transcript_identical`` (every turn's content and calls equal the
    baseline's, and as many turns), and ``grammar_s_per_token`` (grammar seconds / output tokens; only when
    the server reported them)."""
    rows = summarize_agent(turns, elapsed)
    by_method: dict[str, list[AgentTurn]] = {}
    for turn in turns:
        by_method.setdefault(turn.method, []).append(turn)
    baseline_turns = len(next(iter(by_method.values()))) if by_method else 0
    for row in rows:
        mine = by_method[row["method"]]
        tool = [t for t in mine if t.tool_calls]
        other = [t for t in mine if not t.tool_calls]
        row["alpha_tool"], row["tau_tool"] = _acceptance(tool)
        row["alpha_other"], row["tau_other"] = _acceptance(other)
        row.update(tool_turns=len(tool), other_turns=len(other),
                   calls=sum(t.valid_calls + t.invalid_calls for t in mine),
                   valid_calls=sum(t.valid_calls for t in mine),
                   transcript_identical=len(mine) == baseline_turns and all(t.identical_to_plain for t in mine))
        grammar = _grammar_seconds(mine)
        if grammar is not None:
            row["grammar_s_per_token"] = grammar / row["output_tokens"] if row["output_tokens"] else None
    return rows


# ---------------------------------------------------------------------- the real server, in process
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def served_app(app, start_timeout_s: float = 120.0) -> Iterator[str]:
    """Serve the FastAPI ``app`` (:func:`draftwise.server.create_app`) with uvicorn
    (:func:`draftwise.server.serving.make_server`) on a free loopback port in a background thread; yields its
    base URL (``http://127.0.0.1:PORT``) and stops the server on exit.

    Raises:
        AgentBenchError: the server did not start within ``start_timeout_s`` seconds.
    """
    from draftwise.server.serving import make_server

    server = make_server(app, port=_free_port(), log_level="warning")
    thread = threading.Thread(target=server.run, name="bench-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise AgentBenchError("the in-process server did not start (see the log above)")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(60)


def served_method(label: str, kind: str, k: int | None, build_bundle: Callable[[], object], settings, params, *,
                  timeout_s: float = 600.0) -> AgentMethod:
    """A method served by the real draftwise app in this process: opening it builds the engine bundle
    (``build_bundle()``, e.g. :func:`draftwise.builder.build_engine` as ``draftwise serve`` calls it), starts
    :func:`draftwise.server.create_app` on it with ``settings`` (a
    :class:`~draftwise.server.settings.ServerSettings`) on loopback (:func:`served_app`), and yields an
    :class:`~draftwise.agent_bench.HttpTurnRunner` on it with ``params``; closing it stops the server."""
    from draftwise.server import create_app

    @contextmanager
    def open_runner():
        app = create_app(build_bundle(), settings)
        with served_app(app) as url, HttpTurnRunner(url, params, timeout_s=timeout_s) as runner:
            yield runner

    return AgentMethod(label, open_runner, kind, k, concurrent=False)
