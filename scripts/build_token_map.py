#!/usr/bin/env python
"""Build an FR-Spec token map: a model's token ids ranked by frequency over a local corpus, most frequent first.

FR-Spec (Zhao et al. 2025) keeps the draft's LM head rows of the most frequent tokens only; this script makes
the ranking (SGLang's ``--speculative-token-map``, here a ``.npy`` of int32 or a text file of ids). The corpus
is local, with no network: by default the Python standard library and installed packages, the text
documentation under /usr/share/doc, C headers and global node packages' JavaScript / HTML (see
``draftwise.frspec.DEFAULT_SOURCES``); ``--corpus DIR`` replaces it. Never point it at a benchmark's prompts:
the ranking would be fitted to what is measured.

    python scripts/build_token_map.py qwen2.5-coder-0.5b --top 65536 --output data/token_maps/qwen2.5-HASH.npy
    python scripts/build_token_map.py MODEL --output map.npy --corpus ~/src --max-bytes 64000000

With ``--output`` left out, the map goes to ``data/token_maps/<label>-<vocabulary hash>.npy``, the name under
which ``draft_vocab_size`` finds it without a ``token_map`` (the hash is over the tokenizer's id -> token table).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from draftwise.frspec import (TOKEN_MAPS_DIR, CorpusSource, DEFAULT_SOURCES, corpus_texts, count_tokens,
                              rank_tokens, save_token_map, vocabulary_hash)
from draftwise.models.loading import load_tokenizer

logger = logging.getLogger("build_token_map")

#: Text and code files read from a ``--corpus`` directory.
CORPUS_PATTERNS = ("*.py", "*.md", "*.rst", "*.txt", "*.c", "*.h", "*.cc", "*.cpp", "*.js", "*.ts", "*.java",
                   "*.go", "*.rs", "*.sh", "*.html", "*.css", "*.json", "*.toml", "*.yaml", "*.yml")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="registry name, .gguf file, Hugging Face directory or hub id (its tokenizer)")
    parser.add_argument("--output", default=None, help="the map (.npy: int32; other suffixes: text, one id a line); "
                        "default data/token_maps/<label>-<vocabulary hash>.npy")
    parser.add_argument("--label", default=None, help="file-name label for the default output (default: the model)")
    parser.add_argument("--top", type=int, default=None, help="keep only the N highest-ranked ids (default: all)")
    parser.add_argument("--max-bytes", type=int, default=40_000_000, help="corpus budget in bytes (default 40 MB)")
    parser.add_argument("--per-file-bytes", type=int, default=65_536, help="at most this much of each file")
    parser.add_argument("--corpus", action="append", default=None, metavar="DIR",
                        help="read these directories instead of the default local sources (repeatable)")
    return parser.parse_args(argv)


def corpus_sources(dirs: list[str] | None) -> tuple[CorpusSource, ...]:
    """The default sources, or one source per ``--corpus`` directory."""
    if not dirs:
        return DEFAULT_SOURCES
    return tuple(CorpusSource(Path(d).name or d, Path(d).expanduser(), CORPUS_PATTERNS) for d in dirs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.top is not None and args.top < 1:
        logger.error("--top must be >= 1, got %d", args.top)
        return 2
    tokenizer = load_tokenizer(args.model)
    vocab = tokenizer.get_vocab()
    started = time.perf_counter()
    texts = list(corpus_texts(args.max_bytes, per_file_bytes=args.per_file_bytes, sources=corpus_sources(args.corpus)))
    if not texts:
        logger.error("the corpus is empty: no readable files under the given sources")
        return 1
    counts = count_tokens(tokenizer, texts, max(vocab.values()) + 1)
    ranked = rank_tokens(counts, vocab.values())
    if args.top is not None:
        ranked = ranked[: args.top]
    label = args.label or Path(args.model).stem
    output = Path(args.output) if args.output else TOKEN_MAPS_DIR / f"{label}-{vocabulary_hash(tokenizer)}.npy"
    save_token_map(output, ranked)
    seen = int((counts > 0).sum())
    corpus_bytes = sum(len(t.encode("utf-8", "replace")) for t in texts)
    logger.info("%d files, %.1f MB, %d tokens in %.1f s; %d of %d ids seen", len(texts), corpus_bytes / 1e6,
                int(counts.sum()), time.perf_counter() - started, seen, len(vocab))
    for size in (1024, 4096, 16384, 32768, 65536):
        if size < len(ranked):
            logger.info("top %6d ids: %.2f%% of the corpus's tokens", size,
                        100 * counts[ranked[:size]].sum() / max(1, counts.sum()))
    logger.info("wrote %d ranked ids to %s (vocabulary hash %s)", len(ranked), output, vocabulary_hash(tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
