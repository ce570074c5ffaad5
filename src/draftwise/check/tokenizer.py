"""Tokenizer compatibility of a draft with a target.

Speculative decoding hands token ids from the draft to the target, so both must give every id the same
meaning. What is compared:

- the id -> token table over the ids both tokenizers have: any difference is an error (the draft would
  propose ids that mean something else to the target; almost every draft token would be rejected);
- the embedding widths: a target whose embedding (and logits) is wider than the draft's with the same real
  tokens is a *padded vocabulary* (Qwen2-72B's 152064 rows vs Qwen2-1.5B's 151936) and is accepted, since
  :class:`draftwise.proposers.draft_model.DraftModelProposer` cuts or pads the draft's logits to the target's
  width; a draft embedding too narrow to read every token of the target's table is an error;
- special tokens (BOS, EOS, pad) and the chat template: differences are warnings. The engine stops on the
  target's EOS and formats prompts with the target's template, so output stays exact, but a draft trained on
  other conventions (a base draft for an instruct target) accepts fewer tokens.

Trailing placeholder entries (GGUF ``UNUSED`` token types, ``[PAD151665]``-style names) are padding, not
real tokens, and are left out of the comparison.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from draftwise.check.gguf_header import GGUFHeader

__all__ = [
    "TokenizerInfo",
    "TokenizerReport",
    "TokenizerMismatchError",
    "compare_tokenizers",
    "require_compatible",
    "tokenizer_info_from_gguf",
    "tokenizer_info_from_hf",
    "GGUF_TOKENIZER_KEYS",
]

logger = logging.getLogger(__name__)

#: GGUF metadata keys :func:`tokenizer_info_from_gguf` reads.
GGUF_TOKENIZER_KEYS = (
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template",
)
_GGUF_UNUSED_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED
_PLACEHOLDER = re.compile(r"^\[PAD\d+\]$")
_SHOWN_DIFFERENCES = 3


class TokenizerMismatchError(ValueError):
    """Draft and target tokenizers map ids to different tokens; speculation would be meaningless."""


@dataclass(frozen=True)
class TokenizerInfo:
    """The parts of a tokenizer that decide whether two models can speculate together.

    Attributes:
        tokens: the id -> token table (real tokens only; trailing placeholders removed).
        bos_token_id, eos_token_id, pad_token_id: special token ids (None when unset).
        chat_template: the Jinja chat template, if any.
    """

    tokens: tuple[str | None, ...]
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None

    def token(self, token_id: int | None) -> str | None:
        """The token string of an id (None for None or an id outside the table)."""
        if token_id is None or not (0 <= token_id < len(self.tokens)):
            return None
        return self.tokens[token_id]


@dataclass
class TokenizerReport:
    """Outcome of :func:`compare_tokenizers`.

    Attributes:
        ok: no errors (the pair can speculate).
        errors, warnings, notes: human-readable findings (errors block speculation; warnings cost acceptance;
            notes are informational, e.g. a padded vocabulary).
        target_tokens, draft_tokens: real table sizes (tokens).
        target_vocab_width, draft_vocab_width: embedding rows = logits width (None when unknown).
        padded_vocab: same real tokens but different embedding widths (accepted; logits are sliced).
        num_differing: shared ids whose tokens differ.
        first_differences: up to three ``{"id", "target", "draft"}`` entries.
        chat_template_match: None when neither model has a template.
    """

    ok: bool
    target_tokens: int
    draft_tokens: int
    target_vocab_width: int | None = None
    draft_vocab_width: int | None = None
    padded_vocab: bool = False
    num_differing: int = 0
    first_differences: list[dict] = field(default_factory=list)
    special_tokens: dict[str, dict] = field(default_factory=dict)
    chat_template_match: bool | None = None
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready copy."""
        return asdict(self)


def _strip_placeholders(tokens: Sequence[str | None], token_types: Sequence[int] | None = None) -> tuple:
    end = len(tokens)
    while end and (_PLACEHOLDER.match(tokens[end - 1] or "")
                   or (token_types is not None and token_types[end - 1] == _GGUF_UNUSED_TOKEN_TYPE)):
        end -= 1
    return tuple(tokens[:end])


def _optional_int(value, size: int | None = None) -> int | None:
    """An id, or None when unset or outside ``[0, size)`` (GGUF writes an unset id as 2**32 - 1)."""
    if value is None or (size is not None and not 0 <= int(value) < size):
        return None
    return int(value)


def tokenizer_info_from_hf(tokenizer) -> TokenizerInfo:
    """Read a ``transformers`` tokenizer (added tokens included, ids ``0 .. len(tokenizer) - 1``)."""
    table = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    template = getattr(tokenizer, "chat_template", None)
    return TokenizerInfo(
        tokens=_strip_placeholders(table),
        bos_token_id=_optional_int(tokenizer.bos_token_id),
        eos_token_id=_optional_int(tokenizer.eos_token_id),
        pad_token_id=_optional_int(tokenizer.pad_token_id),
        chat_template=template if isinstance(template, str) else None,
    )


def tokenizer_info_from_gguf(header: GGUFHeader, source: str = "GGUF file") -> TokenizerInfo:
    """Read the token table and special tokens of a GGUF header (read with :data:`GGUF_TOKENIZER_KEYS`).

    Raises:
        ValueError: the header has no ``tokenizer.ggml.tokens`` table.
    """
    meta = header.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{source}: no tokenizer.ggml.tokens table in the GGUF metadata")
    template = meta.get("tokenizer.chat_template")
    size = len(tokens)
    return TokenizerInfo(
        tokens=_strip_placeholders(tokens, meta.get("tokenizer.ggml.token_type")),
        bos_token_id=_optional_int(meta.get("tokenizer.ggml.bos_token_id"), size),
        eos_token_id=_optional_int(meta.get("tokenizer.ggml.eos_token_id"), size),
        pad_token_id=_optional_int(meta.get("tokenizer.ggml.padding_token_id"), size),
        chat_template=str(template) if template else None,
    )


def _table_differences(target: TokenizerInfo, draft: TokenizerInfo) -> list[int]:
    shared = min(len(target.tokens), len(draft.tokens))
    return [i for i in range(shared) if target.tokens[i] != draft.tokens[i]]


def _special_tokens(target: TokenizerInfo, draft: TokenizerInfo) -> dict[str, dict]:
    found = {}
    for role in ("bos", "eos", "pad"):
        target_id, draft_id = getattr(target, f"{role}_token_id"), getattr(draft, f"{role}_token_id")
        found[role] = {"target_id": target_id, "target": target.token(target_id),
                       "draft_id": draft_id, "draft": draft.token(draft_id), "match": target_id == draft_id}
    return found


def _mismatch_message(target_name: str, draft_name: str, diffs: list[int], shared: int,
                      target: TokenizerInfo, draft: TokenizerInfo) -> str:
    shown = ", ".join(f"id {i}: target {target.tokens[i]!r} vs draft {draft.tokens[i]!r}"
                      for i in diffs[:_SHOWN_DIFFERENCES])
    return (f"draft {draft_name!r} and target {target_name!r} use different tokenizers "
            f"({len(diffs)} of {shared} shared ids differ; first: {shown}); a draft must share the target's "
            "tokenizer: pick a draft of the target's family, or use n-gram speculation, which needs no draft")


def _width_findings(report: TokenizerReport, target: TokenizerInfo) -> None:
    """Padded vocabularies (accepted) and a draft embedding too narrow for the target's tokens (error)."""
    target_width, draft_width = report.target_vocab_width, report.draft_vocab_width
    if draft_width is not None and draft_width < len(target.tokens):
        report.errors.append(
            f"the draft's embedding has {draft_width} rows but the target's tokenizer has {len(target.tokens)} "
            "tokens: the draft could not read every token the target may produce")
    if target_width is not None and draft_width is not None and target_width != draft_width:
        report.padded_vocab = True
        report.notes.append(
            f"padded vocabulary: target logits are {target_width} wide, draft logits {draft_width}; the draft's "
            "logits are cut or padded to the target's width")


def _table_size_findings(report: TokenizerReport, target: TokenizerInfo, draft: TokenizerInfo) -> None:
    extra, owner, other = ((target, "target", "draft") if len(target.tokens) > len(draft.tokens)
                           else (draft, "draft", "target"))
    count = abs(len(target.tokens) - len(draft.tokens))
    if count:
        first = min(len(target.tokens), len(draft.tokens))
        report.warnings.append(
            f"the {owner} has {count} tokens the {other} lacks (ids {first}..{first + count - 1}, first "
            f"{extra.tokens[first]!r}); the tables agree on every shared id")


def _convention_findings(report: TokenizerReport, target: TokenizerInfo, draft: TokenizerInfo) -> None:
    for role, entry in report.special_tokens.items():
        if not entry["match"]:
            report.warnings.append(
                f"{role.upper()} differs: target {entry['target_id']} ({entry['target']!r}) vs draft "
                f"{entry['draft_id']} ({entry['draft']!r}); the target's is used, the draft may accept fewer tokens")
    if target.chat_template or draft.chat_template:
        report.chat_template_match = target.chat_template == draft.chat_template
        if not report.chat_template_match:
            report.warnings.append("chat templates differ; prompts use the target's template, so the draft may "
                                   "accept fewer tokens on chat prompts")


def compare_tokenizers(
    target: TokenizerInfo,
    draft: TokenizerInfo,
    *,
    target_vocab_width: int | None = None,
    draft_vocab_width: int | None = None,
    target_name: str = "target",
    draft_name: str = "draft",
) -> TokenizerReport:
    """Compare a draft's tokenizer with the target's (see the module docstring for the rules).

    Args:
        target, draft: the two tokenizers.
        target_vocab_width, draft_vocab_width: embedding rows (logits width) of each model, when known.
        target_name, draft_name: model names for the messages.
    """
    report = TokenizerReport(ok=True, target_tokens=len(target.tokens), draft_tokens=len(draft.tokens),
                             target_vocab_width=target_vocab_width, draft_vocab_width=draft_vocab_width)
    report.special_tokens = _special_tokens(target, draft)
    diffs = _table_differences(target, draft)
    if diffs:  # a different tokenizer: widths, sizes and conventions say nothing more
        shared = min(len(target.tokens), len(draft.tokens))
        report.num_differing = len(diffs)
        report.first_differences = [{"id": i, "target": target.tokens[i], "draft": draft.tokens[i]}
                                    for i in diffs[:_SHOWN_DIFFERENCES]]
        report.errors.append(_mismatch_message(target_name, draft_name, diffs, shared, target, draft))
    else:
        _width_findings(report, target)
        _table_size_findings(report, target, draft)
        _convention_findings(report, target, draft)
    report.ok = not report.errors
    return report


def require_compatible(report: TokenizerReport) -> None:
    """Log a report's warnings; raise on its errors.

    Raises:
        TokenizerMismatchError: the report holds errors (the message joins them).
    """
    for warning in report.warnings:
        logger.info("tokenizer check: %s", warning)
    if report.errors:
        raise TokenizerMismatchError("; ".join(report.errors))
