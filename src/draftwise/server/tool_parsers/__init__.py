"""Tool calls in model replies, one parser per model family's format (``--tool-call-parser``): ``hermes``
(Qwen2.5, Hermes), ``llama3_json`` (Llama 3.x), ``mistral`` (Mistral v3 tokenizers). Each reads a finished
reply's calls, streams them as OpenAI deltas, and builds the grammar that forces calls
(``tool_choice: "required"`` or a named function); see :mod:`~draftwise.server.tool_parsers.base`.
:func:`detect_tool_parser` picks the format from a model's chat template, as vLLM's ``--tool-call-parser`` is
picked by hand.
"""

from __future__ import annotations

from draftwise.server.tool_parsers.base import CallIds, ParsedOutput, ToolCall, ToolCallStream, ToolParser
from draftwise.server.tool_parsers.hermes import HermesToolParser
from draftwise.server.tool_parsers.llama3 import Llama3JsonToolParser
from draftwise.server.tool_parsers.mistral import MistralToolParser

__all__ = [
    "TOOL_PARSERS", "get_tool_parser", "detect_tool_parser", "ToolParser", "ToolCallStream", "ToolCall",
    "ParsedOutput", "CallIds", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
"""The parsers by ``--tool-call-parser`` name."""


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call format needs, read from the template's text: ``hermes`` when
    it writes ``<tool_call>`` (Qwen2.5, Hermes), ``mistral`` when it writes ``[TOOL_CALLS]``, ``llama3_json``
    when it writes ``<|python_tag|>`` or asks for ``"parameters"`` in a Llama 3 header layout; None when the
    template shows no tool-call format (then tools cannot be served without ``--tool-call-parser``)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesToolParser.name
    if "[TOOL_CALLS]" in chat_template:
        return MistralToolParser.name
    llama_layout = "<|start_header_id|>" in chat_template
    if llama_layout and ("<|python_tag|>" in chat_template or '"parameters"' in chat_template):
        return Llama3JsonToolParser.name
    return None
