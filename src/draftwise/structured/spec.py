"""What a request's output must match, independent of any grammar engine.

A :data:`GrammarSpec` is a small tree of frozen values. The server builds one from ``response_format``
(``json_object``: :class:`JsonSchema` with ``schema=None``; ``json_schema``), vLLM's structured-output fields
(``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``) and ``tool_choice`` (``required`` or a
named function: the tool-call format of the model family around each call's JSON schema, e.g. Hermes/Qwen2.5
``Concat((Literal("<tool_call>\\n"), JsonSchema(call_schema), Literal("\\n</tool_call>")))``). The grammar engine
(:mod:`draftwise.structured.grammar`) compiles it for one tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

__all__ = ["Literal", "JsonSchema", "Regex", "Choice", "Ebnf", "Concat", "Alternatives", "Repeat", "GrammarSpec"]


@dataclass(frozen=True)
class Literal:
    """Exactly ``text``."""

    text: str


@dataclass(frozen=True)
class JsonSchema:
    """One JSON value matching ``schema`` (a JSON Schema as a dict); ``schema=None``: any JSON object
    (``response_format: {"type": "json_object"}``). ``strict``: no properties beyond the schema's."""

    schema: dict[str, Any] | None = None
    strict: bool = True


@dataclass(frozen=True)
class Regex:
    """A string matching the regular expression ``pattern`` in full."""

    pattern: str


@dataclass(frozen=True)
class Choice:
    """Exactly one of ``options``."""

    options: tuple[str, ...]


@dataclass(frozen=True)
class Ebnf:
    """A grammar in GBNF/EBNF (llama.cpp's and xgrammar's dialect; the start rule is ``root``)."""

    text: str


@dataclass(frozen=True)
class Concat:
    """Each of ``parts`` in order."""

    parts: tuple["GrammarSpec", ...]


@dataclass(frozen=True)
class Alternatives:
    """Any one of ``options``."""

    options: tuple["GrammarSpec", ...]


@dataclass(frozen=True)
class Repeat:
    """``item`` between ``min_count`` and ``max_count`` times (None: unbounded), ``separator`` between
    repetitions."""

    item: "GrammarSpec"
    min_count: int = 1
    max_count: int | None = None
    separator: str = ""


GrammarSpec = Union[Literal, JsonSchema, Regex, Choice, Ebnf, Concat, Alternatives, Repeat]
