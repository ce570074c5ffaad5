"""The request fields that constrain the output, read into one :data:`~draftwise.structured.spec.GrammarSpec`.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's extras ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and their newer form ``structured_outputs`` (``{"json"
| "regex" | "choice" | "grammar" | "json_object": ...}``), and forced tool calls (``tool_choice`` ``"required"``
or a named function, whose grammar the tool-call parser builds). A request may use one of them; two at once
is a 400, since no engine can honour both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from draftwise.server.errors import RequestError
from draftwise.structured.spec import Choice, Ebnf, GrammarSpec, JsonSchema, Regex

__all__ = ["output_grammar", "RequestedGrammar", "STRUCTURED_EXTRA_FIELDS"]

#: vLLM's structured-output fields, read from a request's extra fields (the OpenAI client's ``extra_body``).
STRUCTURED_EXTRA_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                           "guided_decoding_backend", "guided_whitespace_pattern")


@dataclass(frozen=True)
class RequestedGrammar:
    """A request's output grammar and the field it came from (named when it cannot be compiled)."""

    field: str
    spec: GrammarSpec


def output_grammar(request: Any, forced_calls: GrammarSpec | None = None) -> RequestedGrammar | None:
    """The grammar ``request``'s output must match, or None.

    Args:
        request: a chat or completion request (pydantic; ``response_format`` may be a field or an extra).
        forced_calls: the grammar of a forced ``tool_choice``, or None.

    Raises:
        RequestError: a malformed field (named), or more than one constraint.
    """
    extra = request.model_extra or {}
    response_format = getattr(request, "response_format", None)
    if response_format is None:
        response_format = extra.get("response_format")
    found = [("tool_choice", forced_calls), ("response_format", _response_format(response_format))]
    found += [(name, _guided(name, extra[name])) for name in ("guided_json", "guided_regex", "guided_choice",
                                                              "guided_grammar") if extra.get(name) is not None]
    if extra.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(extra["structured_outputs"])))
    found = [(name, grammar) for name, grammar in found if grammar is not None]
    if len(found) > 1:
        raise RequestError(f"{found[0][0]} and {found[1][0]} both constrain the output: send one of them",
                           param=found[1][0])
    return RequestedGrammar(*found[0]) if found else None


def _response_format(value: Any) -> GrammarSpec | None:
    """``response_format``: ``text`` (None), ``json_object`` (any JSON object) or ``json_schema``."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise RequestError("response_format must be an object with a 'type' ('text', 'json_object' or "
                           "'json_schema')", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonSchema(None, strict=False)
    if kind != "json_schema":
        raise RequestError(f"response_format type {kind!r} is not supported: use 'text', 'json_object' or "
                           "'json_schema'", param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError("response_format 'json_schema' needs a 'json_schema' object with a 'schema'",
                           param="response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:
        return JsonSchema(None, strict=bool(spec.get("strict")))
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema must be a JSON Schema object",
                           param="response_format.json_schema.schema")
    return JsonSchema(schema, strict=bool(spec.get("strict")))


def _guided(name: str, value: Any) -> GrammarSpec:
    """One of vLLM's ``guided_*`` fields."""
    if name == "guided_json":
        return JsonSchema(_schema(value, name), strict=False)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise RequestError(f"{name} must be a non-empty list of non-empty strings", param=name)
        return Choice(tuple(value))
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string", param=name)
    return Regex(value) if name == "guided_regex" else Ebnf(value)


def _structured_outputs(value: Any) -> GrammarSpec:
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``."""
    keys = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
    if not isinstance(value, dict):
        raise RequestError("structured_outputs must be an object", param="structured_outputs")
    given = [k for k in (*keys, "json_object") if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise RequestError("structured_outputs needs exactly one of 'json', 'regex', 'choice', 'grammar', "
                           f"'json_object' (got {given or 'none'})", param="structured_outputs")
    key = given[0]
    if key == "json_object":
        return JsonSchema(None, strict=False)
    try:
        return _guided(keys[key], value[key])
    except RequestError as exc:
        raise RequestError(exc.message.replace(keys[key], f"structured_outputs.{key}"),
                           param=f"structured_outputs.{key}") from exc


def _schema(value: Any, param: str) -> dict:
    """A JSON Schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestError(f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, dict):
        raise RequestError(f"{param} must be a JSON Schema object", param=param)
    return value
