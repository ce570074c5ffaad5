"""Compile a :data:`~draftwise.structured.spec.GrammarSpec` for one tokenizer into a grammar processor, on
xgrammar (https://github.com/mlc-ai/xgrammar, the default structured-output backend of vLLM and SGLang).

Why xgrammar: its mask fill is a few to tens of microseconds per token on Qwen2.5's 152k-token vocabulary with
steady latency, it rolls back any number of tokens (what speculation needs), it finds the text a grammar
forces next (jump-forward), it speaks the GBNF/EBNF dialect that :class:`~draftwise.structured.spec.Ebnf`
names, and its grammars compose (concatenation, union, and repetition through structural tags) so every spec
node maps onto one engine construct. The measured comparison with llguidance and outlines-core is in the
issue's closing note (issue 51).

Translation of spec nodes: ``Literal`` and ``Choice`` are constant strings, ``JsonSchema`` xgrammar's JSON
schema converter (``schema=None``: any JSON object), ``Regex`` its regex converter, ``Ebnf`` its EBNF parser,
``Concat`` / ``Alternatives`` ``Grammar.concat`` / ``Grammar.union``, and ``Repeat`` a structural tag
(``sequence`` / ``repeat`` / ``optional``) around the item's grammar.

A :class:`GrammarCompiler` belongs to one tokenizer and keeps a bounded LRU cache of compiled grammars keyed by
the spec; the server owns it (no module-level cache).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import fields, is_dataclass

import xgrammar

from draftwise.processors.grammar import GrammarProcessor
from draftwise.structured.spec import (
    Alternatives, Choice, Concat, Ebnf, GrammarSpec, JsonSchema, Literal, Regex, Repeat,
)

__all__ = ["GrammarError", "TokenVocabulary", "GrammarCompiler", "to_xgrammar", "spec_key"]

logger = logging.getLogger(__name__)

#: ``response_format: {"type": "json_object"}``: any JSON object.
_ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A spec that cannot be compiled: an invalid JSON schema, regular expression, EBNF grammar, or an empty
    choice / concatenation / bad repeat bounds.

    Attributes:
        kind: which spec node failed: ``"json_schema"``, ``"regex"``, ``"ebnf"``, ``"choice"``, ``"literal"``,
            ``"concat"``, ``"alternatives"`` or ``"repeat"`` (the server names the request field from it).
        detail: the engine's message, without its source location.
    """

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"invalid {kind}: {detail}")
        self.kind = kind
        self.detail = detail


class TokenVocabulary:
    """What a grammar needs to know of a tokenizer: each token id's bytes, the vocabulary size, the stop ids.

    Build it with :meth:`from_huggingface` (a ``transformers`` tokenizer: byte-level BPE such as Qwen's,
    SentencePiece byte-fallback such as stories260K's), :meth:`from_token_table` (a GGUF token table, e.g.
    llama.cpp's tokenizer's ``convert_ids_to_tokens``) or :meth:`from_token_bytes` (each id's bytes).

    Attributes:
        info: the ``xgrammar.TokenizerInfo``.
        name: an identity for logs.
    """

    def __init__(self, info: xgrammar.TokenizerInfo, name: str = "tokenizer") -> None:
        self.info = info
        self.name = name

    @classmethod
    def from_huggingface(cls, tokenizer, *, stop_token_ids: Sequence[int], vocab_size: int | None = None,
                         name: str | None = None) -> "TokenVocabulary":
        """From a ``transformers`` tokenizer.

        Args:
            tokenizer: a ``PreTrainedTokenizer(Fast)``.
            stop_token_ids: ids that end generation (the model's EOS ids): allowed exactly where a grammar may end.
            vocab_size: the model's logits width when it exceeds the tokenizer's (padded ids are masked).
            name: identity for logs (default: the tokenizer's ``name_or_path``).
        """
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=[int(t) for t in stop_token_ids])
        return cls(info, name or str(getattr(tokenizer, "name_or_path", "") or "tokenizer"))

    @classmethod
    def from_token_table(cls, tokens: Sequence[str], *, stop_token_ids: Sequence[int], vocab_size: int | None = None,
                         name: str = "tokenizer") -> "TokenVocabulary":
        """From the token strings as a GGUF file's ``tokenizer.ggml.tokens`` table stores them (what
        ``convert_ids_to_tokens`` returns, e.g. llama.cpp's tokenizer): byte-level BPE (``Ġ``/``Ċ`` forms),
        SentencePiece with byte fallback (``▁`` and ``<0x0A>`` forms), else raw text.

        Args:
            tokens: the token string of each id (``tokens[i]`` for id i).
            stop_token_ids: ids allowed exactly where a grammar may end.
            vocab_size: the model's logits width when it exceeds ``len(tokens)``.
            name: identity for logs.
        """
        table = [token or "" for token in tokens]
        vocab_type = _vocab_type(table)
        info = xgrammar.TokenizerInfo(table, vocab_type, vocab_size=vocab_size,
                                      stop_token_ids=[int(t) for t in stop_token_ids],
                                      add_prefix_space=vocab_type == xgrammar.VocabType.BYTE_FALLBACK)
        return cls(info, name)

    @classmethod
    def from_token_bytes(cls, token_bytes: Sequence[bytes], *, stop_token_ids: Sequence[int],
                         vocab_size: int | None = None, name: str = "tokenizer") -> "TokenVocabulary":
        """From each token id's bytes (``token_bytes[i]``: the bytes token i adds to the text; ``b""`` for
        control tokens that no grammar may emit)."""
        info = xgrammar.TokenizerInfo(list(token_bytes), xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=[int(t) for t in stop_token_ids])
        return cls(info, name)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the mask's width)."""
        return int(self.info.vocab_size)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids allowed exactly where a grammar may end."""
        return tuple(int(t) for t in self.info.stop_token_ids)


class GrammarCompiler:
    """Compiles specs for one tokenizer, with a bounded LRU cache of compiled grammars (thread-safe).

    Args:
        vocabulary: the tokenizer's :class:`TokenVocabulary`.
        max_entries: compiled grammars kept (least recently used evicted first).
        any_whitespace: let JSON values carry any whitespace between tokens; False (the default) allows only
            the single spaces of ``", "`` and ``": "``, so a model cannot loop on whitespace.
        max_threads: threads xgrammar may use to compile one grammar.
    """

    def __init__(self, vocabulary: TokenVocabulary, *, max_entries: int = 128, any_whitespace: bool = False,
                 max_threads: int = 1) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.vocabulary = vocabulary
        self.max_entries = max_entries
        self.any_whitespace = any_whitespace
        self._compiler = xgrammar.GrammarCompiler(vocabulary.info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Number of cached compiled grammars."""
        return len(self._cache)

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec`` (from the cache when it was compiled before).

        Raises:
            GrammarError: if the spec is invalid.
        """
        key = spec_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        started = time.perf_counter()
        grammar = to_xgrammar(spec, any_whitespace=self.any_whitespace)
        compiled = _engine_call("grammar", lambda: self._compiler.compile_grammar(grammar))
        logger.debug("compiled a %s grammar for %s in %.1f ms", type(spec).__name__, self.vocabulary.name,
                     (time.perf_counter() - started) * 1e3)
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def processor(self, spec: GrammarSpec, *, stop_token_ids: Sequence[int] | None = None) -> GrammarProcessor:
        """A fresh per-request :class:`~draftwise.processors.grammar.GrammarProcessor` for ``spec``.

        Args:
            spec: what the output must match.
            stop_token_ids: the request's stop ids (None: the vocabulary's).

        Raises:
            GrammarError: if the spec is invalid.
        """
        return GrammarProcessor(self.compile(spec), stop_token_ids)


_BYTE_FALLBACK_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _vocab_type(table: Sequence[str]) -> xgrammar.VocabType:
    """How a GGUF token table encodes bytes: byte-level BPE (GPT-2's ``Ġ`` for a space), SentencePiece byte
    fallback (``<0x0A>`` tokens), else raw text."""
    if any("Ġ" in token or "Ċ" in token for token in table):
        return xgrammar.VocabType.BYTE_LEVEL
    if any(_BYTE_FALLBACK_TOKEN.match(token) for token in table):
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW


def to_xgrammar(spec: GrammarSpec, *, any_whitespace: bool = False) -> xgrammar.Grammar:
    """Translate a spec tree into one ``xgrammar.Grammar`` (tokenizer-independent; see the module docstring).

    Raises:
        GrammarError: if a node is invalid (its ``kind`` names the node type).
    """
    if isinstance(spec, Literal):
        return _literal(spec.text)
    if isinstance(spec, JsonSchema):
        schema = _ANY_OBJECT if spec.schema is None else spec.schema
        strict = spec.strict and spec.schema is not None
        return _engine_call("json_schema", lambda: xgrammar.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=any_whitespace, strict_mode=strict))
    if isinstance(spec, Regex):
        return _engine_call("regex", lambda: xgrammar.Grammar.from_regex(spec.pattern))
    if isinstance(spec, Choice):
        if not spec.options:
            raise GrammarError("choice", "no options")
        return _union([_literal(option) for option in spec.options])
    if isinstance(spec, Ebnf):
        return _engine_call("ebnf", lambda: xgrammar.Grammar.from_ebnf(spec.text))
    if isinstance(spec, Concat):
        if not spec.parts:
            raise GrammarError("concat", "no parts")
        parts = [to_xgrammar(part, any_whitespace=any_whitespace) for part in spec.parts]
        return parts[0] if len(parts) == 1 else xgrammar.Grammar.concat(*parts)
    if isinstance(spec, Alternatives):
        if not spec.options:
            raise GrammarError("alternatives", "no options")
        return _union([to_xgrammar(option, any_whitespace=any_whitespace) for option in spec.options])
    if isinstance(spec, Repeat):
        return _repeat(spec, to_xgrammar(spec.item, any_whitespace=any_whitespace))
    raise TypeError(f"not a GrammarSpec node: {spec!r}")


def spec_key(spec: GrammarSpec) -> str:
    """A canonical string for a spec tree (node types and fields, JSON schemas with sorted keys): equal specs
    give equal keys, so it keys the compiled-grammar cache."""
    return json.dumps(_key_tree(spec), sort_keys=True, separators=(",", ":"))


def _key_tree(value):
    if is_dataclass(value):
        return {"node": type(value).__name__, **{f.name: _key_tree(getattr(value, f.name)) for f in fields(value)}}
    if isinstance(value, (tuple, list)):
        return [_key_tree(item) for item in value]
    return value


def _literal(text: str) -> xgrammar.Grammar:
    if not text:
        return xgrammar.Grammar.from_ebnf('root ::= ""')
    return _structural({"type": "const_string", "value": text}, "literal")


def _union(grammars: list[xgrammar.Grammar]) -> xgrammar.Grammar:
    return grammars[0] if len(grammars) == 1 else xgrammar.Grammar.union(*grammars)


def _repeat(spec: Repeat, item: xgrammar.Grammar) -> xgrammar.Grammar:
    """``item (separator item)*`` with the counts of ``spec``, as a structural tag over the item's EBNF."""
    low, high = spec.min_count, spec.max_count
    if low < 0 or (high is not None and high < low):
        raise GrammarError("repeat", f"bad bounds min_count={low}, max_count={high}")
    if high == 0:
        return xgrammar.Grammar.from_ebnf('root ::= ""')
    body = {"type": "grammar", "grammar": str(item)}
    rest_item = body if not spec.separator else {
        "type": "sequence", "elements": [{"type": "const_string", "value": spec.separator}, body]}
    rest = {"type": "repeat", "min": max(low - 1, 0), "max": -1 if high is None else high - 1, "content": rest_item}
    once_or_more = {"type": "sequence", "elements": [body, rest]}
    return _structural(once_or_more if low > 0 else {"type": "optional", "content": once_or_more}, "repeat")


def _structural(format_: dict, kind: str) -> xgrammar.Grammar:
    tag = {"type": "structural_tag", "format": format_}
    return _engine_call(kind, lambda: xgrammar.Grammar.from_structural_tag(tag))


_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def _engine_call(kind: str, build):
    """Run an xgrammar constructor; its errors (RuntimeError with a C++ source location) become
    :class:`GrammarError` of ``kind``."""
    try:
        return build()
    except (RuntimeError, ValueError) as exc:
        detail = _SOURCE_LOCATION.sub("", str(exc).strip()).strip()
        raise GrammarError(kind, detail) from exc
