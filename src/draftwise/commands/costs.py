"""``draftwise costs``: the verify-cost curve of a model on this machine.

For k new tokens on top of a ``--context``-token cache it prints the median forward time, ``v_k`` (that time
over one token's) and the time per token. Speculation with K draft tokens pays only where ``v_(K+1)`` stays
well below K + 1; with ``--draft`` it also prints the draft/target cost ratio c of one-token passes.
"""

from __future__ import annotations

import argparse
import json
import logging

from rich.console import Console
from rich.table import Table

from draftwise.builder import DEMO_TARGET
from draftwise.calibration import ForwardCosts, measure_forward_costs
from draftwise.commands.common import CliError, add_quantization_arg
from draftwise.models.loading import load_model

__all__ = ["register", "run", "parse_token_counts"]

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("costs", help="measure the verify-cost curve (k-token forward / 1-token forward)")
    parser.add_argument("model", nargs="?", default=DEMO_TARGET, help=f"model to time (default {DEMO_TARGET})")
    add_quantization_arg(parser)
    parser.add_argument("--max-k", type=int, default=16, help="time k = 1..MAX_K new tokens (default 16)")
    parser.add_argument("--ks", default=None, help="comma-separated token counts instead of 1..MAX_K")
    parser.add_argument("--context", type=int, default=200, help="tokens in the cache under each pass (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per k; the median is kept (default 5)")
    parser.add_argument("--draft", "--speculative-model", dest="draft", default=None,
                        help="also time this draft model's one-token pass and print the cost ratio c")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def parse_token_counts(ks: str | None, max_k: int) -> list[int]:
    """``--ks`` (comma-separated) or 1..max_k, sorted, with 1 always included.

    Raises:
        CliError: non-integers or a count below 1.
    """
    if ks is None:
        if max_k < 1:
            raise CliError(f"--max-k must be >= 1, got {max_k}")
        return list(range(1, max_k + 1))
    try:
        counts = {int(part) for part in ks.split(",") if part.strip()}
    except ValueError as exc:
        raise CliError(f"--ks must be comma-separated integers, got {ks!r}") from exc
    if not counts or min(counts) < 1:
        raise CliError("--ks needs token counts >= 1")
    return sorted(counts | {1})


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.context < 1:
        raise CliError("--repeats and --context must be >= 1")
    ks = parse_token_counts(args.ks, args.max_k)
    console = Console(stderr=args.json)
    options = dict(device=args.device, dtype=args.dtype, quantization=args.quantization, runtime=args.runtime)
    console.print(f"loading {args.model} (quantization {args.quantization}) ...")
    target = load_model(args.model, **options)
    context = _fit_context(args.context, target.backend.max_context, ks[-1])
    console.print(f"timing k = {ks[0]}..{ks[-1]} new tokens on a {context}-token context, {args.repeats} repeats ...")
    costs = measure_forward_costs(target.backend, ks, context_len=context, repeats=args.repeats)
    draft_s = None
    if args.draft:
        console.print(f"loading draft {args.draft} ...")
        draft = load_model(args.draft, **options)
        draft_s = measure_forward_costs(draft.backend, [1], context_len=context, repeats=args.repeats).seconds[1]
    if args.json:
        print(json.dumps(_result_dict(args, costs, draft_s), indent=2))
    else:
        _print_curve(console, args, costs, draft_s)
    return 0


def _fit_context(context: int, max_context: int, max_k: int) -> int:
    """The context length actually used: ``context`` lowered so that context + max_k fits the model."""
    fitted = min(context, max_context - max_k)
    if fitted < 1:
        raise CliError(f"the model's context of {max_context} tokens cannot hold {max_k} new tokens")
    return fitted


def _result_dict(args: argparse.Namespace, costs: ForwardCosts, draft_s: float | None) -> dict:
    result = {"model": args.model, "quantization": args.quantization, "repeats": args.repeats, **costs.to_dict()}
    if draft_s is not None:
        result.update(draft=args.draft, draft_1_token_s=draft_s, cost_ratio_c=draft_s / costs.seconds[1])
    return result


def _print_curve(console: Console, args: argparse.Namespace, costs: ForwardCosts, draft_s: float | None) -> None:
    table = Table(title=f"{args.model} ({args.quantization}), context {costs.context_len} tokens, "
                        f"median of {args.repeats}")
    for column in ("k", "forward ms", "v_k = t_k / t_1", "ms / token"):
        table.add_column(column, justify="right")
    for k, seconds in sorted(costs.seconds.items()):
        table.add_row(str(k), f"{seconds * 1e3:.1f}", f"{costs.relative(k):.2f}", f"{seconds * 1e3 / k:.1f}")
    console.print(table)
    one = costs.seconds[1]
    line = f"one token: {one * 1e3:.1f} ms ({1 / one:.2f} tokens/s)"
    if draft_s is not None:
        line += f"; draft {args.draft}: {draft_s * 1e3:.1f} ms per token, c = {draft_s / one:.3f}"
    console.print(line)
