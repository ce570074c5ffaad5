"""``draftwise`` command line: pull, generate, bench (and more subcommands as they land).

Each subcommand lives in :mod:`draftwise.commands` and registers itself; user errors print one line and
exit with code 2, never a traceback. Long library work (loading, dequantizing, self-tests, calibration) shows
as progress lines on stderr (:mod:`draftwise.progress`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from draftwise import __version__

__all__ = ["main", "build_parser"]

# One module per subcommand in draftwise.commands, each with register(subparsers).
_COMMANDS = ("pull", "generate", "bench", "serve", "check", "costs", "train_heads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftwise", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"draftwise {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"draftwise.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    from draftwise.commands.common import CliError
    from draftwise.models.loading import ModelLoadError
    from draftwise.progress import progress_lines

    args = build_parser().parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with progress_lines(model_roles(args)):
        try:
            return int(args.func(args) or 0)
        except (CliError, ModelLoadError, ValueError, FileNotFoundError) as exc:
            print(f"draftwise {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130


def model_roles(args: argparse.Namespace) -> dict[str, str]:
    """Model spec -> ``"target"``, ``"draft"`` or ``"target/draft"`` from a subcommand's model flags, for the
    progress lines."""
    roles: dict[str, str] = {}
    named = [(getattr(args, name, None), "target") for name in ("model", "target", "model_tag", "model_flag")]
    named += [(getattr(args, name, None), "draft") for name in ("draft", "speculative_model")]
    named.append((_config_model(getattr(args, "speculative_config", None)), "draft"))
    for spec, role in named:
        if not isinstance(spec, str) or not spec or spec.lower() == "none" or role in roles.get(spec, "").split("/"):
            continue
        roles[spec] = f"{roles[spec]}/{role}" if spec in roles else role
    return roles


def _config_model(config: object) -> str | None:
    """The ``model`` of a ``--speculative-config`` JSON string (None when absent or not valid JSON: the
    subcommand reports that itself)."""
    if not isinstance(config, str):
        return None
    try:
        fields = json.loads(config)
    except ValueError:
        return None
    model = fields.get("model") if isinstance(fields, dict) else None
    return model if isinstance(model, str) else None


if __name__ == "__main__":
    sys.exit(main())
