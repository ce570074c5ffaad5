"""Agent-loop benchmark: multi-turn coding sessions replayed turn by turn (issue 13, item 5).

A *session* is a chat: an optional system prompt and a list of user turns. Turn ``t`` sends the whole
conversation so far: the system prompt, user turns ``0..t`` and the model's OWN answers to turns ``0..t-1``
from the same run. The prompt grows every turn, and the follow-ups ask the model to re-emit or edit code it
has already written (add type hints, rename, fix a failing test shown in the prompt, write tests, apply a small
change to a given file): the agentic-coding pattern that prefix (KV) caching and n-gram / suffix speculation
exploit. Every method replays the same sessions; an exact method gives the same answers as plain decoding, so
it also sees the same prompts, and its outputs are compared with plain decoding's turn by turn.

Two ways to run a method:

- in process (:class:`EngineTurnRunner`): a draftwise engine, the prompt built with the model's chat template;
- over HTTP (:class:`HttpTurnRunner`) against any OpenAI-compatible server (draftwise, vLLM, llama-server):
  ``POST /v1/chat/completions`` with ``stream=True`` and ``stream_options.include_usage``.

Measured per turn, from the caller's side in both modes (definitions as vLLM's
``benchmarks/benchmark_serving.py``):

- *time to first token* (TTFT): seconds from the start of the request (prompt templating included) to the
  first non-empty piece of output;
- *decode tokens/s*: ``(output tokens - 1) / (wall time - TTFT)``, i.e. ``1 / TPOT``;
- *wall time*: seconds from the start of the request to its last byte;
- prompt tokens and *cached* prompt tokens (served from a prefix cache): OpenAI's
  ``usage.prompt_tokens_details.cached_tokens`` over HTTP (None when the server does not report it), the
  engine's ``stats.num_cached_prompt_tokens`` in process.

Sessions file format (``.jsonl``: one session object per line; ``.json``: a list of session objects or
``{"sessions": [...]}``)::

    {"id": "top-words",                 # optional (default: the line or list position, from 1)
     "category": "agent-coding",        # optional (default "agent")
     "system": "You are ...",           # optional system prompt
     "turns": ["Write ...", "Add type hints ...", ...]}   # the user turns, at least one, non-empty strings

``data/agent_sessions.jsonl`` ships four 4-turn coding sessions in this format; :func:`sessions_from_prompts`
builds sessions from Spec-Bench coding questions (their own turns, then :data:`FOLLOW_UPS`).

Trust (:mod:`draftwise.speculation.measurement`): every turn records its wall time, the process's CPU time (in process,
against the threads the engine may use) and the load average; the command repeats the baseline after the other
methods (:func:`draftwise.speculation.measurement.with_baseline_repeat`), speed-ups are over the mean of its passes, and
each summary row carries the doubts of its figures (baseline moved, machine busy) as ``warnings``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from draftwise.speculation import measurement
from draftwise.benchmark import BenchPrompt, environment, first_difference
from draftwise.config import SamplingParams
from draftwise.files import write_json_atomic
from draftwise.stats import total_hybrid_steps

__all__ = ["AgentSession", "TurnOutcome", "AgentTurn", "TurnRunner", "AgentMethod", "AgentBenchError",
           "FOLLOW_UPS", "DEFAULT_SYSTEM_PROMPT", "default_sessions_path", "shipped_sessions_path", "load_sessions", "sessions_from_prompts",
           "decode_tokens_per_s", "EngineTurnRunner", "make_turn", "HttpTurnRunner", "openai_base_url",
           "run_agent_benchmark",
           "session_totals", "summarize_agent", "write_agent_json", "agent_doubts"]

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = ("You are a careful Python coding assistant working inside a code editor. When you change "
                         "code, show the complete updated code in one fenced code block, then at most two sentences "
                         "of explanation.")

#: Follow-up turns added after a Spec-Bench question's own turns: each makes the model re-emit or edit the
#: code it wrote (type hints, a rename, a failing test to fix, tests to write, a small change to a given file).
FOLLOW_UPS: tuple[str, ...] = (
    "Add type hints and docstrings to every function in your code and show the complete code again.",
    "Rename the main function of your code to `solve` (update every call to it) and show the complete code.",
    "Running the tests gives this failure:\n```\n___________ test_empty_input ___________\n>       assert "
    "solve([]) == []\nE       IndexError: list index out of range\n```\nMake the code handle an empty input and "
    "show the complete corrected code.",
    "Write pytest tests for your code, covering normal cases and edge cases.",
    "Here is `utils.py`:\n```python\ndef read_lines(path):\n    with open(path) as handle:\n        return "
    "[line.rstrip('\\n') for line in handle]\n\n\ndef write_lines(path, lines):\n    with open(path, 'w') as "
    "handle:\n        for line in lines:\n            handle.write(line + '\\n')\n```\nGive both functions an "
    "`encoding='utf-8'` argument passed to `open`, change nothing else, and show the whole file.",
)


class AgentBenchError(RuntimeError):
    """A server answered a turn with an error, or its stream could not be read; the message says which."""


@dataclass(frozen=True)
class AgentSession:
    """One multi-turn session.

    Attributes:
        id: unique name in tables and JSON.
        turns: the user messages, in order (at least one).
        system: the system prompt, or None.
        category: a label for grouping.
    """

    id: str
    turns: tuple[str, ...]
    system: str | None = None
    category: str = "agent"

    def messages(self, turn: int, answers: Sequence[str]) -> list[dict[str, str]]:
        """The chat messages of turn ``turn``: system prompt, earlier user turns each followed by the model's
        answer ``answers[i]``, then user turn ``turn``.

        Raises:
            ValueError: fewer than ``turn`` answers, or ``turn`` outside the session.
        """
        if not 0 <= turn < len(self.turns) or len(answers) < turn:
            raise ValueError(f"session {self.id}: turn {turn} needs {turn} earlier answers, got {len(answers)}")
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn):
            messages += [{"role": "user", "content": self.turns[i]}, {"role": "assistant", "content": answers[i]}]
        messages.append({"role": "user", "content": self.turns[turn]})
        return messages


def shipped_sessions_path(name: str, what: str) -> Path:
    """``data/<name>`` of the source checkout (a default ``--sessions`` file); ``what`` names it in the error.

    Raises:
        FileNotFoundError: when it is not there (an installed, non-editable copy): pass a sessions file.
    """
    path = Path(__file__).resolve().parents[2] / "data" / name
    if not path.is_file():
        raise FileNotFoundError(f"default {what} not found at {path}; pass --sessions FILE")
    return path


def default_sessions_path() -> Path:
    """``data/agent_sessions.jsonl`` of the source checkout (the default ``--sessions``; see
    :func:`shipped_sessions_path`)."""
    return shipped_sessions_path("agent_sessions.jsonl", "agent sessions")


def _parse_session(row: object, where: str, position: int) -> AgentSession:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a session object with a 'turns' list")
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"{where}: 'system' must be a string")
    identifier = row.get("id", row.get("question_id", position))
    return AgentSession(id=str(identifier), turns=tuple(turns), system=system or None,
                        category=str(row.get("category", "agent")))


def load_sessions(path: str | Path, *, limit: int | None = None, max_turns: int | None = None) -> list[AgentSession]:
    """Read sessions from a ``.jsonl`` file (one object per line) or a ``.json`` file (a list, or an object
    with a ``sessions`` list); the format is in the module docstring.

    Args:
        limit: keep the first ``limit`` sessions (None: all).
        max_turns: keep each session's first ``max_turns`` turns (None: all).

    Raises:
        FileNotFoundError: missing file. ValueError: malformed JSON, a malformed session, repeated ids, or no
            session at all.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    rows: list[tuple[object, str]] = []
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
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((json.loads(line), f"{path}:{number}"))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON: {exc}") from exc
    sessions = [_parse_session(row, where, i) for i, (row, where) in enumerate(rows, 1)]
    return _select(sessions, limit, max_turns, str(path))


def sessions_from_prompts(prompts: Sequence[BenchPrompt], *, num_turns: int = 4,
                          system: str | None = DEFAULT_SYSTEM_PROMPT) -> list[AgentSession]:
    """Sessions built from benchmark questions (Spec-Bench coding): each question's own turns, then
    :data:`FOLLOW_UPS` in order, cut to ``num_turns`` turns.

    Raises:
        ValueError: ``num_turns`` < 1 or more than the turns available, or no prompts.
    """
    if num_turns < 1:
        raise ValueError(f"an agent session needs at least one turn, got {num_turns}")
    sessions = []
    for prompt in prompts:
        turns = (tuple(prompt.turns) + FOLLOW_UPS)[:num_turns]
        if len(turns) < num_turns:
            raise ValueError(f"question {prompt.id} has {len(turns)} turns with the follow-ups; at most "
                             f"{len(turns)} per session")
        sessions.append(AgentSession(id=prompt.id, turns=turns, system=system, category=prompt.category))
    return _select(sessions, None, None, "the prompts")


def _select(sessions: list[AgentSession], limit: int | None, max_turns: int | None, where: str) -> list[AgentSession]:
    if limit is not None and limit < 1 or max_turns is not None and max_turns < 1:
        raise ValueError("the session limit and the turns per session must be >= 1")
    sessions = sessions[:limit]
    if max_turns is not None:
        sessions = [AgentSession(s.id, s.turns[:max_turns], s.system, s.category) for s in sessions]
    if not sessions:
        raise ValueError(f"no agent sessions in {where}")
    ids = [s.id for s in sessions]
    if len(set(ids)) != len(ids):
        raise ValueError(f"session ids repeat in {where}: give each session a distinct 'id'")
    return sessions


# ---------------------------------------------------------------------- measurements
def decode_tokens_per_s(output_tokens: int, ttft_s: float | None, wall_s: float) -> float | None:
    """Tokens after the first per second after the first: ``(output_tokens - 1) / (wall_s - ttft_s)`` (vLLM's
    ``1 / TPOT``). None when it is undefined (fewer than two tokens, no first token, no time after it)."""
    if ttft_s is None or output_tokens < 2 or wall_s <= ttft_s:
        return None
    return (output_tokens - 1) / (wall_s - ttft_s)


@dataclass(frozen=True)
class TurnOutcome:
    """What a runner measured for one turn (times in seconds from the start of the request).

    Attributes:
        text: the answer.
        output_tokens: generated tokens (the server's ``usage.completion_tokens`` over HTTP; the number of
            content chunks when a server reports no usage).
        prompt_tokens: tokens of the templated conversation (None: the server did not say).
        cached_tokens: prompt tokens served from a prefix cache (None: the server did not say).
        ttft_s: time to the first non-empty output (None: nothing was generated).
        wall_s: time to the end of the answer.
        finish_reason: ``"stop"``, ``"length"``...
        token_ids: the generated ids (in process only).
        stats: the engine's statistics (in process) or the usage's ``speculative`` object (draftwise server).
        tool_calls: the reply's tool calls (over HTTP), each ``{"id", "type": "function", "function": {"name",
            "arguments"}}`` with ``arguments`` the JSON string the server sent; empty for a reply without any.
    """

    text: str
    output_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_s: float | None
    wall_s: float
    finish_reason: str
    token_ids: tuple[int, ...] | None = None
    stats: dict = field(default_factory=dict)
    tool_calls: tuple[dict, ...] = ()


#: The untimed request each method serves before its sessions (first-call costs: allocations, lazy set-up).
WARM_UP_MESSAGES = ({"role": "user", "content": "Say hello."},)
WARM_UP_TOKENS = 4


class TurnRunner(Protocol):
    """Runs one turn: ``messages`` (OpenAI chat messages) -> :class:`TurnOutcome`. Thread-safe when its method
    says ``concurrent``. ``warm_up`` serves one short untimed request. A runner whose server keeps a prefix cache
    across methods may also have ``use_cache_scope(scope: str)`` (see :func:`run_agent_benchmark`)."""

    def run_turn(self, messages: list[dict[str, str]]) -> TurnOutcome: ...

    def warm_up(self) -> None: ...


@dataclass
class AgentMethod:
    """A named configuration to replay the sessions with.

    Attributes:
        label: unique name in tables and JSON (``"plain"``, ``"ngram K=4"``, a server's label).
        open: a context manager factory that yields the :class:`TurnRunner` (it may load models and must
            release them on exit).
        kind: ``"plain"``, a speculative method name, or ``"server"``.
        k: K, or None.
        concurrent: whether several sessions may run at once on this runner (HTTP: yes; one in-process
            engine serves one request at a time: no).
        repeat_of: for the baseline's second pass, the baseline's label (else None).
    """

    label: str
    open: Callable[[], AbstractContextManager[TurnRunner]]
    kind: str = "plain"
    k: int | None = None
    concurrent: bool = False
    repeat_of: str | None = None


@dataclass
class AgentTurn:
    """One method on one turn of one session (a JSON row; times in seconds).

    The measured fields are :class:`TurnOutcome`'s; ``decode_tokens_per_s`` is :func:`decode_tokens_per_s` of
    them; ``identical_to_plain``: the output equals the baseline method's on the same session and turn (token
    ids in process, text over HTTP); ``first_difference``: the first differing token (or character) index;
    ``measurement``: the turn's :class:`draftwise.speculation.measurement.Measurement` as a dict (CPU figures in process
    only); ``warnings``: its own doubts (machine busy); ``repeat_of``: the baseline's label on its second pass.
    The tool-using workload (:mod:`draftwise.tool_agent_bench`) also fills ``tool_calls`` (the reply's calls as
    ``{"name", "arguments"}``, ids left out: a server draws them at random) and ``valid_calls`` /
    ``invalid_calls`` (calls the session's tools could run / could not); ``identical_to_plain`` then compares
    the whole reply, content and calls.
    """

    session_id: str
    category: str
    turn: int
    method: str
    kind: str
    k: int | None
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int
    ttft_s: float | None
    decode_tokens_per_s: float | None
    wall_s: float
    finish_reason: str
    identical_to_plain: bool
    first_difference: int | None
    text: str
    token_ids: list[int] | None = None
    stats: dict = field(default_factory=dict)
    measurement: dict = field(default_factory=dict)
    warnings: list[dict] = field(default_factory=list)
    repeat_of: str | None = None
    tool_calls: list[dict] | None = None
    valid_calls: int = 0
    invalid_calls: int = 0


# ---------------------------------------------------------------------- runners
class EngineTurnRunner:
    """Runs turns on an in-process draftwise engine: the chat template (the model's, or ``chat_template``)
    turns the messages into ids, :meth:`SpeculativeEngine.stream` generates, and TTFT is the time to the first
    committed chunk. ``threads``: the threads its target's passes may use (for the turns' CPU share).

    Args:
        bundle: an :class:`draftwise.builder.EngineBundle` (target model and engine).
        params: sampling parameters for every turn.
        chat_template: a Jinja chat template replacing the tokenizer's (for models without one), or None.

    Raises:
        ValueError: the model has no chat template and none was given.
    """

    def __init__(self, bundle, params: SamplingParams, chat_template: str | None = None) -> None:
        from draftwise.server.text import TextCodec

        self._engine = bundle.engine
        self._target = bundle.target
        self._params = params
        self._codec = TextCodec(bundle.target, chat_template)
        self.threads = measurement.backend_threads(bundle.target.backend)
        if not self._codec.has_chat_template:
            raise ValueError(f"{bundle.target.name} has no chat template; pass one with --chat-template FILE")

    def warm_up(self) -> None:
        """Generate a few tokens for :data:`WARM_UP_MESSAGES`, untimed."""
        params = dataclasses.replace(self._params, max_tokens=min(WARM_UP_TOKENS, self._params.max_tokens))
        self._engine.generate(self._codec.encode_chat(list(WARM_UP_MESSAGES)), params)

    def run_turn(self, messages: list[dict[str, str]]) -> TurnOutcome:
        """Template, generate and time one turn. Raises what the engine raises (e.g. a context overflow)."""
        start = time.perf_counter()
        prompt_ids = self._codec.encode_chat(messages)
        generation = self._engine.stream(prompt_ids, self._params)
        ttft = None
        for chunk in generation:
            if chunk and ttft is None:
                ttft = time.perf_counter() - start
        wall = time.perf_counter() - start
        result = generation.result
        return TurnOutcome(
            text=self._target.decode(result.token_ids), output_tokens=len(result.token_ids),
            prompt_tokens=len(prompt_ids), cached_tokens=int(getattr(result.stats, "num_cached_prompt_tokens", 0)),
            ttft_s=ttft, wall_s=wall, finish_reason=result.finish_reason, token_ids=tuple(result.token_ids),
            stats=result.stats.to_dict())


def openai_base_url(url: str) -> str:
    """``http://host:port``, ``.../v1`` or ``.../v1/`` -> ``.../v1`` (where ``/chat/completions`` lives).

    Raises:
        ValueError: not an http(s) URL.
    """
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"not an http(s) URL: {url!r}")
    return base if base.endswith("/v1") else base + "/v1"


class HttpTurnRunner:
    """Runs turns against an OpenAI-compatible server: a streamed ``/v1/chat/completions`` request with
    ``stream_options.include_usage``; TTFT is the arrival of the first chunk with non-empty content.
    ``threads`` is None: the work runs in the server, so this process's CPU share says nothing about it.

    Args:
        url: the server (``http://host:port`` or ``.../v1``).
        params: sampling parameters; ``top_k`` (when set) and ``ignore_eos`` (when true) are sent as vLLM's
            extra fields, ``seed`` when set.
        model: the model name to send; None asks ``GET /v1/models`` for the first one.
        api_key: sent as ``Authorization: Bearer``.
        timeout_s: per-request read timeout.
        client: an ``httpx.Client`` to use (tests); default: one owned by this runner (:meth:`close`).

    Raises:
        AgentBenchError: the model list cannot be read.
    """

    def __init__(self, url: str, params: SamplingParams, *, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, client=None, max_connections: int = 16) -> None:
        import httpx

        self.base_url = openai_base_url(url)
        self.threads = None
        self._params = params
        self.user: str | None = None  # the requests' "user" field: the server's prefix-cache scope
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_client = client is None
        self._client = client or httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=30.0), headers=headers,
            limits=httpx.Limits(max_connections=max_connections))
        self.model = model or self._first_model()

    def close(self) -> None:
        """Close the HTTP client this runner created."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> HttpTurnRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def use_cache_scope(self, scope: str) -> None:
        """Send ``scope`` as every request's ``user`` field, which draftwise's server (and vLLM-style servers
        that scope their caches by user) keeps prefix-cache entries apart by: a pass in its own scope reuses
        its own earlier turns, never another pass's (a baseline's repeat would otherwise find every prompt
        cached by its first pass)."""
        self.user = scope

    def _first_model(self) -> str:
        import httpx

        try:
            response = self._client.get(f"{self.base_url}/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise AgentBenchError(f"cannot list the models of {self.base_url} ({exc}); pass --model-name") from exc

    def request_body(self, messages: list[dict], params: SamplingParams | None = None,
                     extra_body: dict | None = None) -> dict:
        """The JSON body sent for ``messages`` (with ``params``, default the runner's), with ``extra_body``'s
        fields (e.g. ``tools``, ``tool_choice``) added."""
        params = params or self._params
        body = {"model": self.model, "messages": messages, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "stream": True,
                "stream_options": {"include_usage": True}}
        if params.seed is not None:
            body["seed"] = params.seed
        if params.top_k:
            body["top_k"] = params.top_k
        if params.ignore_eos:
            body["ignore_eos"] = True
        if self.user is not None:
            body["user"] = self.user
        return {**body, **(extra_body or {})}

    def warm_up(self) -> None:
        """Send :data:`WARM_UP_MESSAGES` for a few tokens, untimed. Raises as :meth:`run_turn`."""
        params = dataclasses.replace(self._params, max_tokens=min(WARM_UP_TOKENS, self._params.max_tokens))
        self.run_turn(list(WARM_UP_MESSAGES), params)

    def run_turn(self, messages: list[dict], params: SamplingParams | None = None, *,
                 extra_body: dict | None = None) -> TurnOutcome:
        """Send one streamed request (``params``: default the runner's; ``extra_body``: fields added to the body,
        see :meth:`request_body`) and time it. Streamed tool-call deltas are put together by their ``index``
        into :attr:`TurnOutcome.tool_calls`; the first content or tool-call delta ends the TTFT.

        Raises:
            AgentBenchError: an HTTP error status (with the server's message), a connection failure, an error
                event in the stream, or a malformed event.
        """
        import httpx

        url = f"{self.base_url}/chat/completions"
        start = time.perf_counter()
        try:
            with self._client.stream("POST", url, json=self.request_body(messages, params, extra_body)) as response:
                if response.status_code >= 400:
                    response.read()
                    raise AgentBenchError(f"{url}: HTTP {response.status_code}: {_error_message(response)}")
                return self._read_stream(response.iter_lines(), start)
        except httpx.HTTPError as exc:
            raise AgentBenchError(f"{url}: {type(exc).__name__}: {exc}") from exc

    def _read_stream(self, lines: Iterator[str], start: float) -> TurnOutcome:
        pieces: list[str] = []
        calls: dict[int, dict] = {}
        ttft = None
        usage: dict = {}
        finish_reason = ""
        for event in _sse_events(lines):
            if "error" in event:
                raise AgentBenchError(f"{self.base_url}: error event in the stream: {event['error']}")
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                content = delta.get("content") or ""
                if content or delta.get("tool_calls"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                if content:
                    pieces.append(content)
                for call in delta.get("tool_calls") or ():
                    _add_tool_call_delta(calls, call)
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = event.get("usage") or usage
        wall = time.perf_counter() - start
        details = usage.get("prompt_tokens_details") or {}
        return TurnOutcome(
            text="".join(pieces), output_tokens=int(usage.get("completion_tokens", len(pieces))),
            prompt_tokens=usage.get("prompt_tokens"), cached_tokens=details.get("cached_tokens"), ttft_s=ttft,
            wall_s=wall, finish_reason=finish_reason, stats=dict(usage.get("speculative") or {}),
            tool_calls=tuple(calls[index] for index in sorted(calls)))


def _add_tool_call_delta(calls: dict[int, dict], delta: dict) -> None:
    """Fold one streamed tool-call delta (OpenAI's ``{"index", "id"?, "function": {"name"?, "arguments"?}}``)
    into ``calls`` (index -> ``{"id", "type", "function": {"name", "arguments"}}``): the id and name are set
    once, argument fragments appended in order.

    Raises:
        AgentBenchError: a delta without an integer ``index``.
    """
    index = delta.get("index")
    if not isinstance(index, int):
        raise AgentBenchError(f"malformed tool-call delta (no integer index): {str(delta)[:200]}")
    call = calls.setdefault(index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
    function = delta.get("function") or {}
    call["id"] = call["id"] or delta.get("id")
    call["function"]["name"] = call["function"]["name"] or function.get("name")
    call["function"]["arguments"] += function.get("arguments") or ""


def _sse_events(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON objects of a server-sent-events stream's ``data:`` lines, up to ``data: [DONE]``.

    Raises:
        AgentBenchError: a data line that is not a JSON object.
    """
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            event = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise AgentBenchError(f"malformed stream event {payload[:200]!r}: {exc}") from exc
        if not isinstance(event, dict):
            raise AgentBenchError(f"malformed stream event {payload[:200]!r}")
        yield event


def _error_message(response) -> str:
    try:
        error = response.json().get("error")
        return str(error.get("message", error)) if isinstance(error, dict) else str(error or response.text[:500])
    except ValueError:
        return response.text[:500]


# ---------------------------------------------------------------------- the replay
def run_agent_benchmark(
    methods: Sequence[AgentMethod],
    sessions: Sequence[AgentSession],
    *,
    concurrency: int = 1,
    on_turn: Callable[[AgentTurn], None] | None = None,
    replay_session: Callable[..., list[AgentTurn]] | None = None,
) -> tuple[list[AgentTurn], dict[str, float]]:
    """Replay every session with every method, one method after the other; ``methods[0]`` is the baseline
    (plain decoding, or the server without speculation) that every output is compared with.

    Each method is opened (models loaded, a client connected), gets its own prefix-cache scope on a server
    (``use_cache_scope``, where the runner has it: a fresh id of this run and the method's label, so that no pass
    reuses another pass's or an earlier run's cached prompts), serves one short untimed warm-up request,
    replays all sessions (``concurrency`` at a time when the method allows it, else one at a time), and is
    closed before the next method opens, so only one method's models are in memory at once.

    Args:
        concurrency: sessions in flight at once (>= 1).
        on_turn: called after each turn (from worker threads when concurrent).
        replay_session: ``(runner, method, session, baseline, on_turn) -> [AgentTurn]``, how one session is
            replayed (default: the user turns of an :class:`AgentSession` one after the other; the tool-using
            workload passes :func:`draftwise.tool_agent_bench.replay_tool_session`).

    Returns:
        (all turns, ordered by method, session and turn, each marked identical or not to the baseline's same
        turn: token ids when both have them, else text; the elapsed seconds of each method's replay, model
        loading and the warm-up request excluded).

    Raises:
        ValueError: no methods, repeated labels, no sessions or ``concurrency`` < 1.
        AgentBenchError, and whatever a runner raises.
    """
    labels = [m.label for m in methods]
    if not methods or len(set(labels)) != len(labels):
        raise ValueError(f"need at least one method and distinct labels, got {labels}")
    if not sessions or concurrency < 1:
        raise ValueError("need at least one session and concurrency >= 1")
    turns: list[AgentTurn] = []
    elapsed: dict[str, float] = {}
    baseline: dict[tuple[str, int], AgentTurn] = {}
    run_id = uuid.uuid4().hex[:8]
    for method in methods:
        mine, elapsed[method.label] = _replay_method(method, sessions, concurrency if method.concurrent else 1,
                                                     baseline, on_turn, f"draftwise-bench-{run_id}-{method.label}",
                                                     replay_session or _replay_session)
        gc.collect()  # the method's runner (and its models) went out of scope: free them before the next loads
        if not baseline:
            baseline = {(t.session_id, t.turn): t for t in mine}
        turns.extend(mine)
    return turns, elapsed


def _replay_method(method: AgentMethod, sessions: Sequence, workers: int, baseline: dict[tuple[str, int], AgentTurn],
                   on_turn, scope: str, replay_session) -> tuple[list[AgentTurn], float]:
    """Open the method, give it the prefix-cache ``scope`` (runners that have one), warm it up, replay every
    session; returns the turns and the replay's seconds (opening and warm-up excluded)."""
    with method.open() as runner:
        use_cache_scope = getattr(runner, "use_cache_scope", None)
        if use_cache_scope is not None:
            use_cache_scope(scope)
        runner.warm_up()
        start = time.perf_counter()
        if workers == 1:
            per_session = [replay_session(runner, method, s, baseline, on_turn) for s in sessions]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent-session") as pool:
                futures = [pool.submit(replay_session, runner, method, s, baseline, on_turn) for s in sessions]
                try:
                    per_session = [f.result() for f in futures]
                except BaseException:
                    for future in futures:
                        future.cancel()
                    raise
        elapsed = time.perf_counter() - start
    return [turn for session_turns in per_session for turn in session_turns], elapsed


def _replay_session(runner: TurnRunner, method: AgentMethod, session: AgentSession,
                    baseline: dict[tuple[str, int], AgentTurn], on_turn) -> list[AgentTurn]:
    answers: list[str] = []
    turns = []
    threads = getattr(runner, "threads", None)
    for index in range(len(session.turns)):
        with measurement.measure(threads) as measured:
            outcome = runner.run_turn(session.messages(index, answers))
        answers.append(outcome.text)
        turn = make_turn(session, index, method, outcome, baseline.get((session.id, index)), measured.result)
        if not turn.identical_to_plain:
            logger.warning("%s differs from the baseline in session %s turn %d at %s %s", method.label, session.id,
                           index, "token" if turn.token_ids is not None else "character", turn.first_difference)
        turns.append(turn)
        if on_turn:
            on_turn(turn)
    return turns


def make_turn(session, index: int, method: AgentMethod, outcome: TurnOutcome,
              reference: AgentTurn | None, measured: measurement.Measurement | None = None) -> AgentTurn:
    """The :class:`AgentTurn` row of ``outcome``, turn ``index`` of ``session`` (anything with ``id`` and
    ``category``) under ``method``, compared with the baseline's ``reference`` turn (None: not compared, as the
    baseline's own turns are) by token ids when both have them, else by text."""
    diff = None
    if reference is not None:
        if outcome.token_ids is not None and reference.token_ids is not None:
            diff = first_difference(outcome.token_ids, reference.token_ids)
        else:
            diff = first_difference(outcome.text, reference.text)
    return AgentTurn(
        session_id=session.id, category=session.category, turn=index, method=method.label, kind=method.kind,
        k=method.k, prompt_tokens=outcome.prompt_tokens, cached_tokens=outcome.cached_tokens,
        output_tokens=outcome.output_tokens, ttft_s=outcome.ttft_s,
        decode_tokens_per_s=decode_tokens_per_s(outcome.output_tokens, outcome.ttft_s, outcome.wall_s),
        wall_s=outcome.wall_s, finish_reason=outcome.finish_reason, identical_to_plain=diff is None,
        first_difference=diff, text=outcome.text,
        token_ids=None if outcome.token_ids is None else list(outcome.token_ids), stats=dict(outcome.stats),
        measurement=measured.to_dict() if measured else {},
        warnings=[d.to_dict() for d in [measurement.machine_busy(measured)] if d], repeat_of=method.repeat_of)


# ---------------------------------------------------------------------- summaries
def _totals(turns: Sequence[AgentTurn]) -> dict:
    """Sums and means over a group of turns (one session, or all of a method's)."""
    wall = sum(t.wall_s for t in turns)
    ttfts = [t.ttft_s for t in turns if t.ttft_s is not None]
    later = [t.ttft_s for t in turns if t.turn > 0 and t.ttft_s is not None]
    first = [t.ttft_s for t in turns if t.turn == 0 and t.ttft_s is not None]
    output = sum(t.output_tokens for t in turns)
    decode_tokens = sum(max(0, t.output_tokens - 1) for t in turns if t.ttft_s is not None)
    decode_time = sum(t.wall_s - t.ttft_s for t in turns if t.ttft_s is not None)
    prompt = [t.prompt_tokens for t in turns if t.prompt_tokens is not None]
    cached = [t.cached_tokens for t in turns if t.cached_tokens is not None]
    drafted = sum(t.stats.get("num_draft_tokens", 0) or 0 for t in turns)
    accepted = sum(t.stats.get("num_accepted_tokens", 0) or 0 for t in turns)
    return {
        "turns": len(turns), "prompt_tokens": sum(prompt) if prompt else None,
        "max_prompt_tokens": max(prompt) if prompt else None,
        "cached_tokens": sum(cached) if cached else None,
        "cached_share": sum(cached) / sum(prompt) if cached and prompt and sum(prompt) else None,
        "output_tokens": output, "wall_s": wall, "tokens_per_s": output / wall if wall > 0 else 0.0,
        "ttft_s": sum(ttfts), "ttft_first_turn_mean_s": statistics.fmean(first) if first else None,
        "ttft_later_turns_mean_s": statistics.fmean(later) if later else None,
        "ttft_later_turns_max_s": max(later) if later else None,
        "decode_tokens_per_s": decode_tokens / decode_time if decode_time > 0 else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "hybrid_steps": total_hybrid_steps(t.stats.get("hybrid_steps") for t in turns),
        "identical": sum(t.identical_to_plain for t in turns),
    }


def session_totals(turns: Sequence[AgentTurn]) -> list[dict]:
    """Per method and session: prompt, cached and output tokens, wall time, TTFT (sum; first turn; mean and
    max of later turns), decode tokens/s, acceptance, identical turns, and ``speedup`` = the baseline's mean
    wall time over its passes on the same session / this method's (the first method in ``turns`` is the
    baseline, the methods with its ``repeat_of`` its later passes)."""
    groups: dict[tuple[str, str], list[AgentTurn]] = {}
    for turn in turns:
        groups.setdefault((turn.method, turn.session_id), []).append(turn)
    base_labels = measurement.baseline_labels(turns)
    rows = []
    for (method, session_id), mine in groups.items():
        row = {"method": method, "session_id": session_id, "category": mine[0].category, **_totals(mine)}
        walls = [sum(t.wall_s for t in groups[(label, session_id)]) for label in base_labels
                 if (label, session_id) in groups]
        row["speedup"] = statistics.fmean(walls) / row["wall_s"] if walls and row["wall_s"] > 0 else None
        rows.append(row)
    return rows


def summarize_agent(turns: Sequence[AgentTurn], elapsed: dict[str, float] | None = None) -> list[dict]:
    """Per method over all sessions: the :func:`session_totals` quantities plus ``speedup`` (the baseline's
    summed session wall time, the mean over its passes, / this method's), ``elapsed_s`` (the replay's real
    time; below the summed wall time when sessions ran concurrently), ``speedup_elapsed``, the baseline passes'
    wall times (``baseline_pass_s``) and spread, the row's combined ``measurement`` and its ``warnings``
    (:func:`draftwise.speculation.measurement.comparison_doubts`: baseline moved, machine busy)."""
    groups: dict[str, list[AgentTurn]] = {}
    for turn in turns:
        groups.setdefault(turn.method, []).append(turn)
    elapsed = elapsed or {}
    rows = []
    base_labels = [label for label in measurement.baseline_labels(turns) if label in groups]
    pass_walls = [sum(t.wall_s for t in groups[label]) for label in base_labels]
    base_wall = statistics.fmean(pass_walls) if pass_walls else 0.0
    pass_elapsed = [elapsed[label] for label in base_labels if elapsed.get(label)]
    base_elapsed = statistics.fmean(pass_elapsed) if pass_elapsed else None
    passes = [(label, wall, _measurements(groups[label])) for label, wall in zip(base_labels, pass_walls)]
    for label, mine in groups.items():
        row = {"method": label, "kind": mine[0].kind, "k": mine[0].k,
               "sessions": len({t.session_id for t in mine}), **_totals(mine)}
        row["speedup"] = base_wall / row["wall_s"] if row["wall_s"] > 0 else None
        row["elapsed_s"] = own = elapsed.get(label)
        row["speedup_elapsed"] = base_elapsed / own if base_elapsed and own else None
        combined = measurement.combine(_measurements(mine))
        row.update(baseline_pass_s=pass_walls, baseline_spread=measurement.relative_spread(pass_walls),
                   measurement=combined.to_dict() if combined else {},
                   warnings=[d.to_dict() for d in measurement.comparison_doubts(
                       label, _measurements(mine), passes, is_baseline=label in base_labels)])
        rows.append(row)
    return rows


def _measurements(turns: Sequence[AgentTurn]) -> list[measurement.Measurement | None]:
    return [measurement.Measurement.from_dict(t.measurement) for t in turns]


def agent_doubts(summary: Sequence[dict]) -> list[tuple[str, dict]]:
    """``(method, doubt dict)`` for every doubt of :func:`summarize_agent` rows, in table order."""
    return [(row["method"], d) for row in summary for d in row.get("warnings", [])]


def write_agent_json(path: str | Path, config: dict, turns: Sequence[AgentTurn], summary: list[dict],
                     sessions: list[dict], workload: str = "agent") -> Path:
    """Write the configuration, environment, per-method summary, per-session totals and every turn to ``path``
    atomically (parents created), with the combined measurement of all turns (``measurement``) and every doubt
    of the summary rows (``warnings``: ``{"row", "code", "reason", "detail"}``); ``workload`` names the
    workload (``"agent"``, ``"agent-tools"``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    combined = measurement.combine(_measurements(turns))
    payload = {"workload": workload, "config": config, "environment": environment(), "complete": True,
               "measurement": combined.to_dict() if combined else {},
               "warnings": [{"row": what, **d} for what, d in agent_doubts(summary)],
               "summary": summary, "sessions": sessions, "turns": [asdict(t) for t in turns]}
    return write_json_atomic(path, payload, indent=1)
