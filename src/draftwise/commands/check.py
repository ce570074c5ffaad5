"""``draftwise check TARGET DRAFT``: will this draft help this target, and what will it cost?

Exit codes: 0 when the pair is usable (the verdict says whether it pays), 1 when a check rules it out
(different tokenizers, or it does not fit the memory budget), 2 on a usage error (see :mod:`draftwise.cli`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from draftwise.benchmark import BenchPrompt, default_prompts_path, load_prompts
from draftwise.units import parse_bytes
from draftwise.check.probe import select_probe_prompts
from draftwise.check.render import render_report
from draftwise.check.runner import CheckSettings, check_models, load_and_measure
from draftwise.commands.common import CliError, add_quantization_arg, add_speculative_backend_arg

_DESCRIPTION = (
    "Check a target + draft pair before deploying it. Before loading any weights: tokenizer compatibility "
    "(identical token tables; a padded vocabulary is fine) and memory (weights and KV cache at the context "
    "length and concurrency, against --memory-budget or the memory free on the device). Then, unless "
    "--no-measure: a short greedy acceptance probe, the draft/target cost ratio and verify-cost curve on this "
    "machine, and the predicted speed-up by K with a verdict. Exit code 0: usable (read the verdict), "
    "1: ruled out, 2: usage error."
)


def register(subparsers) -> None:
    parser = subparsers.add_parser("check", help="will this draft help this target, and what will it cost?",
                                   description=_DESCRIPTION)
    parser.add_argument("target", help="target model: registry name, .gguf file, HF directory or hub id")
    parser.add_argument("draft", help="draft model, named the same ways")
    parser.add_argument("--prompts", default=None, help="JSONL prompt file (default: Spec-Bench questions)")
    parser.add_argument("--num-prompts", type=int, default=5, help="probe prompts, across categories (default 5)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per probe prompt (default 32)")
    parser.add_argument("--probe-k", type=int, default=4, help="K used by the acceptance probe (default 4)")
    parser.add_argument("--max-k", type=int, default=8, help="predict the speed-up for K = 1..max-k (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward passes per token count (default 5)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default fp32; a draft model on a GPU bf16)")
    parser.add_argument("--memory-budget", default=None,
                        help="memory for both models, e.g. 24GiB, 24GB, 512MiB (default: free on the device)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length in tokens (default: the target config's)")
    parser.add_argument("--max-num-seqs", "--concurrency", dest="max_num_seqs", type=int, default=1,
                        help="sequences whose KV caches are held at once (default 1)")
    parser.add_argument("--chat", choices=["auto", "off"], default="auto",
                        help="apply the target's chat template to probe prompts (default auto)")
    parser.add_argument("--no-measure", action="store_true",
                        help="only the tokenizer and memory checks; load no weights")
    add_quantization_arg(parser)
    add_speculative_backend_arg(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema draftwise.check/1)")
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> CheckSettings:
    """Raises CliError on invalid values."""
    try:
        budget = None if args.memory_budget is None else parse_bytes(args.memory_budget)
        return CheckSettings(device=args.device, dtype=args.dtype, memory_budget=budget,
                             max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                             measure=not args.no_measure, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                             probe_k=args.probe_k, max_k=args.max_k, repeats=args.repeats,
                             chat=args.chat == "auto", quantization=args.quantization,
                             speculative_backend=args.speculative_backend)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def probe_prompts(path: str | None, count: int) -> list[BenchPrompt]:
    """The probe prompts: ``count`` of them across categories, from ``path`` or the Spec-Bench questions.

    Raises:
        CliError: the file holds no prompts. FileNotFoundError: no prompt file.
    """
    source = Path(path) if path else default_prompts_path()
    chosen = select_probe_prompts(load_prompts(source), count)
    if not chosen:
        raise CliError(f"no prompts in {source}")
    return chosen


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    progress = Console(stderr=True)

    def on_stage(text: str) -> None:
        progress.print(f"[dim]{escape(text)} ...[/]", highlight=False)

    report = check_models(args.target, args.draft, settings, on_stage)
    if report.ok and settings.measure:  # prompts are read before the (slow) loading
        load_and_measure(report, probe_prompts(args.prompts, settings.num_prompts), settings, on_stage)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render_report(report, Console())
    return 0 if report.ok else 1
