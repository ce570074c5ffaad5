"""``draftwise bench``: plain vs speculative decoding on the same models and prompts, in one process."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from draftwise.benchmark import (
    MethodSpec,
    PromptRun,
    default_prompts_path,
    load_prompts,
    run_benchmark,
    summarize,
    write_json,
)
from draftwise.builder import DEMO_DRAFT, DEMO_TARGET, check_same_tokenizer
from draftwise.calibration import measure_forward_costs
from draftwise.commands.common import CliError, add_sampling_args, sampling_params_from_args
from draftwise.engine import SpeculativeEngine
from draftwise.models.loading import load_model
from draftwise.proposers.draft_model import DraftModelProposer

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark plain vs speculative decoding")
    parser.add_argument("--model", "--target", dest="model", default=DEMO_TARGET, help=f"target (default {DEMO_TARGET})")
    parser.add_argument("--speculative-model", "--draft", dest="draft", default=DEMO_DRAFT,
                        help=f"draft model (default {DEMO_DRAFT})")
    parser.add_argument("--ks", default="4", help="comma-separated K values to run (default 4)")
    parser.add_argument("--prompts", default=None, help="JSONL prompt file (default: Spec-Bench questions)")
    parser.add_argument("--category", default=None, help="comma-separated categories (default: all)")
    parser.add_argument("--limit", type=int, default=None, help="prompts per category")
    parser.add_argument("--chat", choices=["auto", "off"], default="auto", help="apply the chat template")
    parser.add_argument("--output", default=None, help="JSON output (default bench_results/bench-<time>.json)")
    parser.add_argument("--no-calibrate", action="store_true", help="skip the forward-cost calibration")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    add_sampling_args(parser, max_tokens=128)
    parser.set_defaults(func=run)


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise CliError(f"--ks must be comma-separated integers, got {text!r}") from exc
    if not ks or min(ks) < 1:
        raise CliError("--ks needs at least one K >= 1")
    return ks


def run(args: argparse.Namespace) -> int:
    console = Console()
    params = sampling_params_from_args(args)
    ks = parse_ks(args.ks)
    prompts_path = Path(args.prompts) if args.prompts else default_prompts_path()
    categories = [c.strip() for c in args.category.split(",")] if args.category else None
    prompts = load_prompts(prompts_path, categories, args.limit)
    if not prompts:
        raise CliError(f"no prompts selected from {prompts_path} (category={args.category})")

    console.print(f"loading target {args.model} and draft {args.draft} ...")
    target = load_model(args.model, device=args.device, dtype=args.dtype)
    draft = load_model(args.draft, device=args.device, dtype=args.dtype, max_context=target.backend.max_context)
    check_same_tokenizer(target, draft)
    eos = target.eos_token_ids
    methods = [MethodSpec("plain", SpeculativeEngine(target.backend, eos_token_ids=eos))]
    proposer = DraftModelProposer(draft.backend, target.backend.vocab_size)
    methods += [MethodSpec(f"draft K={k}", SpeculativeEngine(target.backend, proposer, k, eos_token_ids=eos), k)
                for k in ks]

    calibration: dict = {}
    target_costs = draft_cost = None
    if not args.no_calibrate:
        console.print("calibrating forward costs (target k = 1..K+1, draft k = 1) ...")
        target_costs = measure_forward_costs(target.backend, range(1, max(ks) + 2))
        draft_cost = measure_forward_costs(draft.backend, [1]).seconds[1]
        calibration = {"target": target_costs.to_dict(), "draft_1_token_s": draft_cost,
                       "cost_ratio_c": draft_cost / target_costs.seconds[1]}

    runs = _run_with_progress(console, target, methods, prompts, params, args.chat == "auto")
    summary = summarize(runs, target_costs, draft_cost)
    _print_tables(console, runs, summary, calibration)
    output = args.output or f"bench_results/bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    config = {"target": args.model, "draft": args.draft, "ks": ks, "prompts": str(prompts_path),
              "categories": categories, "limit": args.limit, "params": vars(params) if hasattr(params, "__dict__") else {}}
    path = write_json(output, config, runs, summary, calibration)
    console.print(f"wrote {path}")
    mismatches = [r for r in runs if params.greedy and not r.identical_to_plain]
    return 1 if mismatches else 0


def _run_with_progress(console, target, methods, prompts, params, chat) -> list[PromptRun]:
    total = len(prompts) * len(methods)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=total)

        def on_run(run: PromptRun) -> None:
            progress.update(task, advance=1, description=f"prompt {run.prompt_id} {run.method}")

        return run_benchmark(target, methods, prompts, params, chat=chat, on_run=on_run)


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _print_tables(console: Console, runs: list[PromptRun], summary: list[dict], calibration: dict) -> None:
    per_prompt = Table(title="per prompt")
    for column in ("prompt", "category", "method", "tokens", "tokens/s", "speedup", "alpha", "tau", "identical"):
        per_prompt.add_column(column)
    for run in runs:
        per_prompt.add_row(run.prompt_id, run.category, run.method, str(run.num_tokens), _fmt(run.tokens_per_s),
                           _fmt(run.speedup), _fmt(run.stats["acceptance_rate"] if run.k else None, ".3f"),
                           _fmt(run.stats["mean_accepted_length"] if run.k else None),
                           "yes" if run.identical_to_plain else f"NO (token {run.first_difference})")
    console.print(per_prompt)
    overall = Table(title="overall")
    for column in ("method", "tokens/s", "speedup (total)", "speedup median [min, max]", "alpha", "tau",
                   "identical", "predicted", "overhead"):
        overall.add_column(column)
    for row in summary:
        spread = (f"{_fmt(row['speedup_median'])} [{_fmt(row['speedup_min'])}, {_fmt(row['speedup_max'])}]"
                  if row["k"] else "-")
        overall.add_row(row["method"], _fmt(row["tokens_per_s"]), _fmt(row["speedup_total"]), spread,
                        _fmt(row["acceptance_rate"], ".3f"), _fmt(row["mean_accepted_length"]),
                        f"{row['identical']}/{row['prompts']}", _fmt(row.get("predicted_speedup")),
                        f"{row['overhead_share']:.1%}")
    console.print(overall)
    if calibration:
        rel = calibration["target"]["relative"]
        curve = ", ".join(f"v{k}={float(v):.2f}" for k, v in rel.items())
        console.print(f"calibration: target 1 token {calibration['target']['seconds']['1']*1000:.0f} ms; "
                      f"draft 1 token {calibration['draft_1_token_s']*1000:.0f} ms; c={calibration['cost_ratio_c']:.2f}; {curve}")
