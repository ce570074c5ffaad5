"""JSON request bodies parsed with errors that name the problem.

FastAPI answers every body its JSON parser refuses for a reason other than a syntax error (bytes that are not
UTF-8, nesting past the interpreter's recursion limit, an integer longer than Python converts) with "There was
an error parsing the body". :class:`JSONBodyRoute` parses bodies with :func:`parse_json_body` instead, whose
refusals are OpenAI-style 400s saying what is wrong and, where the parser knows it, where.

Limits: :data:`MAX_JSON_DEPTH` levels of nesting (far above any request this server serves, and below the
recursion limit, so the answer does not depend on the interpreter's stack), and Python's own limit on the
digits of an integer (``sys.get_int_max_str_digits()``, 4300 by default).
"""

from __future__ import annotations

import json
import re
import sys
from itertools import accumulate
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from draftwise.server.errors import RequestBodyError, RequestError

__all__ = ["JSONBodyRoute", "parse_json_body", "MAX_JSON_DEPTH"]

MAX_JSON_DEPTH = 256

_UTF8_BOM = b"\xef\xbb\xbf"
# a JSON string (escapes included): brackets inside strings are not nesting
_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_STRINGS = re.compile(_STRING, re.S)
_STRUCTURE = re.compile(_STRING + r"|[\[\]{}]", re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class _IntegerTooLong(Exception):
    """An integer literal with more digits than Python converts (raised from the parser's int hook)."""

    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def parse_json_body(body: bytes) -> Any:
    """The JSON value of a request body (UTF-8, or the UTF-16/32 that ``json.loads`` detects).

    Raises:
        RequestError: 400 naming the problem: bytes that do not decode (with their offset), a syntax error (with
            line, column and character), nesting deeper than :data:`MAX_JSON_DEPTH` levels (with where), or
            an integer with more digits than Python converts.
    """
    text = _decode(body)
    _check_nesting(text)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc.msg} at "
                           f"{_position(text, exc.pos)}") from None
    except RecursionError:
        raise RequestError("JSON nested too deeply for the parser (this server accepts at most "
                           f"{MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:
        if "digits" not in str(exc):  # not the int conversion limit: an unexpected parser failure
            raise
        raise _integer_error(text) from None


def _decode(body: bytes) -> str:
    """The body as text, in the encoding ``json.loads`` would detect (lone surrogates pass, as there: a
    string holding one is refused later, naming its field)."""
    encoding = json.detect_encoding(body)
    skipped = 0
    if encoding == "utf-8-sig":  # decode after the BOM, so offsets count from the body's first byte
        encoding, skipped = "utf-8", len(_UTF8_BOM)
    try:
        return body[skipped:].decode(encoding, "surrogatepass")
    except UnicodeDecodeError as exc:
        offset = skipped + exc.start
        name = encoding.upper()
        raise RequestError(f"the request body is not valid {name}: byte 0x{body[offset]:02x} at offset "
                           f"{offset} ({exc.reason}); send JSON encoded as UTF-8") from None


def _check_nesting(text: str) -> None:
    """Refuse arrays and objects nested deeper than :data:`MAX_JSON_DEPTH` (brackets in strings do not count).

    The depth is measured at C speed (strings and everything but brackets cut out, then a running sum); only a
    body found too deep is walked again in Python, to tell where.
    """
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    if max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0) <= MAX_JSON_DEPTH:
        return
    depth = 0
    for match in _STRUCTURE.finditer(text):
        depth += _DEPTH_STEP.get(match.group(), 0)
        if depth > MAX_JSON_DEPTH:
            raise RequestError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels: the request body opens level "
                               f"{depth} at {_position(text, match.start())}")


def _integer_error(text: str) -> RequestError:
    """The 400 for an integer longer than Python converts, with its length (found by parsing again, each
    integer checked by the parser's int hook: only bodies already refused pay for it)."""
    limit = sys.get_int_max_str_digits()
    found = ""
    try:
        json.loads(text, parse_int=_bounded_int)
    except _IntegerTooLong as exc:
        found = f" ({exc.digits} digits)"
    except ValueError:
        pass
    return RequestError(f"a number in the request body has more than {limit} digits{found}: no field of this "
                        "API takes such a number")


def _bounded_int(literal: str) -> int:
    digits, limit = len(literal) - literal.startswith("-"), sys.get_int_max_str_digits()
    if limit and digits > limit:  # 0: no limit
        raise _IntegerTooLong(digits)
    return int(literal)


def _position(text: str, pos: int) -> str:
    """``line L column C (char P)``, as ``json.JSONDecodeError`` words it."""
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"line {line} column {column} (char {pos})"


class _JSONBodyRequest(Request):
    """A request whose :meth:`json` is :func:`parse_json_body`."""

    async def json(self) -> Any:
        """The parsed body (parsed once).

        Raises:
            RequestBodyError: the body is not acceptable JSON (carries the 400 to answer).
        """
        if not hasattr(self, "_draftwise_json"):
            try:
                self._draftwise_json = parse_json_body(await self.body())
            except RequestError as exc:
                raise RequestBodyError(exc) from None
        return self._draftwise_json


class JSONBodyRoute(APIRoute):
    """An API route whose JSON body is parsed by :func:`parse_json_body` (set as the app's
    ``router.route_class`` before adding routes)."""

    def get_route_handler(self):
        """FastAPI's handler, given a :class:`_JSONBodyRequest`."""
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JSONBodyRequest(request.scope, request.receive))

        return handle
