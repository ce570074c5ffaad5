"""Tool calls in a model's reply: the finished reply's calls (:meth:`ToolParser.extract`) and the OpenAI chat
deltas that stream them (:class:`ToolCallStream`), from one reading of the text per format.

Each format (:mod:`~draftwise.server.tool_parsers.hermes`, ``llama3``, ``mistral``) implements only
:meth:`ToolParser.scan`: the text so far cut into pieces, in order, of content (:class:`TextPiece`), calls
(:class:`CallPiece`) and, at the end, text whose fate is not known yet (:class:`HeldPiece`: a partial call
marker, a call whose name is not complete). Both the finished-reply path and the streaming path read those
pieces, so they agree by construction. As vLLM's tool parsers do (``vllm/entrypoints/openai/tool_parsers/``),
the stream re-reads the whole accumulated text on every chunk, which suits speculative decoding, where one
chunk holds several tokens.

Rules both paths follow:

- Content is the text outside valid calls, in order, less its leading whitespace when a call comes before
  its first other character, its trailing whitespace when a call comes after its last one, and whitespace
  between two calls (so the newlines around calls vanish, and content that is only whitespace is None). A
  reply without calls is returned unchanged.
- A call's ``arguments`` is the model's text of the arguments object (see
  :mod:`~draftwise.server.tool_parsers.call_json`).
- Text that is not a valid call (bad JSON, an unknown shape, a reply cut inside a call) is content, never an
  exception.

What streams out concatenates to :meth:`ToolParser.extract`'s result (content, and each call's name and
arguments, and its id when both draw ids from equal generators), except for a call that breaks after its
name was sent (the text ends inside its arguments, e.g. at ``max_tokens``, or they are not valid JSON): the
stream has announced that call and sent its arguments so far, while ``extract`` returns its text as content;
the stream then sends that text as content too. vLLM's parsers stream such a call the same way.
"""

from __future__ import annotations

import hashlib
import logging
import random
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from draftwise.structured.spec import GrammarSpec

logger = logging.getLogger(__name__)

__all__ = [
    "ToolCall", "ParsedOutput", "TextPiece", "CallPiece", "HeldPiece", "Piece", "CallIds", "ToolParser",
    "ToolCallStream", "longest_marker_prefix", "request_call_ids",
]

_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a finished reply.

    Attributes:
        id: the call id (``call_`` + 24 alphanumerics by default; 9 alphanumerics for Mistral).
        name: the function name.
        arguments_json: the arguments, a JSON object as a string (OpenAI's ``function.arguments``).
    """

    id: str
    name: str
    arguments_json: str

    def to_openai(self) -> dict[str, Any]:
        """The call as an OpenAI ``message.tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(frozen=True)
class ParsedOutput:
    """A finished reply: ``content`` (None when there is none) and its ``tool_calls`` in order."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class TextPiece:
    """Content."""

    text: str


@dataclass(frozen=True)
class CallPiece:
    """A call whose name is complete.

    Attributes:
        key: where its object starts in the text (identifies the call from chunk to chunk).
        name: the function name.
        arguments: the arguments text so far (``done``: the final JSON string).
        done: True when the call is complete and valid.
    """

    key: int
    name: str
    arguments: str
    done: bool


@dataclass(frozen=True)
class HeldPiece:
    """Text that may still become (part of) a call; always the last piece, and never in a final scan."""

    text: str


Piece = Union[TextPiece, CallPiece, HeldPiece]


class CallIds:
    """Tool-call ids as OpenAI writes them: ``prefix`` + ``length`` random letters and digits.

    Args:
        rng: the random source (a seeded ``random.Random`` makes ids repeatable); None: the system's.
        prefix: ``call_`` by default.
        length: how many random characters (24 by default).
    """

    def __init__(self, rng: random.Random | None = None, prefix: str = "call_", length: int = 24) -> None:
        self._rng = rng if rng is not None else random.SystemRandom()
        self._prefix = prefix
        self._length = length

    def __call__(self) -> str:
        """A new id."""
        return self._prefix + "".join(self._rng.choice(_ALPHANUMERIC) for _ in range(self._length))


def request_call_ids(parser: "ToolParser", prompt_ids: Sequence[int], choice: int = 0) -> CallIds:
    """The call ids of one choice of one request: ``parser``'s format, drawn from a generator seeded by a digest
    of the prompt's token ids and the choice's index.

    The same request gets the same ids from any server, speculating or not. Agents write the ids of the calls
    they ran into their next prompt (smolagents' ``Calling tools: [{'id': ...}]``), so random ids alone made two
    otherwise identical runs send different prompts from their second turn on. A new turn's prompt differs, and so
    do its ids; calls of one reply are successive draws, so they differ too.
    """
    digest = hashlib.sha256(b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt_ids)
                            + int(choice).to_bytes(4, "little")).digest()
    return parser.call_ids(random.Random(int.from_bytes(digest[:8], "little")))


class ToolParser(ABC):
    """One model family's tool-call format: reading calls out of replies and the grammar that forces them.

    Subclasses set :attr:`name` (the ``--tool-call-parser`` value) and implement :meth:`scan` and
    :meth:`call_grammar`. Parsers hold no per-request state; use :meth:`stream` for one streamed reply.
    """

    name: ClassVar[str]
    call_id_prefix: ClassVar[str] = "call_"
    call_id_length: ClassVar[int] = 24
    reads_bare_json: ClassVar[bool] = False  # its own format is bare JSON calls (no wrapping in BareJsonFallback)

    def call_ids(self, rng: random.Random | None = None) -> CallIds:
        """A generator of this format's call ids (``rng`` None: the system's random source)."""
        return CallIds(rng, self.call_id_prefix, self.call_id_length)

    @abstractmethod
    def scan(self, text: str, final: bool) -> list[Piece]:
        """The text so far as pieces, in order.

        Args:
            text: the reply so far (``final``: all of it).
            final: True when the reply is finished: then there is no :class:`HeldPiece` and every
                :class:`CallPiece` is ``done``.
        """

    @abstractmethod
    def call_grammar(self, tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any],
                     parallel_tool_calls: bool = True) -> GrammarSpec | None:
        """What the reply must match when calls are forced, in exactly the format :meth:`extract` reads.

        Args:
            tools: the request's tools, OpenAI's ``[{"type": "function", "function": {"name", "parameters",
                ...}}]`` (see :func:`draftwise.server.chat_messages.normalize_tools`).
            tool_choice: ``"required"`` (one call of any tool; one or more when ``parallel_tool_calls``) or
                ``{"type": "function", "function": {"name": ...}}`` (exactly one call of that function);
                ``"auto"`` and ``"none"`` force nothing.

        Returns:
            The grammar, or None for ``"auto"`` / ``"none"``.

        Raises:
            ValueError: an unknown ``tool_choice``, a named function that is not in ``tools``, or
                ``"required"`` with no tools.
        """

    def extract(self, text: str, call_ids: Callable[[], str] | None = None) -> ParsedOutput:
        """The content and calls of a finished reply.

        Args:
            text: the whole reply.
            call_ids: makes each call's id (None: :meth:`call_ids` with the system's random source).
        """
        new_id = call_ids or self.call_ids()
        pieces = arrange(self.scan(text, final=True), final=True)
        content = "".join(piece.text for piece in pieces if isinstance(piece, TextPiece))
        calls = tuple(ToolCall(new_id(), piece.name, piece.arguments) for piece in pieces
                      if isinstance(piece, CallPiece))
        return ParsedOutput(content or None, calls)

    def stream(self, call_ids: Callable[[], str] | None = None) -> "ToolCallStream":
        """A parser for one streamed reply (see :class:`ToolCallStream`)."""
        return ToolCallStream(self, call_ids or self.call_ids())


class ToolCallStream:
    """Turns one reply, as it grows, into OpenAI chat-completion deltas.

    Feed it the accumulated text after every chunk (:meth:`feed`) and the whole reply once it is finished
    (:meth:`finish`); each returns the deltas to send, in order, as ``choices[0].delta`` objects:
    ``{"content": str}``; ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name"}}]}`` once
    a call's name is complete; ``{"tool_calls": [{"index", "function": {"arguments": str}}]}`` as its
    arguments grow. Content that may be the start of a call marker, and whitespace that may precede a call,
    is held back until the text after it decides.

    Args:
        parser: the reply's format.
        call_ids: makes each call's id.
    """

    def __init__(self, parser: ToolParser, call_ids: Callable[[], str]) -> None:
        self._parser = parser
        self._new_id = call_ids
        self._content = ""  # the content sent
        self._calls: dict[int, _SentCall] = {}  # by CallPiece.key
        self._diverged = False

    @property
    def tool_calls_sent(self) -> int:
        """How many calls the stream has announced (finish_reason ``tool_calls`` when > 0)."""
        return len(self._calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas the text so far adds.

        Args:
            text: everything generated so far, not the new chunk; each call's text extends the last one's
                (hold back a possible stop string before feeding, never take text back).
        """
        return self._advance(text, final=False)

    def finish(self, text: str) -> list[dict[str, Any]]:
        """The last deltas, for the finished reply (held-back text is settled)."""
        return self._advance(text, final=True)

    def _advance(self, text: str, final: bool) -> list[dict[str, Any]]:
        pieces = arrange(self._parser.scan(text, final), final)
        shown = "".join(p.text for p in _until_held(pieces) if isinstance(p, TextPiece))
        if not self._diverged and not shown.startswith(self._content):
            logger.warning("tool-call stream: the content sent is no longer a prefix of the reply's content; "
                           "no more content is streamed")
            self._diverged = True
        deltas: list[dict[str, Any]] = []
        offset = 0
        for piece in _until_held(pieces):
            if isinstance(piece, TextPiece):
                offset += len(piece.text)
                if not self._diverged and offset > len(self._content):
                    deltas.append({"content": shown[len(self._content):offset]})
                    self._content = shown[:offset]
            else:
                deltas.extend(self._call_deltas(piece))
        return deltas

    def _call_deltas(self, piece: CallPiece) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        sent = self._calls.get(piece.key)
        if sent is None:
            sent = self._calls[piece.key] = _SentCall(len(self._calls))
            deltas.append({"tool_calls": [{"index": sent.index, "id": self._new_id(), "type": "function",
                                           "function": {"name": piece.name}}]})
        if piece.arguments.startswith(sent.arguments) and len(piece.arguments) > len(sent.arguments):
            deltas.append({"tool_calls": [{"index": sent.index,
                                           "function": {"arguments": piece.arguments[len(sent.arguments):]}}]})
            sent.arguments = piece.arguments
        return deltas


@dataclass
class _SentCall:
    """What a stream has sent of one call: its index and its arguments so far."""

    index: int
    arguments: str = ""


def _until_held(pieces: list[Piece]) -> list[Piece]:
    """The pieces before the first :class:`HeldPiece`."""
    for i, piece in enumerate(pieces):
        if isinstance(piece, HeldPiece):
            return pieces[:i]
    return pieces


def arrange(pieces: list[Piece], final: bool) -> list[Piece]:
    """Apply the content rules to a scan: whitespace is dropped from the start of the content when a call
    comes before its first other character, from its end when a call comes after its last one, and between
    two calls; all other whitespace is kept, in place. Not ``final``, whitespace with nothing but calls after
    it yet is held back (left out of the pieces) until the text after it decides."""
    arranged: list[Piece] = []
    pending = ""  # whitespace after the last placed content, before any call since
    between = ""  # whitespace after the last call
    shown_text = False  # some non-whitespace content is placed
    call_since_text = False  # a call came after the last placed content (or before any)
    for piece in pieces:
        if isinstance(piece, CallPiece):
            arranged.append(piece)
            call_since_text, between = True, ""
            continue
        if isinstance(piece, HeldPiece):
            if piece.text:
                arranged.append(piece)
            continue
        core = piece.text.strip()
        if not core:
            if call_since_text:
                between += piece.text
            else:
                pending += piece.text
            continue
        lead = piece.text[: len(piece.text) - len(piece.text.lstrip())]
        before = "" if call_since_text and not shown_text else pending + between + lead
        arranged.append(TextPiece(before + core))
        pending, between = piece.text[len(piece.text.rstrip()):], ""
        shown_text, call_since_text = True, False
    if final and pending and not call_since_text:
        arranged.append(TextPiece(pending))
    return arranged


def longest_marker_prefix(text: str, marker: str) -> int:
    """The length of the longest proper prefix of ``marker`` that ``text`` ends with (0 if none): the
    characters a stream holds back because the marker may be starting."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def forced_functions(tools: Sequence[dict[str, Any]], tool_choice: str | dict[str, Any]) -> list[dict] | None:
    """The functions a ``tool_choice`` forces a call of: all of them for ``"required"``, the named one for
    ``{"type": "function", "function": {"name": ...}}``, None for ``"auto"`` / ``"none"``.

    Raises:
        ValueError: an unknown ``tool_choice``, a named function not in ``tools``, ``"required"`` without
            tools.
    """
    functions = [tool["function"] for tool in tools]
    if tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        if not functions:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return functions
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [function for function in functions if function.get("name") == name]
        if not chosen:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in 'tools'")
        return chosen[:1]
    raise ValueError(f"unknown tool_choice {tool_choice!r}: use 'none', 'auto', 'required' or "
                     "{'type': 'function', 'function': {'name': ...}}")


def call_schema(function: dict[str, Any], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON Schema of one call object of ``function``: ``{"name": <its name>, arguments_key: <an object
    matching its parameters>}``, name first."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def calls_schema(functions: Sequence[dict[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    """One call of any of ``functions``: :func:`call_schema` itself for one, an ``anyOf`` of them for more."""
    schemas = [call_schema(function, arguments_key) for function in functions]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
