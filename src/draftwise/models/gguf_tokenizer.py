"""A tokenizer built from a GGUF file's own token table, for files whose tokenizer ``transformers`` cannot
convert (for example llama2.c-style SentencePiece vocabularies such as stories260K's).

The vocabulary and scores come from ``tokenizer.ggml.tokens`` / ``tokenizer.ggml.scores``; the model is a
``tokenizers`` Unigram model with byte fallback and the SentencePiece ``▁`` word-boundary convention, wrapped
in a ``PreTrainedTokenizerFast``. Token ids are exactly the GGUF ids, which is what matters for decoding.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["gguf_metadata", "tokenizer_from_gguf_vocab"]


def gguf_metadata(path: str | Path, keys: tuple[str, ...]) -> dict[str, object]:
    """Read selected scalar/string/array metadata fields of a GGUF file (missing keys are omitted)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    found: dict[str, object] = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is not None:
            found[key] = field.contents()
    return found


def tokenizer_from_gguf_vocab(path: str | Path):
    """Build a ``PreTrainedTokenizerFast`` from a SentencePiece-style GGUF vocabulary.

    Raises:
        ValueError: if the file has no ``tokenizer.ggml.tokens`` table.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    meta = gguf_metadata(
        path,
        (
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.scores",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id",
        ),
    )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens table in the GGUF metadata")
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    vocab = [(str(tok), float(score)) for tok, score in zip(tokens, scores)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )

    def special(key: str) -> str | None:
        index = meta.get(key)
        return str(tokens[int(index)]) if index is not None and 0 <= int(index) < len(tokens) else None

    bos = special("tokenizer.ggml.bos_token_id")
    if bos is not None:  # SentencePiece Llama convention: every encoded text starts with BOS
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=special("tokenizer.ggml.eos_token_id"),
        unk_token=special("tokenizer.ggml.unknown_token_id"),
    )
